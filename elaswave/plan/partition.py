"""Minimax partition of a model's layers onto a pipeline's stages (pure).

Stages hold contiguous layer ranges in order; the partition minimises the largest stage cost, with
an optional per-stage memory limit. Exact dynamic programming over prefix sums: O(L^2 * S), which
for transformer depths (L <= a few hundred) is far below a millisecond per pipeline.
"""
from __future__ import annotations

from typing import Callable, Sequence

StageMemory = Callable[[int, int, int], float]
"""``(stage, start, end) -> memory`` of a stage holding layers [start, end)."""


class PartitionError(ValueError):
    pass


def partition(costs: Sequence[float], num_stages: int,
              memory: Sequence[float] | None = None, memory_limit: float | None = None,
              speeds: Sequence[float] | None = None, stage_memory: StageMemory | None = None) -> list[tuple[int, int]]:
    """Layer ranges ``[(start, end), ...]`` (end exclusive), one per stage, minimising max stage cost
    (divided by the stage's speed, when ``speeds`` gives one per stage: a straggler gets less),
    each stage within ``memory_limit``: its ``memory`` summed over its layers, or ``stage_memory``
    (a stage's memory depends on its position too: activations in flight under 1F1B).

    Ties are broken towards earlier stages holding fewer layers, so the answer is unique and every
    rank computes the same one.
    """
    n = len(costs)
    if num_stages < 1 or num_stages > n:
        raise PartitionError(f"cannot split {n} layers into {num_stages} stages: need 1 <= stages <= {n}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    stage_memory = stage_memory or _summed(memory or [0.0] * n)
    inf = float("inf")
    rate = [float(x) for x in speeds] if speeds is not None else [1.0] * num_stages
    if len(rate) != num_stages or any(x <= 0 for x in rate):
        raise PartitionError(f"need one speed > 0 per stage ({num_stages}), got {list(rate)}")

    def fits(s: int, i: int, j: int) -> bool:
        return memory_limit is None or stage_memory(s, i, j) <= memory_limit

    # best[s][j]: minimal max cost of putting layers [0, j) on s stages; cut[s][j]: start of stage s-1.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, n - (num_stages - s) + 1):
            for i in range(s - 1, j):
                if best[s - 1][i] == inf:
                    continue
                value = max(best[s - 1][i], (prefix[j] - prefix[i]) / rate[s - 1])
                # The memory model last: it costs far more than the comparison, which rules out most cuts.
                if value < best[s][j] - 1e-12 * max(1.0, abs(value)) and fits(s - 1, i, j):
                    best[s][j], cut[s][j] = value, i
    if best[num_stages][n] == inf:
        raise PartitionError(
            f"no partition of {n} layers into {num_stages} stages fits memory_limit={memory_limit}: the least "
            f"any needs is {least_memory(n, num_stages, stage_memory):.4g}")
    ranges, j = [], n
    for s in range(num_stages, 0, -1):
        i = cut[s][j]
        ranges.append((i, j))
        j = i
    return ranges[::-1]


def _summed(memory: Sequence[float]) -> StageMemory:
    prefix = [0.0]
    for m in memory:
        prefix.append(prefix[-1] + float(m))
    return lambda s, i, j: prefix[j] - prefix[i]


def least_memory(num_layers: int, num_stages: int, stage_memory: StageMemory) -> float:
    """The smallest memory limit any partition meets: the minimax of stage memory (what to ask
    for when none fits)."""
    inf = float("inf")
    best = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, num_layers - (num_stages - s) + 1):
            best[s][j] = min((max(best[s - 1][i], stage_memory(s - 1, i, j)) for i in range(s - 1, j)
                              if best[s - 1][i] < inf), default=inf)
    return best[num_stages][num_layers]


def max_stage_cost(costs: Sequence[float], ranges: Sequence[tuple[int, int]]) -> float:
    return max(sum(costs[i:j]) for i, j in ranges)
