"""The snapshot pool: after every step each rank copies its ZeRO chunks into a peer's memory.

Placement is a ring over the epoch's ranks (:meth:`Plan.snapshot_holders`): rank ``r`` sends to the
next ``K`` ranks (``elastic.snapshot_copies``) and keeps the previous ``K`` ones', so a rank dying
together with up to ``K - 1`` of its holders still leaves a copy. A snapshot travels as a small
header (generation, checksum, chunk keys) and the payload in one asynchronous message per holder --
the same buffer, written once -- so the copies overlap the next step's compute. The holder verifies it before the next step's update may start (the step's loss exchange
carries a "verified" flag from every holder), which is what lets every rank drop the generation
before: a recovery then always finds one generation that every chunk has somewhere.

A holder keeps one verified generation at rest. From its verification until the step's exchange
proves *every* holder verified the same generation (:meth:`commit`), it keeps the one before too:
otherwise two owners dying in that window, one of whose holders had verified and one not, would
leave no generation common to all chunks.
"""
from __future__ import annotations

import sys
from typing import Callable

import torch

from elaswave.comm.groups import Group
from elaswave.plan.chunks import ChunkKey
from elaswave.plan.plan import Plan
from elaswave.snapshot.staging import HostStaging, Staged, checksum

TAG_SNAPSHOT = 1_000_001


def _sizes(k: int, chunk_numel: int) -> tuple[int, int]:
    """Bytes of a snapshot message's header (int64: generation, checksum, k, then k keys) and payload."""
    return 8 * (3 + 2 * k), 4 * k * 3 * chunk_numel


