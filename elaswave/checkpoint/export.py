"""Hugging Face exports: at the end of a run (``checkpoint.export_hf``), and offline from any disk
checkpoint (``elaswave export CHECKPOINT_DIR OUT_DIR``), whatever layout wrote it.

At the end of a run every layer is whole on each of its holders. Each layer is written by its
first holder, so each writing rank writes the shards of the layers it holds and nobody gathers the
model; the plan's first rank then checks them, names them in layer order and moves the folder into
place (see :mod:`elaswave.checkpoint.hf_folder`: what the folder holds, and why it is safe).
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable

import torch

from elaswave.checkpoint import disk, hf_folder, target
from elaswave.errors import ConfigError
from elaswave.model import hf, lora
from elaswave.model.config import ModelConfig, from_hf_config
from elaswave.model.lora_config import LoraConfig
from elaswave.model.contract import untie
from elaswave.model.registry import family
from elaswave.model.units import layer_units
from elaswave.plan.chunks import chunk_range, num_chunks
from elaswave.plan.plan import Plan
from elaswave.zero.flat import FlatLayer

DEFAULT_MAX_SHARD_GB = 5.0
ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"


@dataclass
class Target:
    """One export: where, in which dtype, in shards of at most how many bytes, from which source."""

    out: str
    dtype: torch.dtype
    max_shard_bytes: int
    overwrite: bool
    source: hf_folder.Source
    adapters: str = ""
    """A LoRA run's export (checkpoint.export_lora): adapter or merged; empty without adapters."""
    base: str = ""
    """The base model's folder, named in a peft adapter folder (empty: a model built from a preset)."""

    @classmethod
    def of_job(cls, cfg) -> "Target":
        """``checkpoint.export_hf`` of a job (a JobConfig)."""
        c = cfg.checkpoint
        # A mixture's corpora share a template (preflight): its first corpus stands for the data.
        corpus = next((p for p, _ in cfg.data.mixture), cfg.data.path) if cfg.data.kind == "tokens" else ""
        source = hf_folder.source_of(cfg.model.init_from, corpus)
        return cls(c.export_hf, hf_folder.export_dtype(c.export_dtype, source), int(c.max_shard_gb * 2 ** 30),
                   c.overwrite, source, c.export_lora if cfg.model.lora.enabled else "",
                   os.path.abspath(cfg.model.init_from) if cfg.model.init_from else "")


def write_my_shards(target: Target, plan: Plan, rank: int, layers: list[FlatLayer], model=None,
                    seed: int = 0) -> list[dict]:
    """This rank's shards (none if it writes none): the units it is the first holder of -- a
    layer's own tensors, an expert's (model/units.py: its owners alone hold it) -- in pieces.
    ``model``, ``seed``: where a merged export reads each base weight again (see :func:`_fresh_base`)."""
    experts: dict[int, list[int]] = {}
    for u in range(plan.num_layers, plan.num_units):
        experts.setdefault(plan.layer_of(u), []).append(u)

    def mine(layer: int, name: str) -> bool:
        expert = _EXPERT.search(name)
        return plan.holders(layer if expert is None else experts[layer][int(expert.group(1))])[0] == rank
    held = [layer for layer in sorted(layers, key=lambda l: l.index) if layer.index < plan.num_layers
            and any(plan.holders(u)[0] == rank for u in [layer.index, *experts.get(layer.index, ())])]
    return _write(target, held, plan.num_layers, f"r{rank:05d}", model, seed, mine)


_EXPERT = re.compile(r"\.experts\.(\d+)\.")
"""An expert's tensor, by its Hugging Face name (Mixtral's and Qwen's alike)."""


def finish_run_export(target: Target, m: ModelConfig, parts: list[list[dict]]) -> Path:
    """On the plan's first rank, once every writer has posted its shards: checked, in layer order."""
    ordered = sorted((p for ps in parts for p in ps), key=lambda p: p["first_layer"])
    return _finish(target, m, ordered)


def write_layers(target: Target, m: ModelConfig, layers: Iterable[FlatLayer], num_layers: int, model=None,
                 seed: int = 0) -> Path:
    """Whole layers, in order, by one process (the reference trainer, or ``elaswave export``)."""
    hf_folder.clear_staging(target.out)
    return _finish(target, m, _write(target, layers, num_layers, "all", model, seed))


def _finish(target: Target, m: ModelConfig, parts: list[dict]) -> Path:
    if target.adapters == "adapter":  # peft reads one adapter_model.safetensors beside adapter_config.json
        return hf_folder.finish(target.out, parts, lora.peft_config(m.lora, target.base), target.source,
                                target.overwrite, sys.maxsize, single=ADAPTER_WEIGHTS, config_name=ADAPTER_CONFIG)
    return hf_folder.finish(target.out, parts, hf_folder.config_doc(m, target.source, target.dtype),
                            target.source, target.overwrite, target.max_shard_bytes)


def _write(target: Target, layers: Iterable[FlatLayer], num_layers: int, tag: str, model=None,
           seed: int = 0, keep=lambda layer, name: True) -> list[dict]:
    """``layers``: layers' own units, whose modules hold their experts; ``keep(layer, name)``:
    whether a tensor is written here."""
    fresh = target.adapters == "merged" and model is not None
    by_layer = ((layer.index, {k: t for k, t in hf.layer_tensors(
        _fresh_base(model, seed, layer) if fresh else layer.module, layer.index, num_layers, target.dtype,
        target.adapters).items() if keep(layer.index, k)}) for layer in layers if layer.index < num_layers)
    return [hf_folder.write_part(target.out, f"{tag}-{j:03d}", first, tensors)
            for j, (first, tensors) in enumerate(hf_folder.pieces(by_layer, target.max_shard_bytes))]


