"""Selective activation recomputation (Megatron's ``selective``): the attention core -- scores,
mask, softmax, dropout, the weighted sum of values -- keeps only its inputs (q, k, v) for the
backward and runs again there; the rest of the block keeps its activations as usual.

The core's ``[b, heads, t, t]`` tensors (scores, probabilities, dropout mask) are most of a block's
activations once ``t`` outgrows the width, and the cheapest part to run twice: no weight, a few
elementwise kernels and two batched products. ``train.activation_checkpointing=selective`` turns it
on; ``full`` and ``every_N`` recompute whole blocks.

The same bits either way: the backward runs the same forward kernels on the same inputs and then
autograd's own backward of them, so every gradient equals the one without recomputation. Dropout in
the core draws from the block's keyed generator: the first run draws from a copy of it and the
generator then moves on as if it had drawn itself; the recomputation draws from another copy at
the same state -- the same masks. (``torch.utils.checkpoint`` would keep q, k and v out of sight
of saved-tensor hooks, where the memory model measures a layer's activations; this Function saves
them where the hooks see them.)
"""
from __future__ import annotations

import threading
from typing import Callable

import torch
from torch import nn

_RUNNING = threading.local()

Core = Callable[..., torch.Tensor]
"""``core(q, k, v, *fixed, gen) -> y``: ``fixed`` are tensors without gradient (masks)."""


def _copy(gen: torch.Generator | None, state: torch.Tensor | None) -> torch.Generator | None:
    if gen is None:
        return None
    copy = torch.Generator(device=gen.device)
    copy.set_state(state)
    return copy


class _Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, core: Core, gen, fixed: tuple, q, k, v):
        ctx.core, ctx.fixed = core, fixed
        ctx.gen, ctx.state = gen, gen.get_state() if gen is not None else None
        ctx.save_for_backward(q, k, v)
        drawn = _copy(gen, ctx.state)
        with torch.no_grad():
            y = core(q, k, v, *fixed, gen=drawn)
        if gen is not None:
            gen.set_state(drawn.get_state())  # on, as if the block had drawn the masks itself
        return y

    @staticmethod
    def backward(ctx, dy):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            y = ctx.core(*inputs, *ctx.fixed, gen=_copy(ctx.gen, ctx.state))
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(y, wanted, dy) if wanted else ())
        return (None, None, None, *(next(grads) if t.requires_grad else None for t in inputs))


def attention_core(module: nn.Module, core: Core, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *fixed,
                   gen: torch.Generator | None = None) -> torch.Tensor:
    """``core(q, k, v, *fixed, gen=gen)``, recomputed in the backward when ``module`` (an attention)
    is selected (:func:`select`) and the forward keeps a graph."""
    if getattr(module, "recompute_core", False) and torch.is_grad_enabled():
        return _Recomputed.apply(core, gen, fixed, q, k, v)
    return core(q, k, v, *fixed, gen=gen)


def select(layer: nn.Module, on: bool) -> None:
    """Every attention of ``layer`` recomputes its core (``on``) or keeps it."""
    for module in layer.modules():
        if hasattr(module, "recompute_core"):
            module.recompute_core = on


def checkpointed(fn: Callable) -> Callable:
    """``fn`` as ``torch.utils.checkpoint`` is to run it (pipeline/stage.py): marked while it runs,
    its first forward and its recomputation alike (whichever thread autograd runs that on), so code
    inside can tell (expert/exchange.py keeps only a mixture of experts' rows there)."""
    def run(*args, **kwargs):
        depth = getattr(_RUNNING, "depth", 0)
        _RUNNING.depth = depth + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _RUNNING.depth = depth
    return run


def in_checkpoint() -> bool:
    """Whether a :func:`checkpointed` function is running on this thread."""
    return getattr(_RUNNING, "depth", 0) > 0
