"""Which blocks each rank recomputes so that the plan fits the memory limit
(``train.activation_checkpointing=auto``; pure).

Megatron recomputes the same blocks on every stage (``--recompute-num-layers``), so every stage
pays for the one that keeps most activations: 1F1B's first stage keeps ``p`` micro-batches', its
last one; interleaved 1F1B's early ranks keep more micro-batch-chunks than its late ones. Here each
rank recomputes its own blocks, one at a time, until its modelled peak
(:func:`~elaswave.plan.memory.rank_bytes`) is within the plan's limit, spread over its model
chunks, and keeps none it could give back. Every re-plan chooses again: after a loss a re-split
pipeline's ranks hold more layers and recompute more instead of standing by, and a join lets
them recompute less. Recomputation does not change a bit of the result (the same forward kernels
run again), so the choice is free to differ from plan to plan.
"""
from __future__ import annotations

from dataclasses import replace

from elaswave.plan.errors import PlanError
from elaswave.plan.experts import unite_recomputation
from elaswave.plan.limit import limit_refusal
from elaswave.plan.memory import MIB, rank_bytes, stages_memory
from elaswave.plan.partition import PartitionError, partition


def auto_partition(costs, count: int, memory, limit_mib: float, pipelines: int, num_micro_batches: int,
                   speeds=None) -> list[tuple[int, int]]:
    """A pipeline's ``count`` stages where the plan chooses what to recompute (one chunk a rank),
    for a re-split: by cost alone, unless a stage of that partition would pass ``limit_mib`` even
    with every block recomputed by the partition's own memory terms; then :func:`by_memory`'s,
    where there is one. (The initial plan decides by the plan's own check: plan.initial_plan.)"""
    ranges = partition(costs, count, speeds=speeds)
    if memory is None or not limit_mib:
        return ranges
    least = stages_memory(every_block_memory(memory, len(costs)), count, pipelines, num_micro_batches)
    if all(least(s, start, end) <= limit_mib for s, (start, end) in enumerate(ranges)):
        return ranges
    return by_memory(costs, count, memory, limit_mib, pipelines, num_micro_batches, speeds) or ranges


def by_memory(costs, count: int, memory, limit_mib: float, pipelines: int, num_micro_batches: int,
              speeds=None) -> list[tuple[int, int]] | None:
    """``count`` stages by cost within ``limit_mib`` at every block recomputed, as ``full``
    partitions (None: no partition fits so), so that auto fits wherever full does
    (:func:`fit_recomputation` then gives back what each rank does not need). Under ZB-H1 every
    stage keeps p micro-batches until their W, and Llama 3 405B's partition by cost needed 85 GiB
    with every block recomputed where full's fit 76."""
    try:
        return partition(costs, count, None, limit_mib, speeds,
                         stages_memory(every_block_memory(memory, len(costs)), count, pipelines, num_micro_batches))
    except PartitionError:
        return None


def every_block_memory(memory, num_layers: int):
    """``memory`` with every block of a model of ``num_layers`` recomputed (not the embedding or
    the head), as ``full`` has it: the least a partition of it can need (see :func:`every_block`)."""
    return replace(memory, recomputed=memory.recomputed | frozenset(range(1, num_layers - 1)), plan_recomputation=False)


def fit_recomputation(plan):
    """``plan`` with ``recomputed``: for each rank over the limit, its own blocks to recompute
    (:func:`_needed`), or all of them where even that does not fit (the caller's memory check then
    names the rank); by position, ``recomputed[d][s]``, so a rank recomputes only what it chose.
    Unchanged without a memory model that plans recomputation, or without a limit."""
    memory, limit = plan.memory, plan.stage_memory_limit * MIB
    if memory is None or not memory.plan_recomputation or not limit:
        return plan
    plain = replace(plan, recomputed=()) if plan.recomputed else plan
    last = plan.num_layers - 1
    decided: dict[tuple, tuple[int, ...]] = {}  # the failure-free plan's pipelines are alike: decide once

    def blocks(rank: int) -> tuple[int, ...]:
        d, s = plan.position(rank)
        chunks = plan.chunk_ranges(rank)
        parts = rank_bytes(memory, plain, rank)
        fixed = parts["total"] - max(parts[k] for k in ("activations", "update", "overlap", "gather"))
        key = (chunks, s, len(plan.pipelines[d]), len(plan.micro_batches[d]), round(fixed))
        if key not in decided:
            over = parts["total"] > limit
            decided[key] = tuple(sorted(_needed(memory, plain, rank, chunks, limit, last))) if over else ()
        return decided[key]
    chosen = tuple(tuple(blocks(r) for r in pipe) for pipe in plan.pipelines)
    return unite_recomputation(replace(plan, recomputed=chosen if any(b for pipe in chosen for b in pipe) else ()))


def refitted(plan):
    """``plan`` with its recomputation chosen again and its memory checked again, after a change
    the planner did not see (the snapshot copies a rank keeps, the hosts' rank numbering)."""
    plan = fit_recomputation(plan)
    if why := limit_refusal(plan):
        raise PlanError(f"the initial layout does not fit: {why}")
    return plan


def every_block(plan):
    """``plan`` with every block of every rank recomputed: the least its ranks can keep."""
    last = plan.num_layers - 1
    return replace(plan, recomputed=tuple(
        tuple(tuple(i for start, end in plan.chunk_ranges(r) for i in range(start, end) if 0 < i < last) for r in pipe)
        for pipe in plan.pipelines))


def _needed(memory, plan, rank: int, chunks, limit: float, last: int) -> tuple[int, ...]:
    """Blocks added one at a time until the rank fits, then any that the later ones made needless
    given back, so that every block left is needed. Which blocks lower an interleaved rank's peak
    depends on which chunks are alive at that instant: of the blocks that lower it by at least half
    as much as the best one, the next is in the chunk with fewest recomputed (so no chunk's time
    grows far beyond the others'), then the one that lowers it most, then the lowest index."""
    def peak(blocks) -> float:
        return rank_bytes(replace(memory, recomputed=memory.recomputed | frozenset(blocks)), plan, rank)["total"]

    chunk_of = {i: c for c, (start, end) in enumerate(chunks) for i in range(start, end) if 0 < i < last}
    mine: list[int] = []
    now = peak(mine)
    while now > limit and chunk_of.keys() - set(mine):
        per_chunk = [sum(chunk_of[i] == c for i in mine) for c in range(len(chunks))]
        after = {i: peak([*mine, i]) for i in chunk_of.keys() - set(mine)}
        best = now - min(after.values())
        useful = [i for i, p in after.items() if now - p >= best / 2]
        pick = min(useful, key=lambda i: (per_chunk[chunk_of[i]], after[i], i))
        mine.append(pick)
        now = after[pick]
    for i in reversed(mine[:-1]):
        if peak([j for j in mine if j != i]) <= limit:
            mine.remove(i)
    return tuple(mine)
