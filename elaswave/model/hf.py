"""Hugging Face checkpoints in and out (Llama family), through ``safetensors``.

The name mapping is data: layer 0 is ``model.embed_tokens``, block ``i`` (layer ``i + 1``) is
``model.layers.{i}``, the head is ``model.norm`` and ``lm_head``; inside them, module names are
Hugging Face's own (see :mod:`elaswave.model.llama`). Reading is lazy: a rank opens the files and
reads only the tensors of the layers it builds. Writing a folder is :mod:`elaswave.checkpoint.hf_folder`.
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import nn

from elaswave.errors import ConfigError
from elaswave.model.config import ModelConfig
from elaswave.model.contract import on_meta
from elaswave.model.lora import ADAPTERS, merged_tensors

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
            self.files = {}
            for f in sorted(self.path.glob("*.safetensors")):
                with _opened(f, path) as fh:
                    self.files.update({name: f for name in fh.keys()})
        if not self.files:
            raise HFError(f"model.init_from={path!r} is invalid: no tensors in its *.safetensors files")

    def check(self, model) -> None:
        """Every tensor the model's layers need is there with its shape (read from headers only)."""
        with on_meta():
            for i in range(model.num_layers):
                skip = {t.user_param for t in model.ties if t.user == i}
                cut = model.hf_cut if hasattr(model, "hf_cut") else None  # a tensor-parallel shard's part
                self._visit(model.build_layer(i, 0, init=False), i, model.num_layers, skip, load=False, cut=cut)

    def load_layer(self, layer: nn.Module, index: int, num_layers: int, skip: Iterable[str] = (),
                   cut: Callable[[str, tuple[int, ...]], Cut | None] | None = None) -> None:
        """Copy this layer's tensors from disk into ``layer`` (its own tensors only). ``cut(name,
        shape on disk)``: the part of a tensor ``layer`` holds (a tensor-parallel shard), read from
        the file as that slice alone."""
        with torch.no_grad():
            self._visit(layer, index, num_layers, set(skip), load=True, cut=cut)

    def _visit(self, layer: nn.Module, index: int, num_layers: int, skip: set[str], load: bool,
               cut: Callable[[str, tuple[int, ...]], Cut | None] | None = None) -> None:
        """Each of the layer's parameters (but ``skip``) found on disk with its shape, and copied in
        with ``load``; one file opened once for all the tensors it holds."""
        where = f"model.init_from={str(self.path)!r}"
        by_file: dict[Path, list[tuple[str, torch.Tensor]]] = {}
        for name, p in layer.named_parameters():
            if name in skip or name.rpartition(".")[2] in ADAPTERS:  # adapters are the run's, not the folder's
                continue
            key = hf_name(index, num_layers, name)
            if key not in self.files:
                raise HFError(f"{where}: tensor {key} (layer {index}) is missing")
            by_file.setdefault(self.files[key], []).append((key, name, p))
        for f, items in by_file.items():
            if not f.is_file():
                raise HFError(f"{where}: {f.name}, named in {INDEX}, does not exist")
            with _opened(f, str(self.path)) as fh:
                for key, name, p in items:
                    shape = tuple(fh.get_slice(key).get_shape())
                    part = cut(name, shape) if cut is not None else None
                    held = shape if part is None else part.shape(shape)
                    if held != tuple(p.shape):
                        split = f" (cut {part.ways} ways: {list(held)})" if part is not None else ""
                        raise HFError(f"{where}: tensor {key} has shape {list(shape)}{split}, the model expects "
                                      f"{list(p.shape)}")
                    if load:
                        try:
                            p.copy_((fh.get_tensor(key) if part is None else part.read(fh.get_slice(key), shape))
                                    .to(p.dtype))
                        except Exception as exc:  # safetensors' own errors: a file cut short after its header
                            raise HFError(f"{where}: {f.name} cannot be read ({exc}); is it truncated?") from None


@dataclass(frozen=True)
class Cut:
    """Rows or columns [start, end) of a tensor along ``dim``, zero rows past its end up to
    ``end`` (a padded vocabulary), taken ``ways`` ways (a tensor-parallel shard)."""
    dim: int
    start: int
    end: int
    ways: int

    def shape(self, whole: tuple[int, ...]) -> tuple[int, ...]:
        out = list(whole)
        out[self.dim] = self.end - self.start
        return tuple(out)

    def read(self, sliced, whole: tuple[int, ...]) -> torch.Tensor:
        """This part from a ``safe_open`` slice: only its own bytes are read."""
        stop = min(self.end, whole[self.dim])
        index = tuple([slice(None)] * self.dim + [slice(self.start, stop)])
        t = sliced[index] if stop > self.start else torch.zeros(self.shape(whole)[:self.dim] + (0,) + whole[self.dim + 1:])
        pad = self.end - max(stop, self.start)
        if pad:
            t = torch.cat([t, t.new_zeros(*t.shape[:self.dim], pad, *t.shape[self.dim + 1:])], dim=self.dim)
        return t


@contextlib.contextmanager
def _opened(f: Path, where: str):
    """``safe_open`` with a one-line error for a file that is not safetensors (truncated, corrupt)."""
    from safetensors import safe_open
    try:
        fh = safe_open(str(f), framework="pt")
    except Exception as exc:  # SafetensorError and OSError alike
        raise HFError(f"model.init_from={where!r}: {f.name} is not a readable safetensors file ({exc})") from None
    with fh:
        yield fh


def layer_tensors(module: nn.Module, index: int, num_layers: int, dtype: torch.dtype | None = None,
                  adapters: str = "") -> dict[str, torch.Tensor]:
    """A built layer's own parameters under their Hugging Face names (a tied use is not its own),
    cast to ``dtype`` when given. A layer with LoRA adapters (model.lora): ``adapters=adapter`` gives
    the adapters alone under peft's saved names (``base_model.model.<name>.lora_A.weight``);
    ``merged`` the plain model's tensors, each adapter merged into its weight."""
    if adapters == "adapter":
        named = ((f"base_model.model.{hf_name(index, num_layers, name)}.weight", p.detach())
                 for name, p in module.named_parameters() if name.rpartition(".")[2] in ADAPTERS)
    else:
        named = ((hf_name(index, num_layers, name), t) for name, t in
                 (merged_tensors(module).items() if adapters == "merged" else module.named_parameters()))
    return {key: t.detach().to(dtype or t.dtype).cpu().contiguous() for key, t in named}


def check_exportable(m: ModelConfig) -> None:
    if m.arch != "llama" or m.factory:
        raise ConfigError(f"checkpoint.export_hf needs model.arch=llama (Hugging Face's Llama layout); "
                          f"this job's model is {m.factory or m.arch}")
