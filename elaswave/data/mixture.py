"""Which source each sample comes from when ``data.mix`` blends prepared corpora by weight.

Each source must keep its own exactly-once epochs, so sample ``g`` must know not only its source
but how many samples of that source came before it -- in O(1), like everything else about a
sample. Samples are dealt in blocks of ``BLOCK``: every block holds each source's share, rounded by
largest remainder (so proportions are exact to 1/BLOCK in every block, not only on average), in an
order shuffled by a keyed permutation of the block. The ``k``-th sample of source ``s`` is then
``block * count[s] + its rank among the block's slots of s``.
"""
from __future__ import annotations

import numpy as np

from elaswave.data.permutation import Permutation

BLOCK = 1000
MIX = 4
"""The rng purpose of the mixture's block orders (beside rng.DATA, DROPOUT, INIT)."""


def block_counts(weights: list[float], block: int = BLOCK) -> np.ndarray:
    """Each source's slots in a block: ``weight / total * block``, rounded by largest remainder."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * block
    counts = np.floor(exact).astype(np.int64)
    short = block - int(counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return counts


class Mixture:
    def __init__(self, weights: list[float], seed: int):
        self.counts = block_counts(weights)
        self.seed = seed
        self._layouts: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _layout(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each slot, its rank among the block's slots of that source)."""
        if block not in self._layouts:
            if len(self._layouts) > 8:
                self._layouts.pop(min(self._layouts))
            dealt = np.repeat(np.arange(len(self.counts)), self.counts)
            source = dealt[Permutation(BLOCK, self.seed, MIX, block)(np.arange(BLOCK))]
            rank = np.empty(BLOCK, dtype=np.int64)
            for s in range(len(self.counts)):
                here = source == s
                rank[here] = np.arange(int(here.sum()))
            self._layouts[block] = (source, rank)
        return self._layouts[block]

    def assign(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, ordinal within that source) of each global sample number."""
        sources, ordinals = np.empty_like(samples), np.empty_like(samples)
        blocks, slots = samples // BLOCK, samples % BLOCK
        for b in np.unique(blocks):
            here = blocks == b
            source, rank = self._layout(int(b))
            sources[here] = source[slots[here]]
            ordinals[here] = int(b) * self.counts[sources[here]] + rank[slots[here]]
        return sources, ordinals


def mixture_of(cfg) -> Mixture | None:
    """The job's mixture (``data.mix``), or None for a single source."""
    return Mixture([w for _, w in cfg.data.mixture], cfg.train.seed) if cfg.data.mix else None


def tokens_per_source(cfg, mixture: Mixture, step: int, seq_len: int) -> dict[str, int]:
    """Tokens each source of ``data.mix`` gives step ``step`` (a pure function of the config)."""
    t = cfg.train
    per_step = t.num_micro_batches * t.micro_batch_size
    sources, _ = mixture.assign(np.arange(step * per_step, (step + 1) * per_step, dtype=np.int64))
    counts = np.bincount(sources, minlength=len(mixture.counts))
    return {path: int(n) * seq_len for (path, _), n in zip(cfg.data.mixture, counts)}
