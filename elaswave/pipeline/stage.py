"""A pipeline stage: a contiguous range of model layers, each with its flat parameter vector."""
from __future__ import annotations

import torch

from elaswave import rng
from elaswave.config import JobConfig
from elaswave.model.gpt import build_layer
from elaswave.zero.flat import FlatLayer


class Stage:
    def __init__(self, cfg: JobConfig, layer_range: tuple[int, int], device: torch.device):
        self.start, self.end = layer_range
        self.seed = cfg.train.seed
        self.is_first = self.start == 0
        self.is_last = self.end == cfg.model.num_layers
        self.layers = [FlatLayer(build_layer(cfg.model, i, self.seed).to(device), i)
                       for i in range(self.start, self.end)]
        self.device = device

    def forward(self, x: torch.Tensor, step: int, micro_batch: int, train: bool = True) -> torch.Tensor:
        """Dropout in layer ``i`` draws from the stream (seed, DROPOUT, step, micro_batch, i)."""
        for layer in self.layers:
            gen = rng.generator(self.seed, rng.DROPOUT, step, micro_batch, layer.index,
                                device=self.device) if train else None
            x = layer.module(x, gen)
        return x
