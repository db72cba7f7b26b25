"""A layer's parameters as one flat float vector, with the module's parameters as views into it.

The flat vector's element order (parameters in module order) is the canonical order used for
chunks, snapshots and the ``params_sha256`` digest, whatever the layout. Only trainable parameters
are in it: a frozen one (a base weight under LoRA adapters) is held beside it, in the compute
dtype, and never summed, sharded, snapshotted or sent -- a layer with none trainable is empty.
"""
from __future__ import annotations

import hashlib
from typing import Collection

import torch
from torch import nn


class FlatLayer:
    def __init__(self, module: nn.Module, index: int, skip: Collection[int] = ()):
        """``index``: the unit's (model/units.py: a layer's, or an expert's); ``skip``: the ids of
        parameters of ``module`` that are other units' (its experts)."""
        self.module = module
        self.index = index
        self.label = f"layer {index}"
        """What errors call it (an expert's unit: its layer and expert)."""
        own = [(n, p) for n, p in module.named_parameters() if id(p) not in skip]
        named = [(n, p) for n, p in own if p.requires_grad]
        self.frozen = {n: p for n, p in own if not p.requires_grad}
        """Parameters that never change (see the module's docstring), by name."""
        self.params = [p for _, p in named]
        self.offsets: dict[str, int] = {}
        offset = 0
        for name, p in named:
            self.offsets[name] = offset
            offset += p.numel()
        self.numel = offset
        self.uses: list[tuple[torch.Tensor, int]] = []
        """Tied uses of this layer's tensors in other layers: (alias, offset in ``flat``). An alias
        shares the storage (so it always reads the current values) but has its own gradient, which
        the accumulator folds into this layer's sum as a gradient of its own."""
        # Weight decay only on matrices (embeddings, linear weights), as GPT training does: a rule
        # per tensor, kept as (offset, numel) spans rather than a byte per value.
        self.decay_spans = [(offset, p.numel()) for p, offset in zip(self.params, self.offsets.values())
                            if p.dim() >= 2]
        self._sink: list[torch.Tensor] | None = None
        """``[the float32 sum]`` once gradients go straight into it (:meth:`sum_gradients_into`)."""
        device = next(module.parameters()).device
        self._place(torch.cat([p.detach().reshape(-1) for p in self.params]) if self.params
                    else torch.zeros(0, device=device))

    def _place(self, flat: torch.Tensor) -> None:
        """Make ``flat`` the storage of every parameter and tied use, with a zeroed flat gradient
        of its dtype (autograd accumulates into the gradient views in place) -- or none, when the
        gradients go straight into a sum (:meth:`sum_gradients_into`)."""
        self.flat = flat
        self.grad = None if self._sink is not None else torch.zeros_like(flat)
        for p, offset in zip(self.params, self.offsets.values()):
            p.data = flat[offset:offset + p.numel()].view_as(p)
            p.grad = None if self.grad is None else self.grad[offset:offset + p.numel()].view_as(p)
        for alias, offset in self.uses:
            alias.data = flat[offset:offset + alias.numel()].view_as(alias)
            alias.grad = None if self.grad is None else torch.zeros_like(alias)

    def sum_gradients_into(self, into: torch.Tensor) -> None:
        """From now on each parameter's (and tied use's) gradient is added into its place in
        ``into`` (the layer's float32 sum) as soon as autograd has written it, and freed: no flat
        gradient of the compute dtype is kept, only one tensor's for a moment (Megatron's
        ``main_grad``). Called again, it only changes the target (a new epoch's sums)."""
        if self._sink is None:
            # The hooks hold only the sum's holder, never the layer: a hook on a parameter that
            # reached back to its layer would be a cycle the garbage collector cannot see, and a
            # layer dropped by a re-partition would stay in memory for good.
            self._sink = [into]
            for p, offset in [*zip(self.params, self.offsets.values()), *self.uses]:
                p.register_post_accumulate_grad_hook(_adder(self._sink, offset))
        self._sink[0] = into
        self._place(self.flat)

    def decay_of(self, start: int, end: int) -> torch.Tensor:
        """Which values of ``flat[start:end]`` decay (bool), from the rule per tensor."""
        mask = torch.zeros(end - start, dtype=torch.bool, device=self.flat.device)
        for offset, numel in self.decay_spans:
            lo, hi = max(start, offset), min(end, offset + numel)
            if lo < hi:
                mask[lo - start:hi - start] = True
        return mask

    def cast(self, dtype: torch.dtype) -> None:
        """Hold and compute in ``dtype`` (values rounded to it; gradients zeroed)."""
        if self.flat.dtype != dtype:
            self._place(self.flat.detach().to(dtype))
        for p in self.frozen.values():
            p.data = p.data.to(dtype)

    def tie(self, name: str) -> torch.Tensor:
        """A new use of parameter ``name`` elsewhere: a leaf aliasing it, with its own gradient."""
        p = dict(self.module.named_parameters())[name]
        alias = p.detach().requires_grad_(True)
        if self._sink is None:
            alias.grad = torch.zeros_like(alias)
        else:
            alias.register_post_accumulate_grad_hook(_adder(self._sink, self.offsets[name]))
        self.uses.append((alias, self.offsets[name]))
        return alias

    def digest(self) -> bytes:
        flat = self.flat.detach().cpu().contiguous()
        if flat.dtype == torch.bfloat16:  # numpy has no bfloat16; the bytes are the same
            flat = flat.view(torch.int16)
        return hashlib.sha256(flat.numpy().tobytes()).digest()


def _adder(sink: list[torch.Tensor], offset: int):
    """A post-accumulate-grad hook: the gradient autograd just wrote, added into ``sink[0]`` at
    ``offset``, then freed."""
    def add(t: torch.Tensor) -> None:
        sink[0][offset:offset + t.numel()].add_(t.grad.reshape(-1))
        t.grad = None
    return add


def params_sha256(layer_digests: list[bytes]) -> str:
    """Digest of all parameters in canonical layer order: sha256 over the per-layer digests."""
    return hashlib.sha256(b"".join(layer_digests)).hexdigest()
