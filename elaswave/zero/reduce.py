"""Gradient accumulation per micro-batch and its reduction to chunk owners.

Gradients are summed in float32 (or fixed point) whatever the layers compute in. Deterministic mode turns each micro-batch's gradient into fixed point, ``round(g * 2**bits)`` in
int64, before anything is added. Integer addition is associative, so the sum over the M
micro-batches has the same bits whichever pipeline ran which micro-batch and in whatever order the
reduce-scatter adds them. Fast mode adds float32 gradients as they come.
"""
from __future__ import annotations

from typing import Sequence

import torch

from elaswave.comm.groups import Group
from elaswave.zero.bucket import Bucket
from elaswave.zero.flat import FlatLayer


class GradientOverflowError(RuntimeError):
    pass


class GradAccumulator:
    def __init__(self, layers: Sequence[FlatLayer], deterministic: bool, fixed_point_bits: int,
                 num_micro_batches: int):
        self.layers = list(layers)
        self.deterministic = deterministic
        self.bits = fixed_point_bits
        self.scale = float(2 ** fixed_point_bits)
        # The sum of M values each below this bound stays inside int64, also with two uses of a
        # tied tensor per micro-batch.
        self.max_abs = float(2 ** (62 - fixed_point_bits)) / (2 * num_micro_batches)
        # Fast mode lets autograd add each micro-batch into a float32 layer's flat gradient buffer;
        # a bfloat16 layer's gradients go into a float32 sum as autograd writes them, one tensor at
        # a time, so no bfloat16 flat gradient is kept (FlatLayer.sum_gradients_into).
        self.sums = {l.index: torch.zeros(l.numel, dtype=torch.int64, device=l.flat.device) if deterministic
                     else l.grad if l.grad is not None and l.grad.dtype == torch.float32
                     else torch.zeros(l.numel, dtype=torch.float32, device=l.flat.device) for l in self.layers}
        for layer in self.layers:
            if self.sums[layer.index] is not layer.grad and not deterministic:
                layer.sum_gradients_into(self.sums[layer.index])

    def zero(self) -> None:
        for layer in self.layers:
            self.sums[layer.index].zero_()
            if layer.grad is not None:
                layer.grad.zero_()
                for alias, _ in layer.uses:
                    alias.grad.zero_()
            else:  # a backward cut short (a failure mid-step) may have left a gradient not yet added
                for t in [*layer.params, *(alias for alias, _ in layer.uses)]:
                    t.grad = None

    def add_micro_batch(self) -> None:
        """Fold the gradient of the micro-batch just back-propagated into the sums.

        A tied tensor's uses elsewhere (``layer.uses``) are folded in as gradients of their own:
        each use is rounded alone, whether or not the other use ran on this rank, so the integer
        sum is the same wherever the uses sit."""
        if not self.deterministic:  # autograd added them already: into the flat gradient or the sum
            for layer in self.layers:
                if layer.grad is not None:  # float32: only the tied uses elsewhere are left
                    for alias, offset in layer.uses:
                        layer.grad[offset:offset + alias.numel()].add_(alias.grad.view(-1))
                        alias.grad.zero_()
            return
        for layer in self.layers:
            self._fold(layer.index, layer.grad, self.sums[layer.index])
            for alias, offset in layer.uses:
                self._fold(layer.index, alias.grad.view(-1), self.sums[layer.index][offset:offset + alias.numel()])

    def _fold(self, index: int, g: torch.Tensor, into: torch.Tensor) -> None:
        peak = float(g.abs().max()) if g.numel() else 0.0
        if not peak < self.max_abs:  # also catches NaN/inf
            raise GradientOverflowError(
                f"layer {index}: |gradient| = {peak:.3g} does not fit fixed point with "
                f"train.grad_fixed_point_bits={self.bits} "
                f"(limit {self.max_abs:.3g}); lower the bits or the learning rate")
        into.add_(torch.round(g.double() * self.scale).to(torch.int64))
        g.zero_()

    def to_float(self, t: torch.Tensor) -> torch.Tensor:
        if not self.deterministic:
            return t
        return (t.double() / self.scale).float()  # dividing by a power of two is exact


def reduce(bucket: Bucket, sums: dict[int, torch.Tensor], group: Group, whole: bool) -> torch.Tensor:
    """The holder group's summed gradient: the whole bucket if ``whole`` (an all-reduce), else only
    this rank's slot (a reduce-scatter)."""
    packed = bucket.pack([sums[l] for l in bucket.layers])
    if bucket.num_holders == 1:
        return packed
    if whole:
        group.all_reduce(packed, "gradient all-reduce")
        return packed
    out = torch.empty(bucket.slot_numel, dtype=packed.dtype, device=packed.device)
    group.reduce_scatter(out, packed, "gradient reduce-scatter")
    return out


def all_gather(bucket: Bucket, shard: torch.Tensor, group: Group | None, into: list[torch.Tensor]) -> None:
    """Every holder's updated chunks -> ``into``, the per-layer parameter vectors."""
    if bucket.num_holders == 1:
        bucket.unpack_into(shard, into)
        return
    packed = torch.empty(bucket.num_holders * bucket.slot_numel, dtype=shard.dtype, device=shard.device)
    group.all_gather(packed, shard.contiguous(), "parameter all-gather")
    bucket.unpack_into(packed, into)
