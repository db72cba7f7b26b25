"""Bring your own model: a tiny language model written against elaswave's model contract.

Train it elastically, with a rank SIGKILLed at step 20 and a replacement that joins:

    elaswave run --deterministic --set model.factory=examples.custom_model:build \
        --inject kill:rank=1,step=20 --respawn-after 0 --set train.steps=150

The contract (docs/models.md): an ordered list of layers, each built alone and initialised from
its own keyed stream; a cost per layer; a loss; declared ties. Here the input embedding and the
output head share one matrix (a tie), so the runtime keeps one gradient sum and one optimizer
state for it wherever the two layers sit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from elaswave import rng
from elaswave.model.contract import LayerCost, Tie


class Embed(nn.Module):
    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.table = nn.Embedding(vocab, width)

    def forward(self, ids, gen):
        return self.table(ids)


class MixerBlock(nn.Module):
    """Causal token mixing (a learned lower-triangular matrix) and a channel MLP."""

    def __init__(self, seq_len: int, width: int, dropout: float):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mix = nn.Parameter(torch.zeros(seq_len, seq_len))
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.register_buffer("causal", torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool)), persistent=False)
        self.p = dropout

    def forward(self, x, gen):
        t = x.shape[1]
        weights = self.mix[:t, :t].masked_fill(~self.causal[:t, :t], float("-inf")).softmax(-1)
        x = x + weights @ self.norm(x)
        return x + rng.keyed_dropout(self.down(F.gelu(self.up(x))), self.p, gen)  # masks keyed, not global


class Head(nn.Module):
    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab, bias=False)  # tied to the embedding's table

    def forward(self, x, gen):
        return self.out(self.norm(x))


class TinyMixer:
    def __init__(self, vocab: int, seq_len: int, width: int, num_blocks: int, dropout: float):
        self.vocab_size, self.seq_len, self.hidden_size = vocab, seq_len, width
        self.num_blocks, self.dropout = num_blocks, dropout
        self.num_layers = num_blocks + 2
        self.ties = (Tie(0, "table.weight", self.num_layers - 1, "out.weight"),)

    def build_layer(self, index: int, seed: int, init: bool = True) -> nn.Module:
        if index == 0:
            layer = Embed(self.vocab_size, self.hidden_size)
        elif index == self.num_layers - 1:
            layer = Head(self.vocab_size, self.hidden_size)
        else:
            layer = MixerBlock(self.seq_len, self.hidden_size, self.dropout)
        if init:  # layer `index` draws only from its own stream: any placement holds the same weights
            gen = rng.generator(seed, rng.INIT, index)
            with torch.no_grad():
                for name, p in layer.named_parameters():
                    p.copy_(torch.ones_like(p) if "norm.weight" in name else torch.randn(p.shape, generator=gen) * 0.02)
        return layer

    def layer_costs(self) -> list[LayerCost]:
        d, t, v = self.hidden_size, self.seq_len, self.vocab_size
        block = LayerCost(float(t * d + 4 * d * d), t * t + 2 * d + 4 * d * d + 3 * d)
        return [LayerCost(float(d), v * d), *[block] * self.num_blocks, LayerCost(float(d * v), 2 * d)]

    def loss_sum(self, logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")

    def identity(self) -> dict:
        return {"model": "TinyMixer", "vocab": self.vocab_size, "seq_len": self.seq_len,
                "width": self.hidden_size, "blocks": self.num_blocks}


def build(cfg) -> TinyMixer:
    """``model.factory=examples.custom_model:build``: shapes from the job's [model] section."""
    m = cfg.model
    return TinyMixer(m.vocab_size, m.seq_len, m.d_model, m.num_blocks, m.dropout)
