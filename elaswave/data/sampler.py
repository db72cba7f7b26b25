"""Micro-batch id -> the exact token windows it holds, whatever rank runs it.

Micro-batch ``(step, m)`` holds ``micro_batch_size`` windows of ``seq_len + 1`` tokens whose start
offsets are drawn from the stream keyed by (seed, DATA, step, m). The global batch of a step is the
micro-batches ``0..M-1``; which pipeline runs which is the plan's business, never the data's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from elaswave import rng


@dataclass(frozen=True)
class MicroBatch:
    step: int
    index: int
    inputs: torch.Tensor  # (micro_batch_size, seq_len) int64
    targets: torch.Tensor  # (micro_batch_size, seq_len) int64


class Sampler:
    def __init__(self, tokens: torch.Tensor, seed: int, micro_batch_size: int, seq_len: int):
        self.tokens = tokens
        self.seed = seed
        self.micro_batch_size = micro_batch_size
        self.seq_len = seq_len
        self.num_starts = tokens.numel() - seq_len  # each window needs seq_len + 1 tokens

    def micro_batch(self, step: int, index: int) -> MicroBatch:
        gen = rng.generator(self.seed, rng.DATA, step, index)
        starts = torch.randint(self.num_starts, (self.micro_batch_size,), generator=gen)
        offsets = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        windows = self.tokens[offsets]
        return MicroBatch(step, index, windows[:, :-1].contiguous(), windows[:, 1:].contiguous())
