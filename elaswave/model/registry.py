"""Which model a job trains: the built-in families by name, or the user's ``model.factory``.

Beside the contract, not in it: the contract is a leaf every family imports, and this registry
imports the families, so the imports flow one way (families -> contract <- registry -> families).
"""
from __future__ import annotations

import importlib
import os
import sys

from elaswave.errors import ConfigError
from elaswave.model.contract import Model, ModelContractError, check
from elaswave.model.gpt import GPT
from elaswave.model.llama import Llama
from elaswave.model.llama_tp import TensorParallelLlama
from elaswave.tensor.split import TensorSplit


def model_for(cfg, shard: int | None = None) -> "Model":
    """The job's model (``cfg`` is a JobConfig): the built-in families, or ``model.factory``'s.
    With ``parallel.tp`` > 1: shard ``shard`` of a tensor-parallel group (its group is set before
    it runs), or for ``shard`` None the whole model computed in the same canonical blocks (the
    reference of a tensor-parallel job)."""
    m = cfg.model
    if cfg.parallel.tp > 1:
        split = TensorSplit(cfg.parallel.tp, shard) if shard is not None else TensorSplit(1, 0)
        return TensorParallelLlama(m, split, None, exact=cfg.train.deterministic,
                                   fused_attention=not cfg.train.deterministic,
                                   sequence_parallel=cfg.parallel.sequence_parallel)
    if m.factory:
        where = f"model.factory={m.factory!r}"
        try:
            model = load_factory(m.factory)(cfg)
        except ConfigError:
            raise
        except Exception as exc:  # the user's code: its failure in one line (ELASWAVE_DEBUG=1 re-raises)
            if os.environ.get("ELASWAVE_DEBUG"):
                raise
            raise ModelContractError(f"{where} raised {type(exc).__name__}: {exc}") from None
        return check(model, where)
    return family(m, fused_attention=not cfg.train.deterministic,
                  per_document_positions=cfg.data.position_ids == "per_document")


def family(m, fused_attention: bool = False, per_document_positions: bool = False) -> "Model":
    """A built-in family's model for a ModelConfig ``m`` (``arch``)."""
    if m.arch == "llama":
        return Llama(m, fused_attention=fused_attention, per_document_positions=per_document_positions)
    return GPT(m)


def load_factory(spec: str):
    """``package.module:function`` -> the function, with one-line errors."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"model.factory={spec!r} is invalid: must look like package.module:function")
    if os.getcwd() not in sys.path:  # a module next to the job, as `python -m` would find it
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an import error of any kind is the user's to see in one line
        raise ConfigError(f"model.factory={spec!r} is invalid: cannot import {module_name} "
                          f"({type(exc).__name__}: {exc})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"model.factory={spec!r} is invalid: {module_name} has no callable {attr}")
    return fn
