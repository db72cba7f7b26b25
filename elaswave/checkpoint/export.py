"""Hugging Face exports: at the end of a run (``checkpoint.export_hf``), and offline from any disk
checkpoint (``elaswave export CHECKPOINT_DIR OUT_DIR``), whatever layout wrote it.

At the end of a run every layer is whole on each of its holders. Each layer is written by its
first holder, so each writing rank writes one shard of the layers it holds and nobody gathers the
model; the plan's first rank then writes the index and ``config.json`` and renames the staging
directory, so a failure mid-way never leaves a directory that looks finished.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterable

import torch

from elaswave.checkpoint import disk
from elaswave.errors import ConfigError
from elaswave.model import hf
from elaswave.model.config import ModelConfig
from elaswave.model.contract import untie
from elaswave.model.registry import family
from elaswave.plan.chunks import chunk_range, num_chunks
from elaswave.plan.plan import Plan
from elaswave.zero.flat import FlatLayer


def writers(plan: Plan) -> list[int]:
    """The ranks that write a shard: each layer's first holder."""
    return sorted({plan.holders(i)[0] for i in range(plan.num_layers)})


def clear_staging(out: str) -> None:
    """Before a run: what a failed earlier export left must not mix into this one."""
    shutil.rmtree(hf.staging_dir(out), ignore_errors=True)


def write_my_shard(out: str, plan: Plan, rank: int, layers: list[FlatLayer]) -> dict:
    """This rank's shard (if it writes one): ``{"names": [...], "bytes": n, "file": name}``."""
    ws = writers(plan)
    if rank not in ws:
        return {"names": [], "bytes": 0, "file": ""}
    tensors: dict[str, torch.Tensor] = {}
    for layer in layers:
        if plan.holders(layer.index)[0] == rank:
            tensors.update(hf.layer_tensors(layer.module, layer.index, plan.num_layers))
    k = ws.index(rank)
    names = hf.write_shard(out, k, len(ws), tensors)
    return {"names": names, "bytes": _nbytes(tensors), "file": hf.shard_name(k, len(ws))}


def finish_run_export(out: str, m: ModelConfig, parts: list[dict]) -> Path:
    """On the plan's first rank, once every writer has posted its part."""
    weight_map = {name: p["file"] for p in parts for name in p["names"]}
    return hf.finish(out, m, weight_map, sum(p["bytes"] for p in parts))


def export_checkpoint(ckpt: str, out: str, max_shard_bytes: int = 5 * 2 ** 30) -> Path:
    """A disk checkpoint (its newest complete step, a step folder given, or one fence of it) -> a Hugging Face
    directory: each layer rebuilt from its chunks' parameter rows, written in shards of at most
    ``max_shard_bytes`` (whole layers), as Hugging Face shards."""
    path = Path(ckpt)
    manifest = disk.named(path)
    if manifest is None:
        raise ConfigError(f"CHECKPOINT_DIR={ckpt!r} is invalid: no complete checkpoint there (a folder "
                          f"written with checkpoint.dir, or one of its step_* folders)")
    try:
        m = ModelConfig(**manifest.model)
        m.validate()
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"CHECKPOINT_DIR={ckpt!r} is invalid: its model cannot be rebuilt ({exc})") from None
    hf.check_exportable(m)
    model = family(m)

    def rebuilt(i: int) -> FlatLayer:
        module = model.build_layer(i, 0, init=False)
        untie(model, module, i)
        layer = FlatLayer(module, i)
        keys = [(i, c) for c in range(num_chunks(layer.numel, manifest.chunk_numel))]
        chunks = disk.load_chunks(manifest, keys)
        with torch.no_grad():
            for key in keys:
                start, end = chunk_range(layer.numel, manifest.chunk_numel, key[1])
                layer.flat[start:end] = chunks[key][0, :end - start]
        return layer

    return write_layers(out, m, (rebuilt(i) for i in range(model.num_layers)), model.num_layers, max_shard_bytes)


def write_layers(out: str, m: ModelConfig, layers: Iterable[FlatLayer], num_layers: int,
                 max_shard_bytes: int = 5 * 2 ** 30) -> Path:
    """Whole layers, in order, into shards of at most ``max_shard_bytes`` (one process writes all:
    the reference trainer, or ``elaswave export``), then the index and config.json."""
    clear_staging(out)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for layer in layers:
        tensors = hf.layer_tensors(layer.module, layer.index, num_layers)
        if shards[-1] and size + _nbytes(tensors) > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1].update(tensors)
        size += _nbytes(tensors)
    weight_map = {name: hf.shard_name(k, len(shards))
                  for k, tensors in enumerate(shards) for name in hf.write_shard(out, k, len(shards), tensors)}
    return hf.finish(out, m, weight_map, sum(_nbytes(t) for t in shards))


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
