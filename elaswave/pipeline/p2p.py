"""Activation and gradient transfer between neighbouring stages of one pipeline.

Sends are asynchronous (kept alive until :meth:`P2P.drain`); receives wait with the epoch group's
bounded, interruptible wait. Tags keep activations and gradients of different micro-batches apart
on gloo; NCCL matches by order, which the schedule keeps the same on both sides.
"""
from __future__ import annotations

import torch

from elaswave.comm.groups import Group


class P2P:
    def __init__(self, group: Group, prev_rank: int | None, next_rank: int | None, shape: tuple[int, ...],
                 device: torch.device, dtype: torch.dtype = torch.float32):
        self.group = group
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self.shape, self.device, self.dtype = shape, device, dtype
        self.pending: list = []

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        # In the compute dtype whatever a layer returned (e.g. float32 from a user's float32 buffer):
        # the receiver's buffer has that dtype, and gloo moves bytes.
        t = t.detach().to(self.dtype).contiguous()
        self.pending.append((self.group.isend(t, dst, tag), t))

    def _recv(self, src: int, tag: int, what: str, rows: int | None = None) -> torch.Tensor:
        shape = self.shape if rows is None else (rows, *self.shape[1:])
        buf = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.group.wait(self.group.irecv(buf, src, tag), f"{what} from rank {src}")
        return buf

    # ``peer``: a rank other than the pipeline neighbour, for a micro-batch on a detour.
    def send_act(self, t: torch.Tensor, mb: int, peer: int | None = None) -> None:
        self._send(t, self.next_rank if peer is None else peer, 2 * mb)

    def send_grad(self, t: torch.Tensor, mb: int, peer: int | None = None) -> None:
        self._send(t, self.prev_rank if peer is None else peer, 2 * mb + 1)

    # ``rows``: a reshaped micro-batch's sequences (default: the configured micro-batch size).
    def recv_act(self, mb: int, peer: int | None = None, rows: int | None = None) -> torch.Tensor:
        return self._recv(self.prev_rank if peer is None else peer, 2 * mb, f"activation of micro-batch {mb}", rows)

    def recv_grad(self, mb: int, peer: int | None = None, rows: int | None = None) -> torch.Tensor:
        return self._recv(self.next_rank if peer is None else peer, 2 * mb + 1, f"gradient of micro-batch {mb}", rows)

    def drain(self) -> None:
        for work, _ in self.pending:
            self.group.wait(work, "pipeline send")
        self.pending.clear()
