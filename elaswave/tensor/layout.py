"""Where a rank of a dp x pp x tp job sits: its device, its shard, its slice and its
tensor-parallel group.

A job's ranks start laid out tp innermost, as Megatron and torchtitan lay them out (one node's
devices cut the same layers): ranks ``k * tp .. k * tp + tp - 1`` are device ``k`` of the dp x pp
plan, rank ``k * tp + t`` holding shard ``t`` of its layers. Ranks that join later (warm spares,
replacements) come in whole devices under numbers of their own, so where a rank sits is a table
(:class:`Devices`), not arithmetic. A device is named in the plan by its *head*, its shard 0's
rank: the plan as slice 0 runs it is the plan of devices, which every slice re-plans alike.

The planner plans devices; each rank runs the plan mapped onto its *slice* -- the ranks with its
own shard index -- so a slice is a dp x pp job of shards: its pipelines, holder groups, ZeRO chunks
and step exchange are among ranks of one shard index, and the slices meet only in the
tensor-parallel group of each device (the cut products' collectives, the norm, the step's votes,
the end-of-run digests).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from elaswave.plan.plan import Plan


def founding_slice(plan: Plan, shard: int, tp: int) -> Plan:
    """The founding plan of devices ``0 .. D-1`` as slice ``shard`` runs it: device ``k`` is rank
    ``k * tp + shard`` (tp 1: the plan itself)."""
    return _mapped(plan, lambda k: k * tp + shard) if tp > 1 else plan


def _mapped(plan: Plan, rank) -> Plan:
    return replace(plan,
                   pipelines=tuple(tuple(rank(k) for k in pipe) for pipe in plan.pipelines),
                   chunk_owners=tuple(tuple(rank(k) for k in row) for row in plan.chunk_owners),
                   expert_holders=tuple(tuple(rank(k) for k in row) for row in plan.expert_holders),
                   routes=tuple((mb, tuple(rank(k) for k in ranks)) for mb, ranks in plan.routes))


@dataclass(frozen=True)
class Devices:
    """The job's devices: each one's ranks, by shard (with tp 1 every rank is a device of its own,
    and nothing is kept)."""

    tp: int
    groups: tuple[tuple[int, ...], ...] = ()
    _where: dict = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_where", {r: (g, t) for g in self.groups for t, r in enumerate(g)})

    @classmethod
    def founding(cls, world_size: int, tp: int) -> "Devices":
        return cls(tp, tuple(tuple(range(k * tp, k * tp + tp)) for k in range(world_size // tp)) if tp > 1 else ())

    def to_doc(self) -> list:
        return [list(g) for g in self.groups]

    @classmethod
    def from_doc(cls, tp: int, doc) -> "Devices":
        return cls(tp, tuple(tuple(g) for g in doc or ()))

    def _at(self, rank: int) -> tuple[tuple[int, ...], int]:
        """(``rank``'s device, by shard; its shard)."""
        try:
            return self._where[rank]
        except KeyError:
            raise KeyError(f"rank {rank} is on no device of {self.to_doc()}") from None

    def shard_of(self, rank: int) -> int:
        """Which shard of its device's layers ``rank`` holds (its place in its tensor-parallel group)."""
        return self._at(rank)[1] if self.tp > 1 else 0

    def head_of(self, rank: int) -> int:
        """The device's name in the plan of devices: its shard 0's rank."""
        return self._at(rank)[0][0] if self.tp > 1 else rank

    def on_shard_of(self, rank: int, shard: int) -> int:
        """The rank of ``rank``'s device that holds shard ``shard``."""
        if self.tp == 1:
            return rank
        return self.tensor_group(rank)[shard]

    def tensor_group(self, rank: int) -> tuple[int, ...]:
        """The ranks that cut the same layers as ``rank``: its device's, by shard."""
        return self._at(rank)[0] if self.tp > 1 else (rank,)

    def on_slice(self, plan: Plan, shard: int) -> Plan:
        """``plan`` (as any slice runs it) as slice ``shard`` runs it; shard 0: the plan of devices."""
        return _mapped(plan, lambda r: self.on_shard_of(r, shard)) if self.tp > 1 else plan

    def every_rank(self, plan: Plan) -> tuple[int, ...]:
        """Every rank of the job whose slices run ``plan`` (its ranks with every shard index)."""
        if self.tp == 1:
            return tuple(sorted(plan.ranks))
        return tuple(sorted(m for r in plan.ranks for m in self.tensor_group(r)))

    def whole(self, ranks) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(the ranks of devices every one of whose ranks is in ``ranks``, the rest): a device that
        lost a rank has lost its layers' shard, and its survivors leave with it."""
        ranks = set(ranks)
        if self.tp == 1:
            return tuple(sorted(ranks)), ()
        whole = {r for r in ranks if r in self._where and all(m in ranks for m in self.tensor_group(r))}
        return tuple(sorted(whole)), tuple(sorted(ranks - whole))

    def keeping(self, ranks) -> "Devices":
        """The devices all of whose ranks are in ``ranks``."""
        ranks = set(ranks)
        return replace(self, groups=tuple(g for g in self.groups if set(g) <= ranks))

    def joined(self, ranks) -> "Devices":
        """These devices and the ones ``ranks`` make, ``tp`` at a time in their order, shard by
        position (the leader admits joiners in whole devices: :func:`elaswave.runtime.join.admit`)."""
        ranks = [r for r in ranks if r not in self._where]
        if self.tp == 1 or not ranks:
            return self
        if len(ranks) % self.tp:
            raise ValueError(f"ranks {ranks} do not make whole devices of {self.tp}")
        new = tuple(tuple(ranks[i:i + self.tp]) for i in range(0, len(ranks), self.tp))
        return replace(self, groups=tuple(sorted(self.groups + new)))

    def on_shard(self, ranks, shard: int) -> tuple[int, ...]:
        """The ranks of slice ``shard`` among ``ranks``."""
        return tuple(sorted(r for r in ranks if self.shard_of(r) == shard))

    def device_speeds(self, speeds: dict[int, float]) -> dict[int, float]:
        """Each device's speed (its slowest shard's: the group waits for it), by its head: every
        slice re-plans the plan of devices from the same figures."""
        out: dict[int, float] = {}
        for r, v in speeds.items():
            head = self.head_of(r)
            out[head] = min(v, out.get(head, v))
        return out
