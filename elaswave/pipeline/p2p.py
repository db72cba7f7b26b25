"""Activation and gradient transfer between neighbouring stages of one pipeline.

Sends are asynchronous (kept alive until :meth:`P2P.drain`); receives block with a timeout. Tags
keep activations and gradients of different micro-batches apart on gloo; NCCL matches by order,
which the schedule keeps the same on both sides.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from elaswave.comm import backend


class P2P:
    def __init__(self, prev_rank: int | None, next_rank: int | None, shape: tuple[int, ...],
                 device: torch.device, timeout_s: float):
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self.shape, self.device, self.timeout_s = shape, device, timeout_s
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        t = t.detach().contiguous()
        self.pending.append((dist.isend(t, dst=dst, tag=tag), t))

    def _recv(self, src: int, tag: int, what: str) -> torch.Tensor:
        buf = torch.empty(self.shape, dtype=torch.float32, device=self.device)
        backend.wait(dist.irecv(buf, src=src, tag=tag), self.timeout_s, f"{what} from rank {src}")
        return buf

    def send_act(self, t: torch.Tensor, mb: int) -> None:
        self._send(t, self.next_rank, 2 * mb)

    def send_grad(self, t: torch.Tensor, mb: int) -> None:
        self._send(t, self.prev_rank, 2 * mb + 1)

    def recv_act(self, mb: int) -> torch.Tensor:
        return self._recv(self.prev_rank, 2 * mb, f"activation of micro-batch {mb}")

    def recv_grad(self, mb: int) -> torch.Tensor:
        return self._recv(self.next_rank, 2 * mb + 1, f"gradient of micro-batch {mb}")

    def drain(self) -> None:
        for work, _ in self.pending:
            backend.wait(work, self.timeout_s, "pipeline send")
        self.pending.clear()
