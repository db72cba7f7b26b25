"""A pipeline stage: a contiguous range of model layers, each with its flat parameter vector -- or,
under interleaved 1F1B, one such range per model chunk the rank holds (its virtual stages).

A stage also holds the owner layer of every tie whose user it runs (not run, only to keep the
tied tensor): the user's own copy is replaced by an alias of the owner's, whose gradient is
folded into the owner's sum as a use of its own (see :class:`elaswave.zero.flat.FlatLayer`).
"""
from __future__ import annotations

import time
from typing import Callable, Collection, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from elaswave import rng
from elaswave.config import JobConfig
from elaswave.model import recompute
from elaswave.model.contract import Model, ModelContractError, untie
from elaswave.model.registry import model_for
from elaswave.model.units import drop_experts, flat_units, units_of
from elaswave.precision import compute_dtype
from elaswave.zero.flat import FlatLayer


class Stage:
    """``layers``: the (start, end) range of each model chunk, chunk 0 first, or one range."""

    def __init__(self, cfg: JobConfig, layers: tuple[int, int] | Sequence[tuple[int, int]], device: torch.device,
                 model: Model | None = None, recomputed: Sequence[int] = (), experts: Collection[int] | None = None):
        """``experts``: the expert units held (Plan.experts_held; None: every one of its layers')."""
        self.model = model if model is not None else model_for(cfg)
        self.chunks: tuple[tuple[int, int], ...] = (
            (tuple(layers),) if isinstance(layers[0], int) else tuple(tuple(r) for r in layers))
        ran = [i for start, end in self.chunks for i in range(start, end)]
        self.seed = cfg.train.seed
        self.is_first = self.chunk_is_first(0)
        """Some chunk of this stage reads the tokens (the first layer)."""
        self.is_last = any(self.chunk_is_last(c) for c in range(len(self.chunks)))
        """Some chunk of this stage computes the loss (the last layer)."""
        ties = [t for t in self.model.ties if t.user in ran]
        held = sorted(set(ran) | {t.owner for t in ties})
        frozen_dtype = compute_dtype(cfg.train.precision, device)
        self.units = units_of(self.model, self.seed)
        self.experts = None if experts is None else frozenset(experts)
        modules = {}
        for i in held:  # a frozen weight (LoRA's base) in the compute dtype at once, before the next layer is built
            modules[i] = self.model.build_layer(i, self.seed)
            drop_experts(modules[i], i, self.units, self.experts)  # (before it reaches the device)
            modules[i] = modules[i].to(device)
            recompute.select(modules[i], cfg.train.activation_checkpointing == "selective")
            for p in modules[i].parameters():
                if not p.requires_grad:
                    p.data = p.data.to(frozen_dtype)
        # The user's own copy goes before flattening: the tensor is the owner's.
        slots = [slot for i in ran for slot in untie(self.model, modules[i], i)]
        of_layer = {i: flat_units(modules[i], i, self.units, self.experts) for i in held}
        self.layers = sorted((u for i in held for u in of_layer[i]), key=lambda u: u.index)
        """Every unit this stage holds (model/units.py: its layers and tie owners, each without its
        experts, then the experts), in unit order: what is summed, sharded and snapshotted."""
        self.followers = {i: of_layer[i][1:] for i in held if len(of_layer[i]) > 1}
        """Layer -> the units of its experts (their gradients come within its backward)."""
        by_index = {layer.index: layer for layer in self.layers}
        for t, parent, name, shape in slots:
            owner = by_index[t.owner]
            if t.owner_param in owner.frozen:  # a frozen tensor (LoRA's base): the owner's own, no gradient;
                # not registered as the user's parameter (the owner's casts reach it all the same)
                parent.__dict__[name] = owner.frozen[t.owner_param]
                continue
            if t.owner_param not in owner.offsets:
                raise ModelContractError(f"tie {t}: layer {t.owner} has no parameter {t.owner_param!r}")
            alias = owner.tie(t.owner_param)
            if alias.shape != shape:
                raise ModelContractError(f"tie {t}: shapes {list(alias.shape)} and {list(shape)} differ")
            setattr(parent, name, alias)
        self._by_chunk = [[by_index[i] for i in range(start, end)] for start, end in self.chunks]
        self.running = [layer for chunk in self._by_chunk for layer in chunk]
        """The layers this stage runs, every chunk's, in layer order."""
        self._configured = {i for i in ran if cfg.train.checkpointed(i, self.model.num_layers)}
        self.recomputed: set[int] = set()
        """Layers whose activations are not kept: their forward runs again in the backward."""
        self.reads: Callable[[int], None] | None = None
        """Called with a layer's index before each forward runs it (the parameter all-gathers it
        waits for: zero/reduce.Gathering); ``waited_s`` sums the time it took, and a mixture of
        experts' exchanges theirs (expert/exchange.py), which is not compute."""
        self.waited_s = 0.0
        self.recompute(recomputed)
        self.device = device

    def recompute(self, planned: Sequence[int]) -> None:
        """Recompute the configured layers and, of ``planned`` (the plan's ``recomputed``: chosen to
        fit memory, train.activation_checkpointing=auto), the ones this stage runs."""
        ran = {layer.index for layer in self.running}
        self.recomputed = self._configured | (set(planned) & ran)

    @property
    def dtype(self) -> torch.dtype:
        """What the layers hold and compute in (train.precision; set by casting the layers)."""
        return self.layers[0].flat.dtype

    def chunk_is_first(self, chunk: int) -> bool:
        return self.chunks[chunk][0] == 0

    def chunk_is_last(self, chunk: int) -> bool:
        return self.chunks[chunk][1] == self.model.num_layers

    def forward(self, x: torch.Tensor, step: int, micro_batch: int, train: bool = True,
                documents: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
        """Chunk ``chunk``'s layers on ``x``. Dropout in layer ``i`` draws from the stream (seed,
        DROPOUT, step, micro_batch, i), whichever rank and chunk run it; ``documents``
        (data.document_masking): the document of each token, for every layer."""
        if documents is not None:
            documents = documents.to(self.device)
        for layer in self._by_chunk[chunk]:
            if self.reads is not None:
                waiting = time.perf_counter()
                self.reads(layer.index)
                self.waited_s += time.perf_counter() - waiting
            if train and layer.index in self.recomputed and torch.is_grad_enabled():
                # The recomputation makes its generator anew from the same key: the same masks.
                x = checkpoint(recompute.checkpointed(self._run), layer, x, step, micro_batch, train, documents,
                               use_reentrant=False, preserve_rng_state=False)
            else:
                x = self._run(layer, x, step, micro_batch, train, documents)
        return x

    def _run(self, layer: FlatLayer, x: torch.Tensor, step: int, micro_batch: int, train: bool,
             documents: torch.Tensor | None = None) -> torch.Tensor:
        gen = rng.generator(self.seed, rng.DROPOUT, step, micro_batch, layer.index,
                            device=self.device) if train else None
        return layer.module(x, gen) if documents is None else layer.module(x, gen, documents)
