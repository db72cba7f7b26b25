"""Where a rank of a dp x pp x tp job sits: its slice and its tensor-parallel group.

Ranks are laid out tp innermost, as Megatron and torchtitan lay them out (one node's devices cut
the same layers): ranks ``k * tp .. k * tp + tp - 1`` are device ``k`` of the dp x pp plan, and
rank ``k * tp + t`` holds shard ``t`` of that device's layers. The planner plans devices; each
rank runs the plan mapped onto its *slice* -- the ranks with its own ``t`` -- so a slice is a
dp x pp job of shards: its pipelines, holder groups, ZeRO chunks and step exchange are among
ranks of one shard index, and the slices meet only in the tensor-parallel group of each device
(the cut products' collectives, the norm, the end-of-run digests).
"""
from __future__ import annotations

from dataclasses import replace

from elaswave.plan.plan import Plan


def shard_of(rank: int, tp: int) -> int:
    """Which shard of its device's layers ``rank`` holds (its place in its tensor-parallel group)."""
    return rank % tp


def device_of(rank: int, tp: int) -> int:
    """The device of the plan that ``rank`` is a shard of."""
    return rank // tp


def on_shard_of(rank: int, shard: int, tp: int) -> int:
    """The rank of ``rank``'s device that holds shard ``shard``."""
    return rank - rank % tp + shard


def tensor_group(rank: int, tp: int) -> tuple[int, ...]:
    """The ranks that cut the same layers as ``rank``: its device's."""
    first = rank - rank % tp
    return tuple(range(first, first + tp))


def on_slice(plan: Plan, shard: int, tp: int) -> Plan:
    """The plan of devices, as slice ``shard`` runs it: every device ``k`` replaced by rank
    ``k * tp + shard`` (tp 1: the plan itself)."""
    if tp == 1:
        return plan
    rank = lambda k: k * tp + shard  # noqa: E731
    return replace(plan,
                   pipelines=tuple(tuple(rank(k) for k in pipe) for pipe in plan.pipelines),
                   chunk_owners=tuple(tuple(rank(k) for k in row) for row in plan.chunk_owners),
                   routes=tuple((mb, tuple(rank(k) for k in ranks)) for mb, ranks in plan.routes))


def every_rank(plan: Plan, tp: int) -> tuple[int, ...]:
    """Every rank of the job whose slice runs ``plan`` (the plan's ranks with every shard index)."""
    return tuple(sorted(on_shard_of(r, t, tp) for r in plan.ranks for t in range(tp)))


def whole_devices(ranks, tp: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the ranks of devices every one of whose ``tp`` ranks is in ``ranks``, the rest): a device
    that lost a rank has lost its layers' shard, and its survivors leave with it."""
    ranks = set(ranks)
    whole = {r for r in ranks if all(m in ranks for m in tensor_group(r, tp))}
    return tuple(sorted(whole)), tuple(sorted(ranks - whole))


def on_shard(ranks, shard: int, tp: int) -> tuple[int, ...]:
    """The ranks of slice ``shard`` among ``ranks``."""
    return tuple(sorted(r for r in ranks if r % tp == shard))


def device_speeds(speeds: dict[int, float], shard: int, tp: int) -> dict[int, float]:
    """Each device's speed (its slowest shard's: the group waits for it) under its rank of slice
    ``shard``: every slice re-plans from the same figures, so all make the same plan."""
    out: dict[int, float] = {}
    for r, v in speeds.items():
        mine = on_shard_of(r, shard, tp)
        out[mine] = min(v, out.get(mine, v))
    return out
