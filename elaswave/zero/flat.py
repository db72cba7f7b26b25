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
        self.flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        # Gradients live in one flat buffer too: autograd accumulates into the views in place.
        self.grad = torch.zeros_like(self.flat)
        self.offsets: dict[str, int] = {}
        offset = 0
        for name, p in named:
            n = p.numel()
            p.data = self.flat[offset:offset + n].view_as(p)
            p.grad = self.grad[offset:offset + n].view_as(p)
            self.offsets[name] = offset
            offset += n
        self.numel = offset
        self.uses: list[tuple[torch.Tensor, int]] = []
        """Tied uses of this layer's tensors in other layers: (alias, offset in ``flat``). An alias
        shares the storage (so it always reads the current values) but has its own gradient, which
        the accumulator folds into this layer's sum as a gradient of its own."""
        # Weight decay only on matrices (embeddings, linear weights), as GPT training does.
        self.decay_mask = torch.cat([
            torch.full((p.numel(),), p.dim() >= 2, dtype=torch.bool, device=self.flat.device) for p in self.params])

    def tie(self, name: str) -> torch.Tensor:
        """A new use of parameter ``name`` elsewhere: a leaf aliasing it, with its own gradient."""
        p = dict(self.module.named_parameters())[name]
        alias = p.detach().requires_grad_(True)
        alias.grad = torch.zeros_like(alias)
        self.uses.append((alias, self.offsets[name]))
        return alias

    def digest(self) -> bytes:
        return hashlib.sha256(self.flat.detach().cpu().contiguous().numpy().tobytes()).digest()


def params_sha256(layer_digests: list[bytes]) -> str:
    """Digest of all parameters in canonical layer order: sha256 over the per-layer digests."""
    return hashlib.sha256(b"".join(layer_digests)).hexdigest()
