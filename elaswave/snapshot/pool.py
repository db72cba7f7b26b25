"""The snapshot pool: after every step each rank copies its ZeRO chunks into a peer's memory.

Placement is a ring over the epoch's ranks (:meth:`Plan.snapshot_holder`): rank ``r`` sends to the
next rank and keeps the previous one's. A snapshot travels as a small header (generation, CRC-32,
chunk keys) and the payload in one asynchronous message, so the copy overlaps the next step's
compute. The holder verifies it before the next step's update may start (the step's loss exchange
carries a "verified" flag from every holder), which is what lets every rank drop the generation
before: a recovery then always finds one generation that every chunk has somewhere.

A holder keeps one verified generation at rest. From its verification until the step's exchange
proves *every* holder verified the same generation (:meth:`commit`), it keeps the one before too:
otherwise two owners dying in that window, one of whose holders had verified and one not, would
leave no generation common to all chunks.
"""
from __future__ import annotations

import sys
import zlib
from typing import Callable

import torch

from elaswave.comm.groups import Group
from elaswave.plan.chunks import ChunkKey
from elaswave.plan.plan import Plan

TAG_SNAPSHOT = 1_000_001


def crc32(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().cpu().contiguous().numpy())


def _sizes(k: int, chunk_numel: int) -> tuple[int, int]:
    """Bytes of a snapshot message's header (int64: generation, CRC-32, k, then k keys) and payload."""
    return 8 * (3 + 2 * k), 4 * k * 3 * chunk_numel


