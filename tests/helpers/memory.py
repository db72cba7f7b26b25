"""Memory limits for tests, from the job's own memory model (elaswave/plan/memory.py)."""
from __future__ import annotations

from elaswave import config
from elaswave.runtime.memory import least_stage_memory_mb
from tests.helpers.spawn import TINY


def limit_between(extra: list[str], pipelines: int, deterministic: bool) -> float:
    """A ``parallel.stage_memory_mb`` that fits the model on two stages per pipeline but not on one
    (the tiny job of ``job_args`` with ``extra``; ``pipelines`` of them)."""
    cfg = config.load(None, [*TINY, *extra, f"train.deterministic={str(deterministic).lower()}"])
    two, one = least_stage_memory_mb(cfg, 2, pipelines), least_stage_memory_mb(cfg, 1, pipelines)
    assert two < one, (two, one)
    return round((two + one) / 2, 2)
