"""Which pipeline runs which micro-batches, and how large they are (pure).

The global batch is ``M`` micro-batches of ``k`` units each (a unit: the samples that are never
split, one sample in the simulator). Whole micro-batches are dealt by :func:`balance`; with
``k > 1``, :func:`reshape` deals units, so a pipeline may run micro-batches of different sizes
and the pipelines finish a step together to within a unit's time, not a micro-batch's. The
global batch -- its units, so its samples and its gradient scale -- is the same either way. Each
pipeline gets a contiguous id range so the assignment is easy to read in logs.
"""
from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np


def assign(num_micro_batches: int, speeds: Sequence[float]) -> list[tuple[int, ...]]:
    if not speeds:
        raise ValueError("assign needs at least one pipeline")
    if any(s <= 0 for s in speeds):
        raise ValueError(f"pipeline speeds must be > 0, got {list(speeds)}")
    if num_micro_batches < len(speeds):
        raise ValueError(
            f"{num_micro_batches} micro-batches cannot give each of {len(speeds)} pipelines at least one")
    total = float(sum(speeds))
    # Every pipeline gets one, the rest goes by speed; largest remainder, ties to the lower index.
    spare = num_micro_batches - len(speeds)
    shares = [spare * s / total for s in speeds]
    counts = [1 + int(x) for x in shares]
    order = sorted(range(len(speeds)), key=lambda d: (-(shares[d] - int(shares[d])), d))
    for d in order[: num_micro_batches - sum(counts)]:
        counts[d] += 1
    out, start = [], 0
    for c in counts:
        out.append(tuple(range(start, start + c)))
        start += c
    return out


def balance(num_micro_batches: int, bottleneck_s: Sequence[float], num_stages: Sequence[int],
            fill_s: Sequence[float] | None = None) -> list[tuple[int, ...]]:
    """Counts that make the pipelines finish a step together: pipeline ``d`` with ``m`` micro-batches
    takes ``fill_s[d] + m * bottleneck_s[d]`` under 1F1B -- the slowest stage sets the pace, and
    fill and drain add the other stages' times once (default ``(num_stages[d] - 1) * bottleneck_s[d]``,
    as if every stage were as slow as the slowest).

    Minimax by greedy filling -- each next micro-batch goes to the pipeline that would finish it
    soonest (ties to the lower index) -- which is optimal because each pipeline's time only grows
    with its count. Ids stay contiguous per pipeline, in pipeline order."""
    fill_s = _checked_fill("balance", num_micro_batches, bottleneck_s, num_stages, fill_s)
    counts = _fill(num_micro_batches, 1, bottleneck_s, fill_s)
    out, start = [], 0
    for c in counts:
        out.append(tuple(range(start, start + c)))
        start += c
    return out


