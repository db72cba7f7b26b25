"""Which pipeline runs which micro-batches (pure).

The global batch is always micro-batches ``0..M-1``; only their assignment changes. Counts follow
each pipeline's speed (largest remainder), and each pipeline gets a contiguous id range so the
assignment is easy to read in logs.
"""
from __future__ import annotations

from typing import Sequence


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
