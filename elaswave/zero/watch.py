"""Each layer's gradient whole within a backward, so that its bucket's sum starts before the
backward ends (Megatron's per-bucket hooks).

A rank's last backward of a model chunk in a step (or ZB-H1's last W) makes the chunk's gradients
whole layer by layer, the last layer first: under plain 1F1B that is every layer of the rank, and without this all its
sums waited for the whole backward. Every weight tensor of a stage (its layers' parameters and tied
uses) carries one post-accumulate hook for its life; while a backward is watched, the hook counts the
tensors of each layer that autograd has given their gradient. When all of a layer's have, the layer
is folded (``GradAccumulator.fold_layer``: the same bits as folding it after the backward) and the
reduction told (``Reduction.layer_whole``), which starts every bucket whose layers are all whole, in its
one order.

One backward call gives each leaf its gradient once, so a tensor counted is a tensor done. A
mixture of experts' experts (units of their own, model/units.py) are not counted but follow their
layer: an exchange gives their weights their gradients in nested backwards (folded as they come,
expert/exchange.py), all of which end before the block's attention gets its -- and an expert no
row reached, or another rank owns, gets none -- so they are whole when their layer is. Under
ZB-H1's W the exchange's node is restarted among its layer's products: some of the layer's
weights take their gradients before the experts', but its norms' products, below the experts in
the built-in families, after them, so the layer is still whole last (a custom block with no
counted weight below its experts would not be). A layer
with nothing to count (a head without adapters under LoRA) is whole at once. A
layer one of whose counted tensors gets no gradient in that backward (a tied use computed in another
chunk) is never whole here: its bucket, and the buckets after it in the order, start once the
action has run, as without the watch.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Callable, Mapping, Sequence

import torch

from elaswave.pipeline.emulate import EmulatedCompute
from elaswave.zero.flat import FlatLayer
from elaswave.zero.reduce import GradAccumulator, Reduction


class LayerWatch:
    def __init__(self, layers: Sequence[FlatLayer], accumulator: GradAccumulator, reduction: Reduction,
                 emulated: EmulatedCompute | None = None, followers: Mapping[int, Sequence[FlatLayer]] = {}):
        """``emulated``: a watched backward also takes each layer's modelled time before its sum
        starts; ``followers``: layer -> the units whole when it is (its experts', above)."""
        self.accumulator, self.reduction, self.emulated = accumulator, reduction, emulated
        self._tensors: dict[int, int] = {}
        self._follow = {layer: [u.index for u in us] for layer, us in followers.items()}
        following = {u.index for us in followers.values() for u in us}
        self._watched: set[int] = set()
        self._wanted: set[int] = set()
        self._given: dict[int, set[int]] = {}
        self._chunk, self._began, self._share = 0, (lambda: 0.0), 1.0
        # A hook outlives epochs (a tensor's hooks cannot be listed or dropped one by one without
        # their handles) and holds only its slot, whose watch is weak: an old epoch's watch is freed
        # with its rank, and a hook reaching back to a layer would be a cycle the collector misses.
        ref = weakref.ref(self)
        for layer in layers:
            if layer.index in following:
                continue
            tensors = [*layer.params, *(alias for alias, _ in layer.uses)]
            if not tensors and any(u.numel for u in followers.get(layer.index, ())):
                continue  # nothing tells when its experts are whole: their bucket starts at the action's end
            self._tensors[layer.index] = len(tensors)
            for t in tensors:
                slot = getattr(t, "_elaswave_watch", None)
                if slot is None:
                    slot = t._elaswave_watch = [layer.index, None]
                    t.register_post_accumulate_grad_hook(_counter(slot))
                slot[0], slot[1] = layer.index, ref

    @contextmanager
    def watching(self, index: int, chunk: int, began: Callable[[], float], share: float = 1.0):
        """While action ``index``, a whole backward of ``chunk`` (or ZB-H1's W, ``share`` of one),
        runs its last piece; ``began``: when it began, as emulated compute counts it."""
        self._watched = watched = self.reduction.watched(index)
        self._wanted = {layer for layer in watched if self._tensors.get(layer)}
        self._given, self._chunk, self._began, self._share = {}, chunk, began, share
        for layer in sorted(watched - self._wanted, reverse=True):  # nothing to wait for
            if layer in self._tensors:
                self._whole(layer)
        try:
            yield
        finally:
            self._wanted = set()

    def given(self, layer: int, t: torch.Tensor) -> None:
        if layer not in self._wanted:
            return
        given = self._given.setdefault(layer, set())
        given.add(id(t))
        if len(given) < self._tensors[layer]:
            return
        self._wanted.discard(layer)
        if self.emulated is not None:
            self.emulated.backward_through(self._began(), self._chunk, layer, self._share)
        self._whole(layer)

    def _whole(self, layer: int) -> None:
        self.accumulator.fold_layer(layer)
        self.reduction.layer_whole(layer)
        for unit in self._follow.get(layer, ()):
            if unit in self._watched:
                self.accumulator.fold_layer(unit)
                self.reduction.layer_whole(unit)


def _counter(slot: list):
    def counted(t: torch.Tensor) -> None:
        watch = slot[1]() if slot[1] is not None else None
        if watch is not None:
            watch.given(slot[0], t)
    return counted
