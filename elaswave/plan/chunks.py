"""ZeRO-1 chunk ownership (pure).

A layer's parameters are one flat vector cut into fixed-size chunks, named ``(layer, c)``. At the
start, the chunks of a holder group's layers are numbered in layer order and chunk number ``k``
goes to ``holders[k mod n]`` (holders sorted), so a holder's state is spread over every layer and
the loss of one holder leaves a scattered, evenly sized set of chunks to recover. After a loss,
surviving owners keep every chunk they had; only the lost owner's chunks are dealt out, each to
the holder that owns the fewest so far -- a re-shard moves the lost chunks and nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

ChunkKey = tuple[int, int]
"""(unit, chunk within the unit): a layer's unit, or an expert's (model/units.py)."""

Owners = tuple[tuple[int, ...], ...]
"""owners[layer][c] = the rank that owns chunk c of that layer."""


def num_chunks(numel: int, chunk_numel: int) -> int:
    return -(-numel // chunk_numel)


def chunk_range(numel: int, chunk_numel: int, c: int) -> tuple[int, int]:
    start = c * chunk_numel
    return start, min(numel, start + chunk_numel)


def owner(holders: Sequence[int], group_chunk: int) -> int:
    """The initial owner of chunk number ``group_chunk`` of its holder group."""
    return holders[group_chunk % len(holders)]


Buckets = Sequence[tuple[tuple[int, ...], Sequence[int]]]
"""(holders, layers) pairs: a plan's gradient buckets, where a holder group's layers are cut at
model chunks (plan/buckets.py). Chunks are dealt within each, so that every bucket's slots are even
(a bucket's slot is its most-loaded holder's)."""


def round_robin_owners(buckets: Buckets, layer_numels: Sequence[int], chunk_numel: int) -> Owners:
    out: list[tuple[int, ...]] = [()] * len(layer_numels)
    dealt: dict[tuple[int, ...], int] = {}  # a group's count goes on across its buckets: even over the group too
    for holders, layers in buckets:
        k = dealt.get(holders, 0)
        for layer in layers:
            n = num_chunks(layer_numels[layer], chunk_numel)
            out[layer] = tuple(owner(holders, k + c) for c in range(n))
            k += n
        dealt[holders] = k
    return tuple(out)


def reassign_owners(owners: Owners, buckets: Buckets) -> Owners:
    """Keep every chunk whose owner still holds its layer; deal the others to the least-loaded holder
    of the bucket (ties to the lower rank), in chunk order. A plan made without chunks (layouts
    only, as the simulator's calibration makes them) has none to deal."""
    if not owners:
        return ()
    out = [list(o) for o in owners]
    for holders, layers in buckets:
        load = {h: 0 for h in holders}
        for layer in layers:
            for o in owners[layer]:
                if o in load:
                    load[o] += 1
        for layer in layers:
            for c, o in enumerate(owners[layer]):
                if o not in load:
                    new = min(holders, key=lambda h: (load[h], h))
                    out[layer][c] = new
                    load[new] += 1
    return tuple(tuple(o) for o in out)


def rebalance_owners(owners: Owners, buckets: Buckets, joined: set[int]) -> Owners:
    """Even out ownership in every bucket that a joining rank holds: each holder ends with
    ``total // n`` or one more chunks (the extra ones stay with the most loaded, so as little as
    possible moves), and a chunk moves only from a holder above its share to the one furthest
    below, in chunk order. Other buckets keep their owners."""
    if not owners:
        return ()
    out = [list(o) for o in owners]
    for holders, layers in buckets:
        if not joined & set(holders):
            continue
        keys = [(layer, c) for layer in layers for c in range(len(owners[layer]))]
        load = {h: 0 for h in holders}
        for layer, c in keys:
            load[out[layer][c]] += 1
        base, extra = divmod(len(keys), len(holders))
        by_load = sorted(holders, key=lambda h: (-load[h], h))
        share = {h: base + (1 if i < extra else 0) for i, h in enumerate(by_load)}
        for layer, c in keys:
            o = out[layer][c]
            if load[o] > share[o]:
                new = max(holders, key=lambda h: (share[h] - load[h], -h))
                out[layer][c] = new
                load[o] -= 1
                load[new] += 1
    return tuple(tuple(o) for o in out)


def chunks_of(owners: Owners, rank: int) -> tuple[ChunkKey, ...]:
    return chunks_by_rank(owners).get(rank, ())


def chunks_by_rank(owners: Owners) -> dict[int, tuple[ChunkKey, ...]]:
    """Each owner's chunks, in canonical order (one pass: a plan indexes them once)."""
    out: dict[int, list[ChunkKey]] = {}
    for layer, row in enumerate(owners):
        for c, owner in enumerate(row):
            out.setdefault(owner, []).append((layer, c))
    return {r: tuple(keys) for r, keys in out.items()}


def slot_chunks(owners: Owners, buckets: Buckets) -> dict[int, tuple[int, ...]]:
    """Chunks in each rank's optimizer slot of each gradient bucket it holds (``buckets``' order,
    (holders, layers) each): the bucket's most-loaded holder's chunk count, as every slot of a
    bucket has that size."""
    out: dict[int, list[int]] = {}
    for holders, layers in buckets:
        counts: dict[int, int] = {}
        for layer in layers:
            for owner in owners[layer] if layer < len(owners) else ():
                counts[owner] = counts.get(owner, 0) + 1
        for r in holders:
            out.setdefault(r, []).append(max(counts.values(), default=0))
    return {r: tuple(sizes) for r, sizes in out.items()}


@dataclass(frozen=True)
class ChunkIndex:
    """Global chunk numbering in canonical layer order: what clipping norms are summed over."""

    offsets: tuple[int, ...]  # offsets[l] = global index of layer l's chunk 0
    total: int

    @staticmethod
    def build(layer_numels: Sequence[int], chunk_numel: int) -> "ChunkIndex":
        offsets, total = [], 0
        for numel in layer_numels:
            offsets.append(total)
            total += num_chunks(numel, chunk_numel)
        return ChunkIndex(tuple(offsets), total)
