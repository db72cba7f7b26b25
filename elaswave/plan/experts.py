"""Where each expert of a mixture-of-experts block computes: its expert-parallel group and owner
(pure functions, no process groups).

A stage's pipelines are cut into expert-parallel groups of ``ep`` consecutive pipelines (the last
may be smaller after a loss); within a group every expert of a block has one owner, which runs it
on the tokens every member routes to it (all-to-all). Placement is the minimax of the planner's
layers applied to experts: each expert, heaviest first, goes to the member with the least load so
far (longest processing time first), by the router's measured counts; without counts (the first
epoch), experts are dealt in contiguous blocks, Megatron's and DeepSpeed's layout. The placement
changes which rank computes an expert, never what it computes: the bits do not depend on it.
"""
from __future__ import annotations

from typing import Sequence


def groups_of(pipelines: Sequence[int], ep: int) -> list[tuple[int, ...]]:
    """The expert-parallel groups of a stage: its pipelines in order, ``ep`` at a time."""
    if ep < 1:
        raise ValueError(f"parallel.ep={ep} must be >= 1")
    ordered = sorted(pipelines)
    return [tuple(ordered[i:i + ep]) for i in range(0, len(ordered), ep)]


def contiguous(num_experts: int, members: int) -> tuple[int, ...]:
    """Expert e -> the index of its owner among ``members``: blocks of consecutive experts, the
    first ``num_experts % members`` blocks one longer."""
    base, extra = divmod(num_experts, members)
    owners: list[int] = []
    for m in range(members):
        owners += [m] * (base + (m < extra))
    return tuple(owners)


def by_load(loads: Sequence[float], members: int) -> tuple[int, ...]:
    """Expert e -> the index of its owner among ``members``, minimising the busiest member's load:
    heaviest expert first, each to the member with the least load so far (ties: fewer experts,
    then the lower index), so every rank computes the same placement from the same counts."""
    owners = [0] * len(loads)
    total = [0.0] * members
    count = [0] * members
    for e in sorted(range(len(loads)), key=lambda e: (-loads[e], e)):
        m = min(range(members), key=lambda m: (total[m], count[m], m))
        owners[e] = m
        total[m] += loads[e]
        count[m] += 1
    return tuple(owners)


def place(num_experts: int, members: int, loads: Sequence[float] | None = None) -> tuple[int, ...]:
    """Expert -> owner index among ``members``: by the measured ``loads`` where some expert has
    one, else contiguous blocks."""
    if loads is not None and len(loads) != num_experts:
        raise ValueError(f"{len(loads)} expert loads for {num_experts} experts")
    if members == 1:
        return (0,) * num_experts
    if loads is None or not any(loads):
        return contiguous(num_experts, members)
    return by_load(loads, members)


def busiest_share(owners: Sequence[int], loads: Sequence[float], members: int) -> float:
    """The busiest member's share of the load over an even share (1.0: perfectly balanced)."""
    total = sum(loads)
    if not total:
        return 1.0
    per = [0.0] * members
    for e, m in enumerate(owners):
        per[m] += loads[e]
    return max(per) * members / total
