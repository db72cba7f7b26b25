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

A corpus with a loss mask (conversations, ``prepare --format chat``) marks the targets that are not
trained with ``IGNORE`` (-100, what ``torch.nn.functional.cross_entropy`` and transformers' labels
skip). The loss of a step is then the mean over the loss tokens of the whole global batch:
:meth:`Sampler.loss_tokens` counts them from the step's micro-batch ids alone, so every pipeline
scales its gradients by the same count, whichever micro-batches it runs.

With ``data.mix``, sample ``g`` first goes to a source (:mod:`elaswave.data.mixture`) as that
source's ``k``-th sample, and ``k`` takes the place of ``g`` above: every source has its own epochs.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from elaswave import rng
from elaswave.data.mixture import Mixture, mixture_of
from elaswave.data.permutation import Permutation
from elaswave.errors import ConfigError


IGNORE = -100
"""A target that is not trained (the loss mask's 0)."""


@dataclass(frozen=True)
class MicroBatch:
    step: int
    index: int
    inputs: torch.Tensor  # (micro_batch_size, seq_len) int64
    targets: torch.Tensor  # (micro_batch_size, seq_len) int64; IGNORE where not trained
    documents: torch.Tensor | None = None
    """(micro_batch_size, seq_len) int64: the document of each input token (equal ids, same
    document), with data.document_masking; attention never crosses from one to another."""

    @property
    def loss_tokens(self) -> int:
        return int((self.targets != IGNORE).sum())


@dataclass(frozen=True)
class Draw:
    """Where each sample of a micro-batch comes from: source, that source's epoch, window."""
    sources: np.ndarray
    epochs: np.ndarray
    windows: np.ndarray


