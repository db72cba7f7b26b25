"""Hugging Face checkpoints in and out (Llama family), through ``safetensors``.

The name mapping is data: layer 0 is ``model.embed_tokens``, block ``i`` (layer ``i + 1``) is
``model.layers.{i}``, the head is ``model.norm`` and ``lm_head``; inside them, module names are
Hugging Face's own (see :mod:`elaswave.model.llama`). Reading is lazy: a rank opens the files and
reads only the tensors of the layers it builds. Writing goes to a temporary directory that is
renamed when complete, so a failure mid-way never leaves a directory that looks finished.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable, Mapping

import torch
from torch import nn

from elaswave.errors import ConfigError
from elaswave.model.config import ModelConfig, to_hf_config

INDEX = "model.safetensors.index.json"


class HFError(ConfigError):
    """A Hugging Face directory cannot be used; one line naming the tensor, file or shape."""


def hf_name(index: int, num_layers: int, param: str) -> str:
    """The Hugging Face name of parameter ``param`` of layer ``index``."""
    if index == 0:
        return f"model.{param}"
    if index == num_layers - 1:
        return param if param.startswith("lm_head.") else f"model.{param}"
    return f"model.layers.{index - 1}.{param}"


class HFWeights:
    """The tensors of a local Hugging Face directory (single file, or sharded with its index)."""

    def __init__(self, path: str):
        self.path = Path(path)
        index = self.path / INDEX
        if index.is_file():
            self.files = {name: self.path / f for name, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            from safetensors import safe_open
            self.files = {}
            for f in sorted(self.path.glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as fh:
                    self.files.update({name: f for name in fh.keys()})
        if not self.files:
            raise HFError(f"model.init_from={path!r} is invalid: no tensors in its *.safetensors files")

    def check(self, model) -> None:
        """Every tensor the model's layers need is there with its shape (read from headers only)."""
        with torch.device("meta"):
            for i in range(model.num_layers):
                skip = {t.user_param for t in model.ties if t.user == i}
                self._visit(model.build_layer(i, 0, init=False), i, model.num_layers, skip, load=False)

    def load_layer(self, layer: nn.Module, index: int, num_layers: int, skip: Iterable[str] = ()) -> None:
        """Copy this layer's tensors from disk into ``layer`` (its own tensors only)."""
        with torch.no_grad():
            self._visit(layer, index, num_layers, set(skip), load=True)

    def _visit(self, layer: nn.Module, index: int, num_layers: int, skip: set[str], load: bool) -> None:
        """Each of the layer's parameters (but ``skip``) found on disk with its shape, and copied in
        with ``load``; one file opened once for all the tensors it holds."""
        from safetensors import safe_open
        where = f"model.init_from={str(self.path)!r}"
        by_file: dict[Path, list[tuple[str, torch.Tensor]]] = {}
        for name, p in layer.named_parameters():
            if name in skip:
                continue
            key = hf_name(index, num_layers, name)
            if key not in self.files:
                raise HFError(f"{where}: tensor {key} (layer {index}) is missing")
            by_file.setdefault(self.files[key], []).append((key, p))
        for f, items in by_file.items():
            if not f.is_file():
                raise HFError(f"{where}: {f.name}, named in {INDEX}, does not exist")
            with safe_open(str(f), framework="pt") as fh:
                for key, p in items:
                    shape = tuple(fh.get_slice(key).get_shape())
                    if shape != tuple(p.shape):
                        raise HFError(f"{where}: tensor {key} has shape {list(shape)}, the model expects {list(p.shape)}")
                    if load:
                        p.copy_(fh.get_tensor(key).to(p.dtype))


def layer_tensors(module: nn.Module, index: int, num_layers: int) -> dict[str, torch.Tensor]:
    """A built layer's own parameters under their Hugging Face names (a tied use is not its own)."""
    return {hf_name(index, num_layers, name): p.detach().cpu().contiguous()
            for name, p in module.named_parameters()}


def shard_name(k: int, n: int) -> str:
    return f"model-{k + 1:05d}-of-{n:05d}.safetensors"


def staging_dir(out: str | Path) -> Path:
    out = Path(out)
    return out.parent / f".{out.name}.partial"


def write_shard(out: str | Path, k: int, n: int, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Shard ``k`` of ``n`` into the staging directory of ``out``; returns the names it holds."""
    from safetensors.torch import save_file
    stage = staging_dir(out)
    stage.mkdir(parents=True, exist_ok=True)
    save_file(dict(tensors), str(stage / shard_name(k, n)), metadata={"format": "pt"})
    return sorted(tensors)


def finish(out: str | Path, m: ModelConfig, weight_map: Mapping[str, str], total_bytes: int) -> Path:
    """Index and config.json into the staging directory, then rename it to ``out`` (atomic)."""
    out, stage = Path(out), staging_dir(out)
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (stage / INDEX).write_text(json.dumps(index, indent=2))
    (stage / "config.json").write_text(json.dumps(to_hf_config(m), indent=2))
    if out.exists():
        shutil.rmtree(out)
    os.replace(stage, out)
    return out


def check_exportable(m: ModelConfig) -> None:
    if m.arch != "llama" or m.factory:
        raise ConfigError(f"checkpoint.export_hf needs model.arch=llama (Hugging Face's Llama layout); "
                          f"this job's model is {m.factory or m.arch}")
