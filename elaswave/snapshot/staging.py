"""Where a kept snapshot lives, how it gets there, and the checksum its message carries.

On CPU the receive buffer is already host memory: it is kept as it is, and the checksum is zlib's
CRC-32 (several GB/s; torch's reductions are five times slower there). On a GPU the device holds
only the messages in flight: a verified snapshot is kept in pinned host memory, copied on a side
stream, so the copy neither waits for the compute stream nor delays it, and the device memory of
each peer's snapshot is one receive buffer (the memory model's ``snapshots_to_host``). A CRC would
need the payload on the host first -- on the owner, a read-back that waits for the step's whole
compute stream -- so on a GPU the checksum is the sum, modulo 2^64, of the payload's 64-bit words, computed
on the device by the owner (on its compute stream, after the state is written) and by the holder
(on the side stream, beside the copy). Integer addition is associative, so both sums agree
whatever order the kernels add in, and one flipped bit changes it. Both ends of a message are on the
same kind of device (one backend per job), so they use the same checksum.
"""
from __future__ import annotations

import zlib

import torch


def checksum(payload: torch.Tensor) -> torch.Tensor:
    """The checksum of a message's payload bytes (uint8, a multiple of 8), as one int64 on their device."""
    return checksum_of([payload], payload.device)


def checksum_of(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The checksum of ``parts`` (uint8, each a multiple of 8 bytes) laid end to end -- what the
    holder computes over the payload it receives -- without laying them end to end."""
    if device.type == "cpu":
        crc = 0
        for p in parts:
            crc = zlib.crc32(p.detach().contiguous().numpy(), crc)
        return torch.tensor([crc], dtype=torch.int64)
    total = torch.zeros(1, dtype=torch.int64, device=device)
    for p in parts:
        total += word_sum(p)
    return total


def word_sum(payload: torch.Tensor) -> torch.Tensor:
    """The sum of ``payload``'s 64-bit words (its bytes a multiple of 8, as every snapshot part's
    are), wrapping: summing 32-bit words into int64 would first copy them all to int64 on the device."""
    return payload.view(torch.int64).sum().reshape(1)


class Staged:
    """A received message on its way to where it is kept: ``wait()`` returns it there."""

    def __init__(self, kept: torch.Tensor, check: torch.Tensor, done: torch.cuda.Event | None):
        self.kept, self.check, self._done = kept, check, done

    def wait(self) -> torch.Tensor:
        if self._done is not None:
            self._done.synchronize()  # the side stream only: the copy, not the compute
        return self.kept


class HostStaging:
    def __init__(self, device: torch.device):
        self.device = device
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._spare: list[torch.Tensor] = []
        """Pinned host buffers of snapshots no longer kept (GPU only)."""
        self._header: torch.Tensor | None = None

    def header(self, ints: list[int]) -> torch.Tensor:
        """The header's integers, in memory a device copy can read without a sync (pinned on a GPU),
        kept until the next header: the copy may not have run when the caller returns."""
        t = torch.tensor(ints, dtype=torch.int64)
        self._header = t.pin_memory() if self.side is not None else t
        return self._header

    def start(self, message: torch.Tensor, hbytes: int) -> Staged:
        """Begin moving a received ``message`` (its receive is complete) to where it is kept, with its
        payload's checksum."""
        if self.side is None:
            return Staged(message, checksum(message[hbytes:]), None)
        fits = [b for b in self._spare if b.numel() == message.numel()]
        host = fits[0] if fits else torch.empty(message.numel(), dtype=torch.uint8, pin_memory=True)
        self._spare = [b for b in self._spare if b is not host]
        check = torch.empty(1, dtype=torch.int64, pin_memory=True)
        done = torch.cuda.Event()
        with torch.cuda.stream(self.side):
            # The receive completed (its work was waited for on the host), so nothing on the side
            # stream needs ordering after the communication stream.
            check.copy_(word_sum(message[hbytes:]), non_blocking=True)
            host.copy_(message, non_blocking=True)
            done.record()
        return Staged(host, check, done)

    def recheck(self, kept: torch.Tensor, hbytes: int) -> int:
        """The checksum of a kept message's payload now, as :meth:`start` computed it on arrival
        (on a GPU the word sum, here on the host copy: the same integers in any order)."""
        payload = kept[hbytes:]
        return int((checksum(payload) if self.side is None else word_sum(payload)).item())

    def recycle(self, kept: torch.Tensor) -> bool:
        """Take back a kept message's buffer if it is one of this staging's host buffers."""
        if self.side is None:
            return False
        self._spare.append(kept)
        return True
