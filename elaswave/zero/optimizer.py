"""ZeRO-1 AdamW over owned chunks, with the learning-rate schedule and global-norm clipping.

The same functions run in the single-process reference (one holder owns every chunk) and in the
workers (each holder owns chunk c with c mod n == its slot), on the same chunk-padded layout: the
element-wise update gives the same bits in both.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from elaswave.config import TrainConfig
from elaswave.plan.chunks import ChunkIndex
from elaswave.zero.bucket import Bucket
from elaswave.zero.flat import FlatLayer


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr`` at the last step (step counts from 0)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def clip_coef(chunk_sumsq: Sequence[float], max_norm: float) -> tuple[float, float]:
    """(global norm, factor); the norm sums per-chunk squares in chunk order, exactly (fsum)."""
    norm = math.sqrt(math.fsum(chunk_sumsq))
    if max_norm <= 0 or not math.isfinite(norm):
        return norm, 1.0
    return norm, min(1.0, max_norm / (norm + 1e-6))


class ShardedAdamW:
    """Owns, per bucket, this rank's slot: parameter shard, gradient shard, exp_avg, exp_avg_sq."""

    def __init__(self, buckets: Sequence[Bucket], layers: Sequence[FlatLayer], cfg: TrainConfig):
        self.cfg = cfg
        self.buckets = list(buckets)
        by_index = {l.index: l for l in layers}
        self.params, self.exp_avg, self.exp_avg_sq, self.decay = [], [], [], []
        for b in self.buckets:
            flats = [by_index[i].flat for i in b.layers]
            self.params.append(b.my_part(b.pack([f.detach() for f in flats])).clone())
            self.decay.append(b.my_part(b.pack([by_index[i].decay_mask for i in b.layers], fill=False)).float())
            self.exp_avg.append(torch.zeros_like(self.params[-1]))
            self.exp_avg_sq.append(torch.zeros_like(self.params[-1]))

    def chunk_sumsq(self, grads: Sequence[torch.Tensor], index: ChunkIndex, owned_only: bool) -> dict[int, float]:
        """Sum of squares per chunk, keyed by global chunk number: of every chunk in ``grads`` (whole
        buckets or slots), or only of the chunks this rank owns. Each is computed over the same
        chunk-padded slice whoever computes it, so the bits agree."""
        out = {}
        for b, g in zip(self.buckets, grads):
            whole = g.numel() > b.slot_numel
            for slot in (range(b.num_holders) if whole else [b.my_slot]):
                if owned_only and slot != b.my_slot:
                    continue
                base = slot * b.slot_numel if whole else 0
                for oc in b.owned_by(slot):
                    piece = g[base + oc.slot_offset:base + oc.slot_offset + b.chunk_numel].double()
                    out[index.offsets[oc.layer] + oc.chunk] = float(torch.dot(piece, piece))
        return out

    def step(self, grads: Sequence[torch.Tensor], step: int, lr: float, coef: float) -> None:
        c = self.cfg
        t = step + 1
        bc1, bc2 = 1.0 - c.beta1 ** t, 1.0 - c.beta2 ** t
        for p, g, m, v, decay in zip(self.params, grads, self.exp_avg, self.exp_avg_sq, self.decay):
            if coef != 1.0:
                g = g * coef
            p.addcmul_(p, decay, value=-lr * c.weight_decay)
            m.mul_(c.beta1).add_(g, alpha=1.0 - c.beta1)
            v.mul_(c.beta2).addcmul_(g, g, value=1.0 - c.beta2)
            denom = (v.sqrt() / math.sqrt(bc2)).add_(c.eps)
            p.addcdiv_(m, denom, value=-lr / bc1)

    def state_bytes(self) -> int:
        """Optimizer-state bytes this rank holds (exp_avg + exp_avg_sq, padding included)."""
        return sum(m.numel() * m.element_size() + v.numel() * v.element_size()
                   for m, v in zip(self.exp_avg, self.exp_avg_sq))
