"""The snapshot pool: after every step each rank copies its ZeRO chunks into a peer's memory.

Placement is a ring over the epoch's ranks (:meth:`Plan.snapshot_holders`): rank ``r`` sends to the
next ``K`` ranks (``elastic.snapshot_copies``) and keeps the previous ``K`` ones', so a rank dying
together with up to ``K - 1`` of its holders still leaves a copy. A snapshot travels as a small
header (generation, checksum, slot sizes, chunk keys) and the owner's optimizer slots themselves,
one asynchronous message each, sent straight from the optimizer's state: the state does not change
until the next step's update, which waits for the sends, so the owner keeps no copy of it. The
copies overlap the next step's compute. The holder verifies it before the next step's update may start (the step's loss exchange
carries a "verified" flag from every holder), which is what lets every rank drop the generation
before: a recovery then always finds one generation that every chunk has somewhere.

A holder keeps one verified generation at rest. From its verification until the step's exchange
proves *every* holder verified the same generation (:meth:`commit`), it keeps the one before too:
otherwise two owners dying in that window, one of whose holders had verified and one not, would
leave no generation common to all chunks.
"""
from __future__ import annotations

import sys
from typing import Sequence

import torch

from elaswave.comm.groups import Group
from elaswave.plan.chunks import ChunkKey
from elaswave.plan.plan import Plan
from elaswave.snapshot.staging import HostStaging, Staged, checksum_of

TAG_SNAPSHOT = 1_000_001


class SnapshotChanged(RuntimeError):
    """A held snapshot no longer matches the checksum it was verified with."""


def _sizes(k: int, slots: Sequence[int], chunk_numel: int) -> tuple[int, int]:
    """Bytes of a snapshot's header (int64: generation, checksum, k, the number of slots, each slot's
    chunks and chunks owned, then k keys) and of its slots (float32 ``[3, chunks x chunk_numel]`` each)."""
    return 8 * (4 + 2 * len(slots) + 2 * k), 4 * 3 * sum(slots) * chunk_numel