class Sampler:
    def __init__(self, tokens, seed: int, micro_batch_size: int, seq_len: int, num_micro_batches: int,
                 mixture: Mixture | None = None, purpose: int = rng.DATA, documents: bool = False):
        """``tokens``: a token stream (``len``, ``read(start, length)``; see :mod:`elaswave.data.corpus`),
        or a list of them blended by ``mixture``; ``purpose``: the rng key of the window orders
        (rng.EVAL for the held-out windows)."""
        self.purpose = purpose
        self.with_documents = documents
        self.sources = list(tokens) if isinstance(tokens, (list, tuple)) else [tokens]
        self.seed = seed
        self.micro_batch_size = micro_batch_size
        self.seq_len = seq_len
        self.num_micro_batches = num_micro_batches
        self.mixture = mixture
        self.num_windows = [(len(t) - 1) // seq_len for t in self.sources]
        if min(self.num_windows) < 1:
            raise ValueError(f"a corpus of {min(map(len, self.sources))} tokens holds no window of seq_len + 1 = {seq_len + 1}")
        self._orders: dict[tuple[int, int], Permutation] = {}
        self._loss_tokens: dict[tuple[int, int], int] = {}
        self.on_read: Callable[[int, int, np.ndarray], None] | None = None
        """Called with (step, index, window ids) each time a micro-batch is read (a data trace)."""

    def _order(self, source: int, epoch: int) -> Permutation:
        if (source, epoch) not in self._orders:
            if len(self._orders) > 4 * len(self.sources):  # a run moves forward through epochs; keep a few
                self._orders.pop(min(self._orders, key=lambda k: k[1]))
            self._orders[source, epoch] = Permutation(self.num_windows[source], self.seed, self.purpose, source, epoch)
        return self._orders[source, epoch]

    def samples(self, step: int, index: int, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The global sample numbers micro-batch ``(step, index)`` holds; ``rows``: (first, count)
        sequences of the step's global batch instead (a reshaped micro-batch, or one unit of it)."""
        first, count = rows if rows is not None else (index * self.micro_batch_size, self.micro_batch_size)
        first += step * self.num_micro_batches * self.micro_batch_size
        return np.arange(first, first + count, dtype=np.int64)

    def draw(self, step: int, index: int, rows: tuple[int, int] | None = None) -> Draw:
        samples = self.samples(step, index, rows)
        if self.mixture is None:
            sources, ordinals = np.zeros_like(samples), samples
        else:
            sources, ordinals = self.mixture.assign(samples)
        counts = np.asarray(self.num_windows, dtype=np.int64)[sources]
        epochs, positions = ordinals // counts, ordinals % counts
        windows = np.empty_like(samples)
        for key in sorted(set(zip(sources.tolist(), epochs.tolist()))):
            here = (sources == key[0]) & (epochs == key[1])
            windows[here] = self._order(*key)(positions[here])
        return Draw(sources, epochs, windows)

    def micro_batch(self, step: int, index: int, rows: tuple[int, int] | None = None) -> MicroBatch:
        """``rows``: see :meth:`samples` (``index`` then names the piece in the data trace)."""
        d = self.draw(step, index, rows)
        if self.on_read is not None:
            self.on_read(step, index, d.windows if self.mixture is None else np.stack([d.sources, d.windows], 1))
        rows = np.stack([self.sources[s].read(int(w) * self.seq_len, self.seq_len + 1)
                         for s, w in zip(d.sources.tolist(), d.windows.tolist())])
        rows = torch.from_numpy(rows.astype(np.int64, copy=False))
        targets = rows[:, 1:].clone()  # its own memory: masking it must not touch the inputs
        trained = self._trained(d)
        if trained is not None:
            targets[~torch.from_numpy(trained)] = IGNORE
        documents = None
        if self.with_documents:
            documents = torch.from_numpy(np.stack([self.sources[s].documents(int(w) * self.seq_len, self.seq_len) + (s << 48)
                                                   for s, w in zip(d.sources.tolist(), d.windows.tolist())]))
        return MicroBatch(step, index, rows[:, :-1].contiguous(), targets, documents)

    @property
    def masked(self) -> bool:
        """Whether any source has a loss mask."""
        return any(getattr(src, "masked", False) for src in self.sources)

    def _trained(self, d: Draw) -> np.ndarray | None:
        """(micro_batch_size, seq_len) bool: which targets are trained; None when all are."""
        if not self.masked:
            return None
        out = np.ones((len(d.windows), self.seq_len), dtype=np.bool_)
        for row, (s, w) in enumerate(zip(d.sources.tolist(), d.windows.tolist())):
            read = getattr(self.sources[s], "read_mask", None)
            mask = read(int(w) * self.seq_len + 1, self.seq_len) if read is not None else None
            if mask is not None:
                out[row] = mask
        return out

    def loss_tokens(self, step: int, num_micro_batches: int | None = None) -> int:
        """The targets trained in step ``step``'s global batch (micro-batches 0..M-1, M the plan's),
        read from the masks alone; ``M x b x seq_len`` when nothing is masked."""
        M = num_micro_batches or self.num_micro_batches
        full = self.micro_batch_size * self.seq_len
        if not self.masked:  # nothing to read: the step's every target is trained
            return M * full
        if (step, M) not in self._loss_tokens:
            count = 0
            for m in range(M):
                trained = self._trained(self.draw(step, m))
                count += full if trained is None else int(trained.sum())
            if len(self._loss_tokens) > 8:
                self._loss_tokens.pop(min(self._loss_tokens))
            self._loss_tokens[step, M] = count
        return self._loss_tokens[step, M]


def _corpora(cfg) -> list:
    """One data config per source: each of ``data.mix``, or ``cfg.data`` itself."""
    return [replace(cfg.data, path=p, source="tokens", mix=()) for p, _ in cfg.data.mixture] or [cfg.data]


def open_sampler(cfg, model) -> Sampler:
    """The job's sampler: its corpus (``cfg.data``) read for ``model`` (a contract or ModelConfig)."""
    from elaswave.data.corpus import open_tokens

    t = cfg.train
    tokens = [open_tokens(c, model.vocab_size, model.seq_len + 1, init_from=cfg.model.init_from) for c in _corpora(cfg)]
    return Sampler(tokens, t.seed, t.micro_batch_size, model.seq_len, t.num_micro_batches, mixture_of(cfg),
                   documents=cfg.masks_documents)


def open_eval_sampler(cfg, model) -> Sampler:
    """The held-out windows every evaluation reads: micro-batch (j, m) of eval batch j, drawn from
    each source's eval split (``elaswave prepare --eval-fraction``) as training draws from its
    train split, blended by the same weights, in a keyed order of its own. An evaluation reads
    batches 0..train.eval_batches-1, the same windows each time, none twice (they must fit in one
    eval epoch)."""
    from elaswave.data.corpus import open_tokens

    t = cfg.train
    corpora = _corpora(cfg)
    tokens = [open_tokens(c, model.vocab_size, model.seq_len + 1, split="eval", init_from=cfg.model.init_from)
              for c in corpora]
    sampler = Sampler(tokens, t.seed, t.micro_batch_size, model.seq_len, t.num_micro_batches, mixture_of(cfg),
                      purpose=rng.EVAL, documents=cfg.masks_documents)
    draws = [sampler.draw(j, m) for j in range(t.eval_batches) for m in range(t.num_micro_batches)]
    over = sorted({int(s) for d in draws for s in d.sources[d.epochs > 0]})
    if over:
        s = over[0]
        per_eval = t.eval_batches * t.num_micro_batches * t.micro_batch_size
        most = sampler.num_windows[s] // (t.num_micro_batches * t.micro_batch_size)
        raise ConfigError(f"train.eval_batches={t.eval_batches} is invalid: an evaluation reads {per_eval} windows "
                          f"of model.seq_len + 1 = {model.seq_len + 1} tokens"
                          + (" (blended by data.mix)" if cfg.data.mix else "")
                          + f", and the eval split of {corpora[s].path!r} holds {sampler.num_windows[s]}; "
                          + (f"use at most {most} (or " if most and not cfg.data.mix else
                             "fewer than one batch of num_micro_batches x micro_batch_size: use smaller batches (or ")
                          + "prepare with a larger --eval-fraction)")
    return sampler