class SnapshotPool:
    """One message per snapshot -- header and payload in one byte buffer -- so a step costs one send,
    one receive and one wait on each side; the buffers are reused from step to step."""

    def __init__(self, rank: int, chunk_numel: int, verify_wait_s: float = 2.0):
        """``verify_wait_s``: how long :meth:`verify` may block on an owner that sent nothing (a hung
        one); the heartbeat timeout, within which a hung rank is declared gone anyway."""
        self.rank, self.chunk_numel, self.verify_wait_s = rank, chunk_numel, verify_wait_s
        self.held: dict[tuple[int, int], tuple[tuple[ChunkKey, ...], torch.Tensor, torch.Tensor]] = {}
        """(owner, generation) -> (chunk keys, [k, 3, chunk_numel] payload in CPU memory, its buffer)."""
        self._send: tuple | None = None
        self._out: torch.Tensor | None = None
        self._incoming = None
        self._spare: list[torch.Tensor] = []
        self.owner: int | None = None

    # -- the owner's side ---------------------------------------------------------------------
    def send(self, group: Group, plan: Plan, gen: int, keys: list[ChunkKey], fill: Callable[[torch.Tensor], object],
             device: torch.device, corrupt: bool = False) -> None:
        """Post this rank's snapshot of generation ``gen``; ``fill(out)`` writes the chunks' state
        into ``out`` (``[len(keys), 3, chunk_numel]``, part of the message buffer: no extra copy).
        ``corrupt``: damage it after the checksum (fault injection)."""
        holder = plan.snapshot_holder(self.rank)
        if holder is None:
            return
        hbytes, pbytes = _sizes(len(keys), self.chunk_numel)
        if self._out is None or self._out.numel() != hbytes + pbytes or self._out.device != device:
            self._out = torch.empty(hbytes + pbytes, dtype=torch.uint8, device=device)
        payload = self._out[hbytes:].view(torch.float32).view(len(keys), 3, self.chunk_numel)
        fill(payload)
        header = torch.tensor([gen, crc32(payload), len(keys)] + [x for k in keys for x in k], dtype=torch.int64)
        self._out[:hbytes].view(torch.int64).copy_(header)
        if corrupt and pbytes:
            self._out[hbytes] ^= 0x01
        self._send = (group.isend(self._out, holder, TAG_SNAPSHOT), holder)

    def wait_sends(self, group: Group) -> None:
        """Called once the step's exchange proved the holder verified the snapshot: the send is
        done, so it is waited on directly."""
        if self._send is not None:
            work, holder = self._send
            self._send = None
            group.wait_direct(work, f"snapshot to rank {holder}")

    # -- the holder's side --------------------------------------------------------------------
    def expect(self, group: Group, plan: Plan, device: torch.device) -> None:
        """Post the receive of the owner's next snapshot."""
        self.owner = plan.snapshot_owner(self.rank)
        if self.owner is None:
            self._incoming = None
            return
        k = len(plan.chunks_of(self.owner))
        hbytes, pbytes = _sizes(k, self.chunk_numel)
        fits = [b for b in self._spare if b.numel() == hbytes + pbytes and b.device == device]
        buf = fits[0] if fits else torch.empty(hbytes + pbytes, dtype=torch.uint8, device=device)
        # Buffers of another size (an owner of another epoch) are not kept for later.
        self._spare = [b for b in self._spare if b is not buf and b.numel() == hbytes + pbytes]
        self._incoming = (group.irecv(buf, self.owner, TAG_SNAPSHOT), buf, k)

    def verify(self, group: Group, gen: int) -> bool:
        """Wait for the expected snapshot of generation ``gen``; keep it if its checksum is right."""
        if self._incoming is None:
            return True
        work, buf, k = self._incoming
        self._incoming = None
        # Waited for here, on this thread: it was sent a whole step ago and is almost always in,
        # and no helper thread waking mid-step competes with the compute for the GIL. A dead
        # owner fails the wait at once; a hung one within verify_wait_s.
        group.wait_direct(work, f"snapshot from rank {self.owner}", self.verify_wait_s)
        buf = buf.cpu()
        hbytes, _ = _sizes(k, self.chunk_numel)
        h = buf[:hbytes].view(torch.int64).tolist()
        payload = buf[hbytes:].view(torch.float32).view(k, 3, self.chunk_numel)
        if h[0] != gen or h[2] != k or h[1] != crc32(payload):
            self._spare.append(buf)
            # Not fatal: the owner is alive and holds this state itself. Until a snapshot of it
            # verifies, its chunks are recoverable only from the generation held before.
            older = sorted(g for (o, g) in self.held if o == self.owner)
            print(f"elaswave: WARNING: rank {self.rank}: the snapshot of rank {self.owner} for step {gen} failed its "
                  f"checksum (header step {h[0]}, {h[2]} chunks); it is discarded and nobody drops an older "
                  f"generation this step (kept here: {older or 'none'}); the next step's snapshot replaces it",
                  file=sys.stderr, flush=True)
            return False
        keys = tuple((h[3 + 2 * i], h[4 + 2 * i]) for i in range(k))
        self.held[(self.owner, gen)] = (keys, payload, buf)
        self._drop_before(gen - 1)
        return True

    def commit(self, gen: int) -> None:
        """Every holder verified generation ``gen``: the ones before are no longer needed."""
        self._drop_before(gen)

    def _drop_before(self, gen: int) -> None:
        for old in [k for k in self.held if k[1] < gen]:
            self._spare.append(self.held.pop(old)[2])

    def holding(self) -> dict[int, list[ChunkKey]]:
        out: dict[int, list[ChunkKey]] = {}
        for (_, g), (keys, _, _) in self.held.items():
            out.setdefault(g, []).extend(keys)
        return out

    def chunk(self, key: ChunkKey, gen: int) -> torch.Tensor:
        for (_, g), (keys, payload, _) in self.held.items():
            if g == gen and key in keys:
                return payload[keys.index(key)].clone()
        raise KeyError(f"no snapshot of chunk {key} at step {gen} here")

    def bytes_held(self) -> int:
        """Verified snapshots kept for peers (payload bytes)."""
        return sum(p.numel() * p.element_size() for _, p, _ in self.held.values())

    def bytes_buffered(self) -> int:
        """Transfer buffers: this rank's outgoing message and the receive buffers (in flight or spare)."""
        bufs = ([self._out] if self._out is not None else []) + self._spare
        bufs += [self._incoming[1]] if self._incoming is not None else []
        return sum(b.numel() for b in bufs)

    def reset(self) -> None:
        """A new epoch re-pairs owners and holders; what is held stays a recovery source until the
        next verified snapshot replaces it."""
        self._incoming = None
        self._send = None
        self._out = None  # a send of the old epoch may still read the old buffer
