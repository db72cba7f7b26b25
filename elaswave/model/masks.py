"""The causal mask: built only where a kernel needs one, once per length and device for the process.

Each attention layer used to register its own ``seq_len x seq_len`` mask as a buffer -- 256 MiB per
block at 16k tokens, held even by the fused kernel, which takes ``is_causal`` and reads no mask. The
written-out attention (deterministic mode, dropout) and the block-causal one (document masking) take
it from here instead; every layer of a stage shares the one tensor.
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def causal_mask(t: int, device: torch.device) -> torch.Tensor:
    """``[t, t]`` bool, True above the diagonal: the later positions a query may not see. Shared:
    never write to it."""
    return torch.ones(t, t, dtype=torch.bool, device=device).triu_(diagonal=1)
