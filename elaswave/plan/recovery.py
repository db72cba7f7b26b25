"""Where a recovery resumes and which chunk moves from whom to whom (pure).

Generation ``g`` is the state at the start of step ``g``. Every rank keeps two generations of its
own ZeRO chunks and one or two of the snapshot it holds for a peer. After a loss, each survivor
reports which generations of which chunks it has; the job resumes at the newest generation that
every chunk has somewhere, and each chunk's new owner gets it from one source. Two more sources
have every chunk: the newest complete disk checkpoint, which any rank can read, and generation 0
(the keyed initialisation), which any rank can rebuild. Going back to either discards progress,
which the caller reports loudly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from elaswave.plan.chunks import ChunkKey, Owners


@dataclass(frozen=True)
class Holding:
    """What one survivor has: generation -> chunk keys, for its own chunks and the snapshot it holds."""

    rank: int
    own: Mapping[int, Sequence[ChunkKey]]
    held: Mapping[int, Sequence[ChunkKey]]

    def to_doc(self) -> dict:
        return {"own": {str(g): [list(k) for k in ks] for g, ks in self.own.items()},
                "held": {str(g): [list(k) for k in ks] for g, ks in self.held.items()}}

    @staticmethod
    def from_doc(rank: int, doc: dict) -> "Holding":
        def load(part: dict) -> dict[int, tuple[ChunkKey, ...]]:
            return {int(g): tuple((k[0], k[1]) for k in ks) for g, ks in part.items()}
        return Holding(rank, load(doc["own"]), load(doc["held"]))


@dataclass(frozen=True)
class Restore:
    resume_step: int
    sources: dict[ChunkKey, tuple[int | None, str]]
    """chunk -> (rank that sends it, 'own' | 'held'); (None, 'disk') = read from the disk
    checkpoint by its new owner; (None, 'init') = rebuilt from the seed."""
    is_fallback: bool
    """True when the job goes back further than the survivors' own state (progress discarded):
    some ranks died together with the holders of their snapshots."""
    unrecoverable_owners: tuple[int, ...] = ()
    """With a fallback: the ranks whose chunks no survivor had."""

    def transfers(self, new_owners: Owners) -> dict[tuple[int, int], list[ChunkKey]]:
        """(source rank, destination rank) -> chunks in key order; local copies left out."""
        out: dict[tuple[int, int], list[ChunkKey]] = {}
        for key in sorted(self.sources):
            src, _ = self.sources[key]
            dst = new_owners[key[0]][key[1]]
            if src is not None and src != dst:
                out.setdefault((src, dst), []).append(key)
        return out


def _have(holdings: Sequence[Holding]) -> dict[ChunkKey, dict[int, list[tuple[int, str]]]]:
    have: dict[ChunkKey, dict[int, list[tuple[int, str]]]] = {}
    for h in sorted(holdings, key=lambda h: h.rank):
        for kind, part in (("own", h.own), ("held", h.held)):
            for gen, keys in part.items():
                for key in keys:
                    have.setdefault(key, {}).setdefault(gen, []).append((h.rank, kind))
    return have


def restorable(old_owners: Owners, holdings: Sequence[Holding], disk_step: int | None = None) -> set[int]:
    """The generations every chunk can be restored at: from a holder, the disk, or the start."""
    have = _have(holdings)
    everywhere = {0} | ({disk_step} if disk_step is not None else set())
    common: set[int] | None = None
    for layer, row in enumerate(old_owners):
        for c in range(len(row)):
            gens = set(have.get((layer, c), {})) | everywhere
            common = gens if common is None else common & gens
    return common if common is not None else everywhere


def plan_restore(old_owners: Owners, new_owners: Owners, holdings: Sequence[Holding],
                 disk_step: int | None = None, within: set[int] | None = None) -> Restore:
    """``disk_step``: the generation of the newest disk checkpoint every survivor can read, if any;
    ``within``: generations others must be able to resume at too (a tensor-parallel job's slices
    resume at one step): the newest of them that every chunk here can be restored at."""
    have = _have(holdings)
    keys = [(layer, c) for layer, row in enumerate(old_owners) for c in range(len(row))]
    common = restorable(old_owners, holdings, disk_step)
    if within is not None:
        common &= within
    resume = max(common) if common else 0
    newest_own = max((g for h in holdings for g in h.own), default=0)
    sources: dict[ChunkKey, tuple[int | None, str]] = {}
    for key in keys:
        options = have.get(key, {}).get(resume, [])
        if not options:
            sources[key] = (None, "disk" if resume == disk_step else "init")
            continue
        dst = new_owners[key[0]][key[1]]
        local = [o for o in options if o[0] == dst]
        sources[key] = (local or options)[0]
    is_fallback = resume < newest_own - 1
    unrecoverable = sorted({old_owners[k[0]][k[1]] for k in keys
                            if not any(g >= newest_own - 1 for g in have.get(k, {}))}) if is_fallback else []
    return Restore(resume, sources, is_fallback, tuple(unrecoverable))
