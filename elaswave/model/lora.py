"""LoRA (Hu et al., 2021) on the Llama family's projections, computed as peft computes it.

A targeted projection ``W x + b`` becomes ``W x + b + (alpha / r) * B (A dropout(x))`` with ``A``
``[r, in]`` and ``B`` ``[out, r]``. Every base weight is frozen (``requires_grad`` off): a layer's
flat vector, and with it its ZeRO chunks, snapshots, gradient sums, digests and disk checkpoints,
holds its adapters only (:class:`elaswave.zero.flat.FlatLayer`). A frozen weight never changes, so
it never travels: whoever builds a layer reads it again from its source (``model.init_from``, or the
keyed init), as a layer's first holder did.

``A`` starts as peft's does (Kaiming-uniform, bound ``1/sqrt(in)``) but from a keyed stream, ``B``
at zero: the first step's model is the base model. The dropout draws from the layer's keyed stream
(the one its attention dropout uses), so a recomputed or re-placed layer draws the same masks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from elaswave import rng
from elaswave.model.lora_config import LoraConfig

ADAPTERS = ("lora_A", "lora_B")


class LoraLinear(nn.Module):
    """A frozen ``nn.Linear``'s ``weight`` and ``bias`` (same names, so Hugging Face checkpoints
    map onto it as onto the projection it replaces) and the trainable ``lora_A`` and ``lora_B``."""

    def __init__(self, base: nn.Linear, lora: LoraConfig):
        super().__init__()
        self.weight = base.weight
        self.bias = base.bias
        self.lora_A = nn.Parameter(torch.zeros(lora.rank, base.in_features, device=base.weight.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, lora.rank, device=base.weight.device))
        self.scaling = lora.scaling
        self.p = lora.dropout

    def forward(self, x: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        h = rng.keyed_dropout(x, self.p, gen)
        return out + F.linear(F.linear(h, self.lora_A), self.lora_B) * self.scaling

    def merged_weight(self) -> torch.Tensor:
        """``W + (alpha / r) B A`` in float32: peft's merge_and_unload."""
        delta = (self.lora_B.detach().float() @ self.lora_A.detach().float()) * self.scaling
        return self.weight.detach().float() + delta


def project(linear: nn.Module, x: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """A projection on ``x``: an adapter's dropout reads the layer's stream, a plain one needs none."""
    return linear(x, gen) if isinstance(linear, LoraLinear) else linear(x)


def attach(layer: nn.Module, lora: LoraConfig, gen: torch.Generator | None) -> nn.Module:
    """Freeze ``layer``'s weights and put adapters on its targeted projections (a block's; the
    embedding and head only freeze). ``gen``: the stream ``A`` is drawn from (None: left at zero,
    for a layer built only to be counted or filled)."""
    for p in layer.parameters():
        p.requires_grad_(False)
    for path in lora.paths():
        parent_path, _, name = path.rpartition(".")
        try:
            parent = layer.get_submodule(parent_path)
        except AttributeError:
            return layer  # not a block
        adapted = LoraLinear(getattr(parent, name), lora)
        if gen is not None:
            bound = adapted.lora_A.shape[1] ** -0.5
            with torch.no_grad():
                adapted.lora_A.copy_(torch.rand(adapted.lora_A.shape, generator=gen) * (2 * bound) - bound)
        setattr(parent, name, adapted)
    return layer


def init_stream(seed: int, index: int) -> torch.Generator:
    return rng.generator(seed, rng.LORA, index)


def merged_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """A layer's parameters as a plain model's (module name -> tensor): each adapted projection's
    weight merged, the adapters themselves gone."""
    out = {}
    for name, p in module.named_parameters():
        path, _, leaf = name.rpartition(".")
        if leaf in ADAPTERS:
            continue
        owner = module.get_submodule(path) if path else module
        out[name] = owner.merged_weight() if isinstance(owner, LoraLinear) and leaf == "weight" else p.detach()
    return out


def peft_config(lora: LoraConfig, base: str) -> dict:
    """peft's ``adapter_config.json`` for these adapters (a LoRA for causal language modelling)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "bias": "none", "fan_in_fan_out": False,
            "target_modules": sorted({p.rpartition(".")[2] for p in lora.paths()}), "use_rslora": False,
            "use_dora": False, "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
            "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}}
