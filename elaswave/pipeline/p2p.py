"""Activation and gradient transfer between neighbouring (virtual) stages of one pipeline.

Sends are asynchronous (kept alive until :meth:`P2P.drain`); receives wait with the epoch group's
bounded, interruptible wait. Tags keep activations and gradients of different micro-batches (and
model chunks) apart on gloo; NCCL matches by order, which the schedule keeps the same on both sides.

With ``num_chunks`` V > 1 (interleaved 1F1B) the ranks of a pipeline form a ring: chunk ``c`` of
the last rank feeds chunk ``c + 1`` of the first. A pipeline of one rank sends to itself: such a
message stays in this process (no transport carries a message to its own sender).
"""
from __future__ import annotations

import torch

from elaswave.comm.groups import Group


class P2P:
    """``prev_rank``/``next_rank``: the neighbours (round the ring with chunks; None at a
    pipeline's ends without); ``first``/``last``: whether this rank is its pipeline's first or last."""

    def __init__(self, group: Group, prev_rank: int | None, next_rank: int | None, shape: tuple[int, ...],
                 device: torch.device, dtype: torch.dtype = torch.float32, num_chunks: int = 1,
                 first: bool = False, last: bool = False):
        self.group = group
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self.shape, self.device, self.dtype = shape, device, dtype
        self.num_chunks, self.first, self.last = num_chunks, first, last
        self.pending: list = []
        self._loopback: dict[int, torch.Tensor] = {}

    def _tag(self, mb: int, chunk: int, grad: bool) -> int:
        """The receiving chunk's message of ``mb`` (V = 1: 2 mb, 2 mb + 1 as before chunks)."""
        return 2 * (mb * self.num_chunks + chunk) + grad

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        # In the compute dtype whatever a layer returned (e.g. float32 from a user's float32 buffer):
        # the receiver's buffer has that dtype, and gloo moves bytes.
        t = t.detach().to(self.dtype).contiguous()
        if dst == self.group.me:
            self._loopback[tag] = t.clone()
            return
        self.pending.append((self.group.isend(t, dst, tag), t))

    def _recv(self, src: int, tag: int, what: str, rows: int | None = None) -> torch.Tensor:
        if src == self.group.me:
            return self._loopback.pop(tag)
        shape = self.shape if rows is None else (rows, *self.shape[1:])
        buf = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.group.wait(self.group.irecv(buf, src, tag), f"{what} from rank {src}")
        return buf

    # ``peer``: a rank other than the pipeline neighbour, for a micro-batch on a detour.
    # ``chunk``: the sending chunk for a send, the receiving chunk for a receive.
    def send_act(self, t: torch.Tensor, mb: int, peer: int | None = None, chunk: int = 0) -> None:
        self._send(t, self.next_rank if peer is None else peer, self._tag(mb, chunk + self.last * (self.num_chunks > 1),
                                                                          False))

    def send_grad(self, t: torch.Tensor, mb: int, peer: int | None = None, chunk: int = 0) -> None:
        self._send(t, self.prev_rank if peer is None else peer, self._tag(mb, chunk - self.first * (self.num_chunks > 1),
                                                                          True))

    # ``rows``: a reshaped micro-batch's sequences (default: the configured micro-batch size).
    def recv_act(self, mb: int, peer: int | None = None, rows: int | None = None, chunk: int = 0) -> torch.Tensor:
        return self._recv(self.prev_rank if peer is None else peer, self._tag(mb, chunk, False),
                          f"activation of micro-batch {mb}" + (f", chunk {chunk}" if chunk else ""), rows)

    def recv_grad(self, mb: int, peer: int | None = None, rows: int | None = None, chunk: int = 0) -> torch.Tensor:
        return self._recv(self.next_rank if peer is None else peer, self._tag(mb, chunk, True),
                          f"gradient of micro-batch {mb}" + (f", chunk {chunk}" if chunk else ""), rows)

    def drain(self) -> None:
        for work, _ in self.pending:
            self.group.wait(work, "pipeline send")
        self.pending.clear()
        self._loopback.clear()