class SnapshotPool:
    """Per holder, a header and one message per optimizer slot, received into one byte buffer per
    owner (reused from step to step), so a step costs a wait per message and no copy on the owner."""

    def __init__(self, rank: int, chunk_numel: int, verify_wait_s: float = 2.0):
        """``verify_wait_s``: how long :meth:`verify` may block on an owner that sent nothing (a hung
        one); the heartbeat timeout, within which a hung rank is declared gone anyway."""
        self.rank, self.chunk_numel, self.verify_wait_s = rank, chunk_numel, verify_wait_s
        self.held: dict[tuple[int, int], tuple[dict[ChunkKey, torch.Tensor], torch.Tensor, int]] = {}
        """(owner, generation) -> (each chunk's ``[3, chunk_numel]`` state, in the kept buffer; the
        buffer; its payload bytes)."""
        self._sums: dict[tuple[int, int], tuple[int, int]] = {}
        """(owner, generation) -> (header bytes, payload checksum) of each held snapshot not yet
        checked again since it was verified (see :meth:`chunk`)."""
        self._sends: list[tuple[list, int]] = []
        self._out: list[torch.Tensor] = []
        """What the sends in flight read (the header, a damaged copy): alive until they are done."""
        self._incoming: list[tuple[list, torch.Tensor, tuple[ChunkKey, ...], tuple[int, ...], int]] = []
        """(receives, buffer, the chunks the plan says the owner owns, its slot sizes, owner) per owner
        whose next snapshot is expected."""
        self._spare: list[torch.Tensor] = []
        self._staging: HostStaging | None = None

    def _staging_on(self, device: torch.device) -> HostStaging:
        if self._staging is None or self._staging.device != device:
            self._staging = HostStaging(device)
        return self._staging

    # -- the owner's side ---------------------------------------------------------------------
    def send(self, group: Group, plan: Plan, gen: int, slots: Sequence[tuple[Sequence[ChunkKey], torch.Tensor]],
             device: torch.device, corrupt: bool = False) -> None:
        """Post this rank's snapshot of generation ``gen`` to each of its holders. ``slots``: per
        holder group (the plan's order), the chunks owned in slot order and the ``[3, slot_numel]``
        state, which must not change until :meth:`wait_sends`. ``corrupt``: damage the first slot
        sent after the checksum, in a copy (fault injection)."""
        holders = plan.snapshot_holders(self.rank)
        if not holders:
            return
        keys = [k for owned, _ in slots for k in owned]
        sizes = [state.shape[1] // self.chunk_numel for _, state in slots]
        staging = self._staging_on(device)
        header = torch.empty(_sizes(len(keys), sizes, self.chunk_numel)[0] // 8, dtype=torch.int64, device=device)
        ints = [gen, 0, len(keys), len(slots), *sizes, *(len(owned) for owned, _ in slots), *(x for k in keys for x in k)]
        # No read-back on a GPU: the integers come from pinned memory and the checksum is written
        # on the device, after the state it sums.
        header.copy_(staging.header(ints), non_blocking=True)
        parts = [state for _, state in slots if state.numel()]
        header[1:2].copy_(checksum_of([p.view(torch.uint8) for p in parts], device))
        if corrupt and parts:
            parts[0] = parts[0].clone()
            parts[0].view(torch.uint8).view(-1)[0] ^= 0x01
        self._out = [header, *parts]
        self._sends = [([group.isend(t, holder, TAG_SNAPSHOT + i) for i, t in enumerate(self._out)], holder)
                       for holder in holders]

    def wait_sends(self, group: Group) -> None:
        """Called once the step's exchange proved the holders verified the snapshot: the sends are
        done, so they are waited on directly."""
        sends, self._sends = self._sends, []
        for works, holder in sends:
            for work in works:
                group.wait_direct(work, f"snapshot to rank {holder}")
        self._out = []

    # -- the holder's side --------------------------------------------------------------------
    def expect(self, group: Group, plan: Plan, device: torch.device) -> None:
        """Post the receives of the owners' next snapshots, laid out as the plan says their slots are."""
        owners = plan.snapshot_owners(self.rank)
        shapes = [(plan.chunks_of(o), plan.slot_chunks(o)) for o in owners]
        sizes = [sum(_sizes(len(keys), slots, self.chunk_numel)) for keys, slots in shapes]
        # Buffers of another size (owners of another epoch) are not kept for later.
        spare = [b for b in self._spare if b.device == device and b.numel() in sizes]
        self._incoming = []
        for owner, size, (keys, slots) in zip(owners, sizes, shapes):
            fits = [b for b in spare if b.numel() == size]
            buf = fits[0] if fits else torch.empty(size, dtype=torch.uint8, device=device)
            spare = [b for b in spare if b is not buf]
            at = _sizes(len(keys), slots, self.chunk_numel)[0]
            parts = [buf[:at].view(torch.int64)]
            for n in slots:
                if n:
                    parts.append(buf[at:at + 12 * n * self.chunk_numel].view(torch.float32).view(3, -1))
                    at += 12 * n * self.chunk_numel
            works = [group.irecv(t, owner, TAG_SNAPSHOT + i) for i, t in enumerate(parts)]
            self._incoming.append((works, buf, keys, slots, owner))
        self._spare = spare

    def verify(self, group: Group, gen: int) -> bool:
        """Wait for the expected snapshots of generation ``gen``; keep each whose checksum is right.
        True when every one was."""
        incoming, self._incoming = self._incoming, []
        staged = []
        for works, buf, keys, slots, owner in incoming:
            # Waited for here, on this thread: it was sent a whole step ago and is almost always
            # in, and no helper thread waking mid-step competes with the compute for the GIL. A
            # dead owner fails the wait at once; a hung one within verify_wait_s.
            for work in works:
                group.wait_direct(work, f"snapshot from rank {owner}", self.verify_wait_s)
            hbytes = _sizes(len(keys), slots, self.chunk_numel)[0]
            staged.append((self._staging_on(buf.device).start(buf, hbytes), buf, keys, slots, owner))
        return all([self._verify_one(gen, *item) for item in staged])

    def _verify_one(self, gen: int, staged: Staged, buf: torch.Tensor, expected: tuple[ChunkKey, ...],
                    slots: tuple[int, ...], owner: int) -> bool:
        kept = staged.wait()
        if kept is not buf:  # on a GPU: the receive buffer is free for the next snapshot
            self._spare.append(buf)
        k, nb = len(expected), len(slots)
        hbytes, pbytes = _sizes(k, slots, self.chunk_numel)
        h = kept[:hbytes].view(torch.int64).tolist()
        owned = h[4 + nb:4 + 2 * nb]
        # The checksum covers the payload; the header's layout must be the one the plan says.
        keys = list(zip(h[4 + 2 * nb::2], h[5 + 2 * nb::2]))
        if (h[0] != gen or h[2] != k or h[3] != nb or tuple(h[4:4 + nb]) != slots or h[1] != staged.check.item()
                or any(not 0 <= o <= n for o, n in zip(owned, slots)) or sum(owned) != k
                or set(keys) != set(expected)):
            self._recycle(kept)
            # Not fatal: the owner is alive and holds this state itself. Until a snapshot of it
            # verifies, its chunks are recoverable only from the generation held before.
            older = sorted(g for (o, g) in self.held if o == owner)
            print(f"elaswave: WARNING: rank {self.rank}: the snapshot of rank {owner} for step {gen} failed its "
                  f"checksum (header step {h[0]}, {h[2]} chunks); it is discarded and nobody drops an older "
                  f"generation this step (kept here: {older or 'none'}); the next step's snapshot replaces it",
                  file=sys.stderr, flush=True)
            return False
        chunks, at, cn, each = {}, hbytes, self.chunk_numel, iter(keys)
        for n, count in zip(slots, owned):
            state = kept[at:at + 12 * n * cn].view(torch.float32).view(3, n * cn)
            for i in range(count):
                chunks[next(each)] = state[:, i * cn:(i + 1) * cn]
            at += 12 * n * cn
        self.held[(owner, gen)] = (chunks, kept, pbytes)
        self._sums[(owner, gen)] = (hbytes, h[1])
        self._drop_before(gen - 1, owner)
        return True

    def commit(self, gen: int) -> None:
        """Every holder verified generation ``gen``: the ones before are no longer needed."""
        self._drop_before(gen)

    def _drop_before(self, gen: int, owner: int | None = None) -> None:
        for old in [k for k in self.held if k[1] < gen and owner in (None, k[0])]:
            self._sums.pop(old, None)
            self._recycle(self.held.pop(old)[1])

    def _recycle(self, kept: torch.Tensor) -> None:
        if self._staging is None or not self._staging.recycle(kept):
            self._spare.append(kept)

    def holding(self) -> dict[int, list[ChunkKey]]:
        out: dict[int, list[ChunkKey]] = {}
        for (_, g), (chunks, _, _) in self.held.items():
            out.setdefault(g, []).extend(chunks)
        return out

    def chunk(self, key: ChunkKey, gen: int) -> torch.Tensor:
        """A copy of a held chunk's state. The first time a snapshot is read (a recovery), its
        payload is checked again: a buffer reused or written while held would otherwise send
        state that verified once and is no longer what its owner sent."""
        for (owner, g), (chunks, kept, _) in self.held.items():
            if g == gen and key in chunks:
                if (owner, g) in self._sums:
                    hbytes, want = self._sums.pop((owner, g))
                    have = self._staging.recheck(kept, hbytes) if self._staging is not None else want
                    if have != want:
                        raise SnapshotChanged(f"rank {self.rank}: the snapshot of rank {owner} for step {g} changed "
                                              f"after it was verified (checksum {have:#x}, verified {want:#x})")
                return chunks[key].clone()
        raise KeyError(f"no snapshot of chunk {key} at step {gen} here")

    def bytes_held(self) -> int:
        """Verified snapshots kept for peers (their slots' bytes)."""
        return sum(pbytes for _, _, pbytes in self.held.values())

    def bytes_buffered(self) -> int:
        """Transfer buffers: what this rank's sends in flight read besides its state (the header), and
        the receive buffers (in flight or spare)."""
        bufs = [b for b in self._out[:1]] + self._spare + [item[1] for item in self._incoming]
        return sum(b.numel() * b.element_size() for b in bufs)

    def reset(self) -> None:
        """A new epoch re-pairs owners and holders; what is held stays a recovery source until the
        next verified snapshot replaces it."""
        self._incoming = []
        self._sends = []
        self._out = []  # a send of the old epoch may still read them; its work holds them
