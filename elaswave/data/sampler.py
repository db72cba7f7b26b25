"""Micro-batch id -> the exact token windows it holds, whatever rank runs it.

The corpus is cut into ``N = (tokens - 1) // seq_len`` windows of ``seq_len + 1`` tokens (window
``w`` starts at token ``w * seq_len``; inputs and targets overlap by one token, as in nanoGPT and
Megatron). Samples are numbered in training order: micro-batch ``(step, m)`` holds samples
``(step * M + m) * b .. + b - 1``. Sample ``g`` is in data epoch ``g // N`` and reads window
``perm_e(g mod N)``, ``perm_e`` a keyed bijection of ``0..N-1`` for (seed, epoch)
(:mod:`elaswave.data.permutation`). So an epoch visits every window exactly once, and which windows
a micro-batch holds is a pure function of its id: no layout, kill, join, re-partition or resume
from disk can make a sample be seen twice or skipped. The global batch of a step is the
micro-batches ``0..M-1``; which pipeline runs which is the plan's business, never the data's.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from elaswave import rng
from elaswave.data.permutation import Permutation


@dataclass(frozen=True)
class MicroBatch:
    step: int
    index: int
    inputs: torch.Tensor  # (micro_batch_size, seq_len) int64
    targets: torch.Tensor  # (micro_batch_size, seq_len) int64


class Sampler:
    def __init__(self, tokens, seed: int, micro_batch_size: int, seq_len: int, num_micro_batches: int):
        """``tokens``: a token stream (``len``, ``read(start, length)``; see :mod:`elaswave.data.corpus`)."""
        self.tokens = tokens
        self.seed = seed
        self.micro_batch_size = micro_batch_size
        self.seq_len = seq_len
        self.num_micro_batches = num_micro_batches
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"{len(tokens)} tokens hold no window of seq_len + 1 = {seq_len + 1}")
        self._orders: dict[int, Permutation] = {}
        self.on_read: Callable[[int, int, np.ndarray], None] | None = None
        """Called with (step, index, window ids) each time a micro-batch is read (a data trace)."""

    def _order(self, epoch: int) -> Permutation:
        if epoch not in self._orders:
            if len(self._orders) > 4:  # a run moves forward through epochs; keep a few
                self._orders.pop(min(self._orders))
            self._orders[epoch] = Permutation(self.num_windows, self.seed, rng.DATA, epoch)
        return self._orders[epoch]

    def samples(self, step: int, index: int) -> np.ndarray:
        """The global sample numbers micro-batch ``(step, index)`` holds."""
        first = (step * self.num_micro_batches + index) * self.micro_batch_size
        return np.arange(first, first + self.micro_batch_size, dtype=np.int64)

    def windows(self, step: int, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(data epoch, window id) of each sample of micro-batch ``(step, index)``."""
        samples = self.samples(step, index)
        epochs, positions = samples // self.num_windows, samples % self.num_windows
        windows = np.empty_like(samples)
        for e in np.unique(epochs):
            here = epochs == e
            windows[here] = self._order(int(e))(positions[here])
        return epochs, windows

    def micro_batch(self, step: int, index: int) -> MicroBatch:
        _, windows = self.windows(step, index)
        if self.on_read is not None:
            self.on_read(step, index, windows)
        rows = np.stack([self.tokens.read(int(w) * self.seq_len, self.seq_len + 1) for w in windows])
        rows = torch.from_numpy(rows.astype(np.int64, copy=False))
        return MicroBatch(step, index, rows[:, :-1].contiguous(), rows[:, 1:].contiguous())


def open_sampler(cfg, model) -> Sampler:
    """The job's sampler: its corpus (``cfg.data``) read for ``model`` (a contract or ModelConfig)."""
    from elaswave.data.corpus import open_tokens

    t = cfg.train
    tokens = open_tokens(cfg.data, model.vocab_size, model.seq_len + 1)
    return Sampler(tokens, t.seed, t.micro_batch_size, model.seq_len, t.num_micro_batches)
