"""A layer's parameters as one flat float vector, with the module's parameters as views into it.

The flat vector's element order (parameters in module order) is the canonical order used for
chunks, snapshots and the ``params_sha256`` digest, whatever the layout.
"""
from __future__ import annotations

import hashlib

import torch
from torch import nn


class FlatLayer:
    def __init__(self, module: nn.Module, index: int):
        self.module = module
        self.index = index
        named = list(module.named_parameters())
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
        # Weight decay only on matrices (embeddings, linear weights), as GPT training does.
        self.decay_mask = torch.cat([
            torch.full((p.numel(),), p.dim() >= 2, dtype=torch.bool, device=p.device) for p in self.params])
        self._place(torch.cat([p.detach().reshape(-1) for p in self.params]))

    def _place(self, flat: torch.Tensor) -> None:
        """Make ``flat`` the storage of every parameter and tied use, with a zeroed flat gradient
        of its dtype: autograd accumulates into the gradient views in place."""
        self.flat = flat
        self.grad = torch.zeros_like(flat)
        for p, offset in zip(self.params, self.offsets.values()):
            p.data = flat[offset:offset + p.numel()].view_as(p)
            p.grad = self.grad[offset:offset + p.numel()].view_as(p)
        for alias, offset in self.uses:
            alias.data = flat[offset:offset + alias.numel()].view_as(alias)
            alias.grad = torch.zeros_like(alias)

    def cast(self, dtype: torch.dtype) -> None:
        """Hold and compute in ``dtype`` (values rounded to it; gradients zeroed)."""
        if self.flat.dtype != dtype:
            self._place(self.flat.detach().to(dtype))

    def tie(self, name: str) -> torch.Tensor:
        """A new use of parameter ``name`` elsewhere: a leaf aliasing it, with its own gradient."""
        p = dict(self.module.named_parameters())[name]
        alias = p.detach().requires_grad_(True)
        alias.grad = torch.zeros_like(alias)
        self.uses.append((alias, self.offsets[name]))
        return alias

    def digest(self) -> bytes:
        flat = self.flat.detach().cpu().contiguous()
        if flat.dtype == torch.bfloat16:  # numpy has no bfloat16; the bytes are the same
            flat = flat.view(torch.int16)
        return hashlib.sha256(flat.numpy().tobytes()).digest()


def params_sha256(layer_digests: list[bytes]) -> str:
    """Digest of all parameters in canonical layer order: sha256 over the per-layer digests."""
    return hashlib.sha256(b"".join(layer_digests)).hexdigest()
