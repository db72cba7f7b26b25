"""Keyed random streams: every draw is a function of (seed, purpose, step, micro-batch, layer).

Nothing here knows about ranks, so where a micro-batch runs can never change the numbers it sees.
"""
from __future__ import annotations

import torch

# What a stream is for; part of the key so data order and dropout never share a stream.
DATA = 1
DROPOUT = 2
INIT = 3
EVAL = 5
"""The held-out windows' order (4 is the mixture's block order, elaswave.data.mixture.MIX)."""
LORA = 6
"""Adapters' initial values (model.lora), apart from the base weights' INIT stream."""

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_seed(*keys: int) -> int:
    """A 63-bit seed that depends on every key and their order (non-negative keys only)."""
    h = 0
    for k in keys:
        if k < 0:
            raise ValueError(f"rng key {k} in {keys} must be >= 0")
        h = _splitmix64(h ^ _splitmix64(k))
    return h & ((1 << 63) - 1)


def generator(*keys: int, device: torch.device | str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(stream_seed(*keys))
    return gen


def keyed_dropout(x: torch.Tensor, p: float, gen: torch.Generator | None) -> torch.Tensor:
    """Dropout whose mask comes from ``gen`` (``None`` means evaluation: no dropout)."""
    if gen is None or p == 0.0:
        return x
    keep = torch.rand(x.shape, generator=gen, device=x.device) >= p
    return x * keep / (1.0 - p)