class SnapshotPool:
    """One message per snapshot and holder -- header and payload in one byte buffer -- so a step
    costs one send per holder, one receive per owner and a wait on each; the buffers are reused
    from step to step."""

    def __init__(self, rank: int, chunk_numel: int, verify_wait_s: float = 2.0):
        """``verify_wait_s``: how long :meth:`verify` may block on an owner that sent nothing (a hung
        one); the heartbeat timeout, within which a hung rank is declared gone anyway."""
        self.rank, self.chunk_numel, self.verify_wait_s = rank, chunk_numel, verify_wait_s
        self.held: dict[tuple[int, int], tuple[tuple[ChunkKey, ...], torch.Tensor, torch.Tensor]] = {}
        """(owner, generation) -> (chunk keys, [k, 3, chunk_numel] payload in host memory, its buffer)."""
        self._sends: list[tuple[object, int]] = []
        self._out: torch.Tensor | None = None
        self._incoming: list[tuple[object, torch.Tensor, int, int]] = []
        """(receive, buffer, chunk count, owner) per owner whose next snapshot is expected."""
        self._spare: list[torch.Tensor] = []
        self._staging: HostStaging | None = None

    def _staging_on(self, device: torch.device) -> HostStaging:
        if self._staging is None or self._staging.device != device:
            self._staging = HostStaging(device)
        return self._staging

    # -- the owner's side ---------------------------------------------------------------------
    def send(self, group: Group, plan: Plan, gen: int, keys: list[ChunkKey], fill: Callable[[torch.Tensor], object],
             device: torch.device, corrupt: bool = False) -> None:
        """Post this rank's snapshot of generation ``gen`` to each of its holders; ``fill(out)``
        writes the chunks' state into ``out`` (``[len(keys), 3, chunk_numel]``, part of the message
        buffer: no extra copy). ``corrupt``: damage it after the checksum (fault injection)."""
        holders = plan.snapshot_holders(self.rank)
        if not holders:
            return
        hbytes, pbytes = _sizes(len(keys), self.chunk_numel)
        if self._out is None or self._out.numel() != hbytes + pbytes or self._out.device != device:
            self._out = torch.empty(hbytes + pbytes, dtype=torch.uint8, device=device)
        payload = self._out[hbytes:].view(torch.float32).view(len(keys), 3, self.chunk_numel)
        fill(payload)
        # No read-back on a GPU: the header's integers come from pinned memory and the checksum is
        # written on the device, after the state it sums.
        header = self._out[:hbytes].view(torch.int64)
        ints = [gen, 0, len(keys)] + [x for k in keys for x in k]
        header.copy_(self._staging_on(device).header(ints), non_blocking=True)
        header[1:2].copy_(checksum(self._out[hbytes:]))
        if corrupt and pbytes:
            self._out[hbytes] ^= 0x01
        self._sends = [(group.isend(self._out, holder, TAG_SNAPSHOT), holder) for holder in holders]

    def wait_sends(self, group: Group) -> None:
        """Called once the step's exchange proved the holders verified the snapshot: the sends are
        done, so they are waited on directly."""
        sends, self._sends = self._sends, []
        for work, holder in sends:
            group.wait_direct(work, f"snapshot to rank {holder}")

    # -- the holder's side --------------------------------------------------------------------
    def expect(self, group: Group, plan: Plan, device: torch.device) -> None:
        """Post the receives of the owners' next snapshots."""
        owners = plan.snapshot_owners(self.rank)
        sizes = [sum(_sizes(len(plan.chunks_of(o)), self.chunk_numel)) for o in owners]
        # Buffers of another size (owners of another epoch) are not kept for later.
        spare = [b for b in self._spare if b.device == device and b.numel() in sizes]
        self._incoming = []
        for owner, size in zip(owners, sizes):
            fits = [b for b in spare if b.numel() == size]
            buf = fits[0] if fits else torch.empty(size, dtype=torch.uint8, device=device)
            spare = [b for b in spare if b is not buf]
            self._incoming.append((group.irecv(buf, owner, TAG_SNAPSHOT), buf, len(plan.chunks_of(owner)), owner))
        self._spare = spare

    def verify(self, group: Group, gen: int) -> bool:
        """Wait for the expected snapshots of generation ``gen``; keep each whose checksum is right.
        True when every one was."""
        incoming, self._incoming = self._incoming, []
        staged = []
        for work, buf, k, owner in incoming:
            # Waited for here, on this thread: it was sent a whole step ago and is almost always
            # in, and no helper thread waking mid-step competes with the compute for the GIL. A
            # dead owner fails the wait at once; a hung one within verify_wait_s.
            group.wait_direct(work, f"snapshot from rank {owner}", self.verify_wait_s)
            staged.append((self._staging_on(buf.device).start(buf, _sizes(k, self.chunk_numel)[0]), buf, k, owner))
        return all([self._verify_one(gen, *item) for item in staged])

    def _verify_one(self, gen: int, staged: Staged, buf: torch.Tensor, k: int, owner: int) -> bool:
        kept = staged.wait()
        if kept is not buf:  # on a GPU: the receive buffer is free for the next snapshot
            self._spare.append(buf)
        hbytes, _ = _sizes(k, self.chunk_numel)
        h = kept[:hbytes].view(torch.int64).tolist()
        payload = kept[hbytes:].view(torch.float32).view(k, 3, self.chunk_numel)
        if h[0] != gen or h[2] != k or h[1] != staged.check.item():
            self._recycle(kept)
            # Not fatal: the owner is alive and holds this state itself. Until a snapshot of it
            # verifies, its chunks are recoverable only from the generation held before.
            older = sorted(g for (o, g) in self.held if o == owner)
            print(f"elaswave: WARNING: rank {self.rank}: the snapshot of rank {owner} for step {gen} failed its "
                  f"checksum (header step {h[0]}, {h[2]} chunks); it is discarded and nobody drops an older "
                  f"generation this step (kept here: {older or 'none'}); the next step's snapshot replaces it",
                  file=sys.stderr, flush=True)
            return False
        keys = tuple((h[3 + 2 * i], h[4 + 2 * i]) for i in range(k))
        self.held[(owner, gen)] = (keys, payload, kept)
        self._drop_before(gen - 1, owner)
        return True

    def commit(self, gen: int) -> None:
        """Every holder verified generation ``gen``: the ones before are no longer needed."""
        self._drop_before(gen)

    def _drop_before(self, gen: int, owner: int | None = None) -> None:
        for old in [k for k in self.held if k[1] < gen and owner in (None, k[0])]:
            self._recycle(self.held.pop(old)[2])

    def _recycle(self, kept: torch.Tensor) -> None:
        if self._staging is None or not self._staging.recycle(kept):
            self._spare.append(kept)

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
        bufs += [item[1] for item in self._incoming]
        return sum(b.numel() for b in bufs)

    def reset(self) -> None:
        """A new epoch re-pairs owners and holders; what is held stays a recovery source until the
        next verified snapshot replaces it."""
        self._incoming = []
        self._sends = []
        self._out = None  # a send of the old epoch may still read the old buffer
