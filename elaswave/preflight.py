"""What a job checks once, up front, before any worker starts -- from the command line and the
Python API alike: so a bad weights file, corpus, factory or memory limit is one line here, not N
worker tracebacks (or one worker's exit and its peers waiting ``parallel.timeout_s``)."""
from __future__ import annotations

from elaswave.config import JobConfig
from elaswave.errors import ConfigError


def check(cfg: JobConfig) -> None:
    check_model_and_data(cfg)
    check_memory(cfg)


def check_memory(cfg: JobConfig) -> None:
    """A memory limit no layout meets: said here once, before any rank starts."""
    limit = cfg.parallel.stage_memory_mb
    if not limit:
        return
    from elaswave.comm import backend
    from elaswave.runtime.memory import least_stage_memory_mb

    least = least_stage_memory_mb(cfg, cfg.parallel.pp, cfg.parallel.dp, backend.choose(cfg.parallel.backend)[1])
    if least > limit:
        raise ConfigError(f"parallel.stage_memory_mb={limit} is invalid: no partition of the model into "
                          f"{cfg.parallel.pp} stages fits it at dp={cfg.parallel.dp}; the least any needs is "
                          f"{least:.4g} (MiB per rank, as elaswave/plan/memory.py models it)")


def check_model_and_data(cfg: JobConfig) -> None:
    """Load the corpus and check the model once up front, so a bad data file, factory or checkpoint
    is one line here, not N worker tracebacks."""
    from elaswave.data.sampler import open_eval_sampler, open_sampler
    from elaswave.model.registry import model_for

    model = model_for(cfg)
    if cfg.model.init_from:
        model.weights.check(model)
    open_sampler(cfg, model)
    if cfg.train.eval_every:
        open_eval_sampler(cfg, model)
