"""A small GPT as an explicit sequence of layers: [embedding, block x N, head].

A pipeline stage is a contiguous range of these layers. Each layer initialises itself from a stream
keyed by (seed, layer index), so a rank that builds only layers 3..5 gets the same weights as the
single-process reference. Dropout draws from a generator the caller passes in, keyed by
(seed, step, micro-batch, layer): the rank that runs the layer never enters the numbers.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from elaswave import rng
from elaswave.model import recompute
from elaswave.model.config import ModelConfig
from elaswave.model.contract import LayerCost
from elaswave.model.masks import causal_mask


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.p = cfg.dropout
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return rng.keyed_dropout(self.tok(idx) + self.pos(pos), self.p, gen)


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention written out (no fused kernels,
    whose choice of algorithm could change the bits between processes)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.p = cfg.dropout
        self.num_heads = cfg.num_heads
        self.recompute_core = False  # train.activation_checkpointing=selective (model/recompute.py)
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.ffn_width)
        self.out = nn.Linear(cfg.ffn_width, cfg.d_model)

    def forward(self, x: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        b, t, d = x.shape
        h = self.num_heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        y = recompute.attention_core(self, self._core, q, k, v, gen=gen).transpose(1, 2).reshape(b, t, d)
        x = x + rng.keyed_dropout(self.proj(y), self.p, gen)
        return x + rng.keyed_dropout(self.out(F.gelu(self.fc(self.ln2(x)))), self.p, gen)

    def _core(self, q, k, v, gen=None):
        t = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        att = att.masked_fill(causal_mask(t, q.device), float("-inf")).softmax(dim=-1)
        return rng.keyed_dropout(att, self.p, gen) @ v


class Head(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.lm = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        return self.lm(self.ln(x))


def _init_layer(layer: nn.Module, gen: torch.Generator, num_blocks: int) -> None:
    """GPT-2 style init from a keyed stream; residual projections scaled by depth."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif isinstance(getattr(layer, name.split(".")[0], None), nn.LayerNorm):
                p.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * num_blocks) if name.split(".")[0] in ("proj", "out") else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def build_layer(cfg: ModelConfig, index: int, seed: int, init: bool = True) -> nn.Module:
    """Layer ``index`` of the model (0 = embedding, last = head), initialised from its own stream
    (``init=False`` only builds shapes, e.g. on the meta device to count parameters)."""
    if not 0 <= index < cfg.num_layers:
        raise ValueError(f"layer index {index} out of range 0..{cfg.num_layers - 1}")
    if index == 0:
        layer: nn.Module = Embedding(cfg)
    elif index == cfg.num_layers - 1:
        layer = Head(cfg)
    else:
        layer = Block(cfg)
    if init:
        _init_layer(layer, rng.generator(seed, rng.INIT, index), cfg.num_blocks)
    return layer


def layer_flops(cfg: ModelConfig, index: int) -> float:
    """Forward multiply-adds per token of one layer: the planner's default cost profile."""
    d, t = cfg.d_model, cfg.seq_len
    if index == 0:
        return float(d)
    if index == cfg.num_layers - 1:
        return float(d * cfg.vocab_size)
    return float(4 * d * d + 2 * d * cfg.ffn_width + 2 * t * d)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the micro-batch's tokens (callers divide by the global count)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="sum")


class GPT:
    """The built-in byte-level GPT on the model contract (no ties)."""

    ties = ()

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.num_layers = cfg.num_layers
        self.seq_len = cfg.seq_len
        self.hidden_size = cfg.d_model
        self.vocab_size = cfg.vocab_size

    def build_layer(self, index: int, seed: int, init: bool = True) -> nn.Module:
        return build_layer(self.cfg, index, seed, init)

    def layer_costs(self) -> list[LayerCost]:
        core = float(2 * self.cfg.seq_len * self.cfg.d_model)
        return [LayerCost(layer_flops(self.cfg, i), _layer_numel(self.cfg, i), core if 0 < i < self.num_layers - 1 else 0.0)
                for i in range(self.num_layers)]

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(logits, targets)

    def identity(self) -> dict:
        m = self.cfg
        return {"arch": "gpt", "vocab_size": m.vocab_size, "seq_len": m.seq_len, "d_model": m.d_model,
                "num_heads": m.num_heads, "num_blocks": m.num_blocks}


def _layer_numel(m: ModelConfig, index: int) -> int:
    d = m.d_model
    if index == 0:
        return m.vocab_size * d + m.seq_len * d
    if index == m.num_layers - 1:
        return 2 * d + d * m.vocab_size
    return 4 * d * d + 2 * d * m.ffn_width + m.ffn_width + 9 * d
