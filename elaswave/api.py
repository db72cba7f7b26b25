"""The Python API, for people who script their runs::

    import elaswave
    run = elaswave.train(overrides=["model.preset=llama-tiny", "train.steps=20"], model=my_factory)
    run.losses, run.summary["params_sha256"], run.recoveries

``train`` runs the job exactly as ``elaswave run`` does -- worker processes, the launcher's store,
failures injected or real -- and returns its metrics. ``train_reference`` trains the same job in
this process, failure-free (not ``reference``: that name is the oracle's module). A model is given as its factory (``fn(cfg) -> model``, importable by the
worker processes, so defined at a module's top level) or as ``"package.module:function"``.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Callable, Sequence

from elaswave import config
from elaswave.config import JobConfig
from elaswave.errors import ConfigError
from elaswave.runtime.metrics import read_jsonl


@dataclass
class Run:
    exit_code: int
    records: list[dict]
    """Every metrics record: job, step, recovery, join, rebalance, resume, summary."""

    @property
    def steps(self) -> list[dict]:
        return [r for r in self.records if r["event"] == "step"]

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.steps]

    @property
    def eval_losses(self) -> dict[int, float]:
        """The held-out loss after each evaluated step count (``train.eval_every``)."""
        return {r["step"]: r["eval_loss"] for r in self.records if r["event"] == "eval"}

    @property
    def recoveries(self) -> list[dict]:
        return [r for r in self.records if r["event"] == "recovery"]

    @property
    def summary(self) -> dict:
        found = [r for r in self.records if r["event"] == "summary"]
        if not found:
            raise RuntimeError(f"the job ended with exit code {self.exit_code} and wrote no summary")
        return found[-1]


def _factory_spec(model: Callable | str) -> str:
    if isinstance(model, str):
        return model
    module, name = getattr(model, "__module__", None), getattr(model, "__qualname__", "")
    if not module or module == "__main__" or "<" in name:
        raise ConfigError(f"model={model!r} is invalid: the worker processes import it, so give a function "
                          f"defined at the top level of an importable module, or 'package.module:function'")
    return f"{module}:{name}"


def job(config_path: str | None = None, overrides: Sequence[str] = (), model: Callable | str | None = None) -> JobConfig:
    """The validated job config: a TOML file, ``section.key=value`` overrides, and a model factory."""
    extra = [f"model.factory={_factory_spec(model)}"] if model is not None else []
    return config.load(config_path, [*overrides, *extra])


def train(config_path: str | None = None, overrides: Sequence[str] = (), model: Callable | str | None = None,
          metrics_out: str | None = None, timeout_s: float | None = None) -> Run:
    """Run the job with its dp x pp worker processes on this host; returns its metrics."""
    from elaswave import preflight
    from elaswave.launch import launch

    cfg = job(config_path, overrides, model)
    preflight.check(cfg)  # as the command line does: a bad model or corpus is one error here, not one per worker
    with tempfile.TemporaryDirectory(prefix="elaswave-api-") as tmp:
        path = metrics_out or os.path.join(tmp, "metrics.jsonl")
        code = launch(cfg, path, timeout_s=timeout_s)
        return Run(code, read_jsonl(path) if os.path.exists(path) else [])


def train_reference(config_path: str | None = None, overrides: Sequence[str] = (),
              model: Callable | str | None = None) -> Run:
    """The same job trained failure-free in this process (the oracle elastic runs are compared to)."""
    from elaswave.reference import train_reference as oracle

    cfg = job(config_path, overrides, model)
    records: list[dict] = []
    result = oracle(cfg, on_step=records.append)
    records.append({"event": "summary", "steps": cfg.train.steps, "params_sha256": result["params_sha256"],
                    "state_sha256": result["state_sha256"],
                    "world_size": 1})
    return Run(0, records)
