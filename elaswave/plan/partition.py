"""Minimax partition of a model's layers onto a pipeline's stages (pure).

Stages hold contiguous layer ranges in order; the partition minimises the largest stage cost, with
an optional per-stage memory limit. Exact dynamic programming over prefix sums: O(L^2 * S), which
for transformer depths (L <= a few hundred) is far below a millisecond per pipeline.
"""
from __future__ import annotations

from typing import Sequence


class PartitionError(ValueError):
    pass


def partition(costs: Sequence[float], num_stages: int,
              memory: Sequence[float] | None = None, memory_limit: float | None = None,
              speeds: Sequence[float] | None = None) -> list[tuple[int, int]]:
    """Layer ranges ``[(start, end), ...]`` (end exclusive), one per stage, minimising max stage cost
    (divided by the stage's speed, when ``speeds`` gives one per stage: a straggler gets less).

    Ties are broken towards earlier stages holding fewer layers, so the answer is unique and every
    rank computes the same one.
    """
    n = len(costs)
    if num_stages < 1 or num_stages > n:
        raise PartitionError(f"cannot split {n} layers into {num_stages} stages: need 1 <= stages <= {n}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    mem_prefix = [0.0]
    for m in memory or [0.0] * n:
        mem_prefix.append(mem_prefix[-1] + float(m))
    inf = float("inf")
    rate = [float(x) for x in speeds] if speeds is not None else [1.0] * num_stages
    if len(rate) != num_stages or any(x <= 0 for x in rate):
        raise PartitionError(f"need one speed > 0 per stage ({num_stages}), got {list(rate)}")

    def fits(i: int, j: int) -> bool:
        return memory_limit is None or mem_prefix[j] - mem_prefix[i] <= memory_limit

    # best[s][j]: minimal max cost of putting layers [0, j) on s stages; cut[s][j]: start of stage s-1.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, n - (num_stages - s) + 1):
            for i in range(s - 1, j):
                if best[s - 1][i] == inf or not fits(i, j):
                    continue
                value = max(best[s - 1][i], (prefix[j] - prefix[i]) / rate[s - 1])
                if value < best[s][j] - 1e-12 * max(1.0, abs(value)):
                    best[s][j], cut[s][j] = value, i
    if best[num_stages][n] == inf:
        raise PartitionError(
            f"no partition of {n} layers into {num_stages} stages fits memory_limit={memory_limit} "
            f"(largest layer needs {max(memory or [0.0])}, total {mem_prefix[-1]})")
    ranges, j = [], n
    for s in range(num_stages, 0, -1):
        i = cut[s][j]
        ranges.append((i, j))
        j = i
    return ranges[::-1]


def max_stage_cost(costs: Sequence[float], ranges: Sequence[tuple[int, int]]) -> float:
    return max(sum(costs[i:j]) for i, j in ranges)
