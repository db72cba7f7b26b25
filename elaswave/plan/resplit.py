"""A pipeline's layers split again: over its survivors, or with ranks that join (pure; for plan.replan)."""
from __future__ import annotations

from typing import Sequence

from elaswave.plan.detours import covers
from elaswave.plan.errors import PlanError
from elaswave.plan.memory import by_cost, stages_memory
from elaswave.plan.partition import PartitionError, partition
from elaswave.plan.rates import layer_costs
from elaswave.plan.recompute import auto_partition


def place_joiners(prev, epoch: int, joined: Sequence[int], pipelines: list, ranges: list, kept: list) -> None:
    """Put ``joined`` into the survivors' layout (in place): see :func:`~elaswave.plan.replan.replan`.
    New pipelines are marked ``None`` in ``kept`` (they had no index in ``prev``)."""
    depth = prev.depth or max(len(p) for p in prev.pipelines)
    waiting = list(joined)

    def resplit(count: int, who) -> tuple[tuple[int, int], ...]:
        try:
            return split(prev, count, len(pipelines) + -(-len(waiting) // depth), prev.num_micro_batches)
        except PartitionError as exc:
            raise PlanError(f"epoch {epoch}: no layout for ranks {list(who)} joining: {exc}") from None

    whole = resplit(depth, joined)
    for i, (pipe, rng) in enumerate(zip(pipelines, ranges)):
        take, waiting = waiting[:max(0, depth - len(pipe))], waiting[max(0, depth - len(pipe)):]
        if not take:
            continue
        if prev.virtual_stages == 1 and not covers(rng, prev.num_layers) and all(r in whole for r in rng):
            # The survivors kept their stages of the whole layout: the joiners take the missing ones.
            missing = [r for r in whole if r not in rng]
            slots = sorted(list(zip(rng, pipe)) + list(zip(missing, take)))
            ranges[i], pipelines[i] = tuple(x for x, _ in slots), tuple(r for _, r in slots)
        else:
            pipelines[i] = tuple(pipe) + tuple(take)
            ranges[i] = resplit(len(pipelines[i]), pipelines[i])
    while waiting:
        take, waiting = tuple(waiting[:depth]), waiting[depth:]
        pipelines.append(take)
        ranges.append(resplit(len(take), take))
        kept.append(None)


def split(prev, count: int, pipelines: int, num_micro_batches: int,
          speeds: Sequence[float] | None = None) -> tuple[tuple[int, int], ...]:
    """A pipeline of ``count`` stages, one of ``pipelines``, re-partitioned within the memory limit;
    ``count x V`` chunks by cost where the memory is checked after (plan.memory.by_cost)."""
    if (v := prev.virtual_stages) == 1 and by_cost(v, prev.memory):  # the plan recomputes to fit
        return tuple(auto_partition(layer_costs(prev), count, prev.memory, prev.stage_memory_limit, pipelines,
                                    num_micro_batches, speeds))
    if by_cost(v, prev.memory):
        return tuple(partition(layer_costs(prev), count * v, speeds=[speeds[k % count] for k in range(count * v)]
                               if speeds is not None else None))
    return tuple(partition(layer_costs(prev), count, prev.layer_memory or None, prev.stage_memory_limit or None, speeds,
                           stages_memory(prev.memory, count, pipelines, num_micro_batches)))