def _fresh_base(model, seed: int, layer: FlatLayer):
    """``layer``'s adapters on its base weights as its source gives them: the run holds a frozen
    weight in the compute dtype (bf16 rounds it), which a merged weight must not inherit."""
    module = model.build_layer(layer.index, seed)
    untie(model, module, layer.index)
    own = dict(layer.module.named_parameters())
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.rpartition(".")[2] in lora.ADAPTERS:
                p.copy_(own[name])
    return module


def export_checkpoint(ckpt: str, out: str, max_shard_bytes: int = int(DEFAULT_MAX_SHARD_GB * 2 ** 30),
                      dtype: str = "auto", overwrite: bool = False, source: str = "", merge: bool = False) -> Path:
    """A disk checkpoint (its newest complete step, a step folder given, or one fence of it) -> a Hugging Face
    directory: each layer rebuilt from its chunks' parameter rows. ``source``: the folder whose
    config.json and tokenizer files to carry (default: the run's ``model.init_from`` if it still exists).
    A LoRA run's checkpoint holds its adapters only: they are written as a peft adapter folder, or
    with ``merge`` into the base's weights (read from ``source``, or the keyed init of a preset's run)."""
    path = Path(ckpt)
    from elaswave.tensor.checkpoints import degree_of
    if (tp := degree_of(ckpt)) is not None:
        raise ConfigError(f"CHECKPOINT_DIR={ckpt!r} is invalid: it was written at parallel.tp={tp}, and an export from "
                          "tensor-parallel shards' checkpoints is not built yet; export in the run with "
                          "checkpoint.export_hf")
    manifest = disk.named(path)
    if manifest is None:
        raise ConfigError(f"CHECKPOINT_DIR={ckpt!r} is invalid: no complete checkpoint there (a folder "
                          f"written with checkpoint.dir, or one of its step_* folders)")
    try:
        shape = dict(manifest.model)
        adapters = LoraConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in shape.pop("lora", {}).items()})
        m = ModelConfig(**shape, lora=adapters)
        m.validate()
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"CHECKPOINT_DIR={ckpt!r} is invalid: its model cannot be rebuilt ({exc})") from None
    hf.check_exportable(m)
    recorded, corpus = manifest.source.get("init_from", ""), manifest.source.get("data", "")
    source = source or (recorded if recorded and Path(recorded, "config.json").is_file() else "")
    target.check_target(out, overwrite, "OUT_DIR", {"the checkpoint": ckpt, "--source": source,
                                                    "the run's model.init_from": recorded, "the run's data.path": corpus})
    found = hf_folder.source_of(source, corpus)
    if found.config is not None:  # its config.json is written beside these weights: it must describe them
        shapes = from_hf_config(found.config, source, m.seq_len)
        differ = [f"{k}={shapes[k]!r} there, {manifest.model[k]!r} in the checkpoint" for k in shapes
                  if k in manifest.model and manifest.model[k] != shapes[k]]
        if differ:
            raise ConfigError(f"--source={source!r} is invalid: its config.json describes another model than "
                              f"{ckpt!r} holds ({', '.join(differ)}); give the folder the run started from")
    if merge and not m.lora.enabled:
        raise ConfigError(f"--merge is invalid: {ckpt!r} is not a LoRA run's checkpoint (model.lora.rank=0), its "
                          "weights are whole already; leave --merge out")
    merged = merge and m.lora.enabled
    if merged and not recorded and source:
        raise ConfigError(f"--source={source!r} is invalid with --merge here: {ckpt!r} is of a run whose base was "
                          "a preset's keyed init, which --merge draws again; leave --source out")
    if merged and recorded and not source:
        raise ConfigError(f"--merge needs the base model's folder, and the run's model.init_from={recorded!r} is "
                          "gone; give it with --source HF_DIR")
    # Merged, each layer's base weights are read again (the checkpoint holds the adapters only).
    model = family(replace(m, init_from=source) if merged else m)
    seed = int(manifest.data.get("seed", 0))

    def rebuilt(i: int) -> FlatLayer:
        units = layer_units(model, i, seed, init=merged)
        keys = [(u.index, c) for u in units for c in range(num_chunks(u.numel, manifest.chunk_numel))]
        chunks = disk.load_chunks(manifest, keys)
        by_index = {u.index: u for u in units}
        with torch.no_grad():
            for key in keys:
                unit = by_index[key[0]]
                start, end = chunk_range(unit.numel, manifest.chunk_numel, key[1])
                unit.flat[start:end] = chunks[key][0, :end - start]
        return units[0]  # its module holds the experts' values too

    mode = ("merged" if merge else "adapter") if m.lora.enabled else ""
    return write_layers(Target(out, hf_folder.export_dtype(dtype, found), max_shard_bytes, overwrite, found, mode,
                               os.path.abspath(source) if source else ""), m,
                        (rebuilt(i) for i in range(model.num_layers)), model.num_layers)
