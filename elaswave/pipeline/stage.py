"""A pipeline stage: a contiguous range of model layers, each with its flat parameter vector.

A stage also holds the owner layer of every tie whose user it runs (not run, only to keep the
tied tensor): the user's own copy is replaced by an alias of the owner's, whose gradient is
folded into the owner's sum as a use of its own (see :class:`elaswave.zero.flat.FlatLayer`).
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from elaswave import rng
from elaswave.config import JobConfig
from elaswave.model.contract import Model, ModelContractError, untie
from elaswave.model.registry import model_for
from elaswave.zero.flat import FlatLayer


class Stage:
    def __init__(self, cfg: JobConfig, layer_range: tuple[int, int], device: torch.device, model: Model | None = None):
        self.model = model if model is not None else model_for(cfg)
        self.start, self.end = layer_range
        self.seed = cfg.train.seed
        self.is_first = self.start == 0
        self.is_last = self.end == self.model.num_layers
        ties = [t for t in self.model.ties if self.start <= t.user < self.end]
        held = sorted(set(range(self.start, self.end)) | {t.owner for t in ties})
        modules = {i: self.model.build_layer(i, self.seed).to(device) for i in held}
        # The user's own copy goes before flattening: the tensor is the owner's.
        slots = [slot for i in range(self.start, self.end) for slot in untie(self.model, modules[i], i)]
        self.layers = [FlatLayer(modules[i], i) for i in held]
        """Every layer this stage holds (its range and tie owners), in layer order."""
        by_index = {layer.index: layer for layer in self.layers}
        for t, parent, name, shape in slots:
            owner = by_index[t.owner]
            if t.owner_param not in owner.offsets:
                raise ModelContractError(f"tie {t}: layer {t.owner} has no parameter {t.owner_param!r}")
            alias = owner.tie(t.owner_param)
            if alias.shape != shape:
                raise ModelContractError(f"tie {t}: shapes {list(alias.shape)} and {list(shape)} differ")
            setattr(parent, name, alias)
        self.running = [by_index[i] for i in range(self.start, self.end)]
        self.recomputed = {i for i in range(self.start, self.end) if cfg.train.checkpointed(i, self.model.num_layers)}
        """Layers whose activations are not kept: their forward runs again in the backward."""
        self.device = device

    @property
    def dtype(self) -> torch.dtype:
        """What the layers hold and compute in (train.precision; set by casting the layers)."""
        return self.layers[0].flat.dtype

    def forward(self, x: torch.Tensor, step: int, micro_batch: int, train: bool = True,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """Dropout in layer ``i`` draws from the stream (seed, DROPOUT, step, micro_batch, i);
        ``documents`` (data.document_masking): the document of each token, for every layer."""
        if documents is not None:
            documents = documents.to(self.device)
        for layer in self.running:
            if train and layer.index in self.recomputed and torch.is_grad_enabled():
                # The recomputation makes its generator anew from the same key: the same masks.
                x = checkpoint(self._run, layer, x, step, micro_batch, train, documents, use_reentrant=False,
                               preserve_rng_state=False)
            else:
                x = self._run(layer, x, step, micro_batch, train, documents)
        return x

    def _run(self, layer: FlatLayer, x: torch.Tensor, step: int, micro_batch: int, train: bool,
             documents: torch.Tensor | None = None) -> torch.Tensor:
        gen = rng.generator(self.seed, rng.DROPOUT, step, micro_batch, layer.index,
                            device=self.device) if train else None
        return layer.module(x, gen) if documents is None else layer.module(x, gen, documents)