def reshape(num_micro_batches: int, units_per_micro_batch: int, bottleneck_s: Sequence[float],
            num_stages: Sequence[int], fill_s: Sequence[float] | None = None,
            ) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """The global batch's ``num_micro_batches * units_per_micro_batch`` units dealt so the
    pipelines finish together (``balance``'s minimax greedy, a unit at a time: pipeline ``d``
    with ``n`` units takes ``fill_s[d] + n * bottleneck_s[d] / k``, ``bottleneck_s`` being a whole
    micro-batch's), then packed into micro-batches of ``k`` units and one smaller remainder last:
    never larger than configured (activation memory), never more small ones than needed (each
    micro-batch has its fixed costs). Returns (micro-batch ids per pipeline, units of each id)."""
    k = units_per_micro_batch
    if k < 1:
        raise ValueError(f"units per micro-batch must be >= 1, got {k}")
    fill_s = _checked_fill("reshape", num_micro_batches, bottleneck_s, num_stages, fill_s)
    # Every pipeline starts at a whole micro-batch (as balance does), the rest by the unit.
    counts = _fill(num_micro_batches * k, k, [t / k for t in bottleneck_s], fill_s)
    ids, units, start = [], [], 0
    for n in counts:
        sizes = [k] * (n // k) + ([n % k] if n % k else [])
        ids.append(tuple(range(start, start + len(sizes))))
        units += sizes
        start += len(sizes)
    return ids, tuple(units)


def _checked_fill(what: str, num_micro_batches: int, bottleneck_s: Sequence[float], num_stages: Sequence[int],
                  fill_s: Sequence[float] | None) -> Sequence[float]:
    """The pipelines' fill and drain times (default ``(num_stages - 1) * bottleneck_s``), after
    checking the shape the greedy needs."""
    if not bottleneck_s or len(bottleneck_s) != len(num_stages):
        raise ValueError(f"{what} needs one bottleneck time and stage count per pipeline, got "
                         f"{list(bottleneck_s)} and {list(num_stages)}")
    if any(t <= 0 for t in bottleneck_s) or any(s < 1 for s in num_stages):
        raise ValueError(f"bottleneck times must be > 0 and stage counts >= 1, got {list(bottleneck_s)}, "
                         f"{list(num_stages)}")
    if num_micro_batches < len(bottleneck_s):
        raise ValueError(
            f"{num_micro_batches} micro-batches cannot give each of {len(bottleneck_s)} pipelines at least one")
    return fill_s if fill_s is not None else [(s - 1) * t for t, s in zip(bottleneck_s, num_stages)]


def _fill(total: int, first: int, each_s: Sequence[float], fill_s: Sequence[float]) -> list[int]:
    """Minimax counts by greedy filling: every pipeline starts at ``first``, each next one goes to
    the pipeline that would finish it soonest (``fill_s[d] + count * each_s[d]``, ties to the lower
    index)."""
    return _greedy(_below_threshold(total, first, each_s, fill_s), total, each_s, fill_s)


def _greedy(counts: list[int], total: int, each_s: Sequence[float], fill_s: Sequence[float]) -> list[int]:
    """``counts`` grown a unit at a time, each to the pipeline that would finish it soonest (ties to
    the lower index), until they hold ``total``."""
    heap = [(f + (c + 1) * t, d) for d, (t, f, c) in enumerate(zip(each_s, fill_s, counts))]
    heapq.heapify(heap)
    for _ in range(total - sum(counts)):
        _, d = heapq.heappop(heap)
        counts[d] += 1
        heapq.heappush(heap, (fill_s[d] + (counts[d] + 1) * each_s[d], d))
    return counts


def _below_threshold(total: int, first: int, each_s: Sequence[float], fill_s: Sequence[float]) -> list[int]:
    """Counts from which :func:`_fill`'s greedy goes on unchanged, at 10^4 pipelines and 10^5+ units
    in a few array passes, not one heap step a unit: the greedy takes the units in order of when
    each would finish (``fill_s[d] + count * each_s[d]``, then ``d``), so every unit finishing before
    a time ``T`` is taken before any other; ``T`` is the latest (by bisection) with no more units
    before it than are left to deal. The same float products as the greedy's, so the same counts."""
    left = total - first * len(each_s)
    if left <= 4 * len(each_s):
        return [first] * len(each_s)
    t, f = np.asarray(each_s, dtype=np.float64), np.asarray(fill_s, dtype=np.float64)

    def taken(limit: float) -> np.ndarray:
        """Per pipeline, the last count ``k >= first`` whose unit finishes before ``limit``."""
        k = np.maximum(np.floor((limit - f) / t), first)
        for _ in range(2):  # the division's rounding, mended with the greedy's own products
            k = np.where(f + (k + 1) * t < limit, k + 1, k)
            k = np.where((k > first) & (f + k * t >= limit), k - 1, k)
        return k

    lo, hi = float(np.min(f + (first + 1) * t)), float(np.max(f + (first + left + 1) * t))
    counts = taken(lo)
    for _ in range(64):
        mid = (lo + hi) / 2
        if mid in (lo, hi) or left - (counts.sum() - first * len(t)) <= len(t):
            break  # (the greedy deals the last few, at most one a pipeline, quicker than more passes)
        below = taken(mid)
        if below.sum() - first * len(t) <= left:
            lo, counts = mid, below
        else:
            hi = mid
    return [int(x) for x in counts]
