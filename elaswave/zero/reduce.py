"""Gradient accumulation per micro-batch and its reduction to chunk owners.

Gradients are summed in float32 (or fixed point) whatever the layers compute in. Deterministic mode turns each micro-batch's gradient into fixed point, ``round(g * 2**bits)`` in
int64, before anything is added. Integer addition is associative, so the sum over the M
micro-batches has the same bits whichever pipeline ran which micro-batch and in whatever order the
reduce-scatter adds them. Fast mode adds float32 gradients as they come.
"""
from __future__ import annotations

import time
from typing import Collection, Sequence

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
        self._layers = {l.index: l for l in self.layers}
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
        self._folded: set[int] = set()
        """Layers the backward running now has already folded (:meth:`fold_layer`)."""

    def zero(self) -> None:
        self._folded.clear()
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
        for layer in self.layers:
            if layer.index not in self._folded:
                self._fold_layer(layer)
        self._folded.clear()

    def fold_layer(self, index: int) -> None:
        """Fold layer ``index``'s gradient of the backward running now, which has made it whole
        (zero/watch.py): its sum can start before that backward ends. :meth:`add_micro_batch` then
        leaves it alone; the bits are those of folding it there."""
        self._fold_layer(self._layers[index])
        self._folded.add(index)

    def _fold_layer(self, layer: FlatLayer) -> None:
        if not self.deterministic:  # autograd added them already: into the flat gradient or the sum
            if layer.grad is not None:  # float32: only the tied uses elsewhere are left
                for alias, offset in layer.uses:
                    layer.grad[offset:offset + alias.numel()].add_(alias.grad.view(-1))
                    alias.grad.zero_()
            return
        self._fold(layer.index, layer.grad, self.sums[layer.index])
        for alias, offset in layer.uses:
            self._fold(layer.index, alias.grad.view(-1), self.sums[layer.index][offset:offset + alias.numel()])

    def fold_part(self, index: int) -> None:
        """Deterministic mode: fold unit ``index``'s gradient now, alone (an expert's, computed for
        one member's rows of a micro-batch: expert/exchange.py), and again as more comes in the
        same backward. Rounding is per value, so these are the folds of each part alone."""
        layer = self._layers[index]
        self._fold(index, layer.grad, self.sums[index])

    def _fold(self, index: int, g: torch.Tensor, into: torch.Tensor) -> None:
        peak = float(g.abs().max()) if g.numel() else 0.0
        if not peak < self.max_abs:  # also catches NaN/inf
            raise GradientOverflowError(
                f"{self._layers[index].label}: |gradient| = {peak:.3g} does not fit fixed point with "
                f"train.grad_fixed_point_bits={self.bits} "
                f"(limit {self.max_abs:.3g}); lower the bits or the learning rate")
        into.add_(torch.round(g.double() * self.scale).to(torch.int64))
        g.zero_()

    def to_float(self, t: torch.Tensor) -> torch.Tensor:
        if not self.deterministic:
            return t
        return (t.double() / self.scale).float()  # dividing by a power of two is exact


def start_sum(bucket: Bucket, sums: dict[int, torch.Tensor], group: Group, whole: bool):
    """Start the holder group's sum of the bucket: (what will hold it, the operation to wait for, or
    None). It holds the whole bucket if ``whole`` (an all-reduce), else only this rank's slot (a
    reduce-scatter)."""
    packed = bucket.pack([sums[l] for l in bucket.layers])
    if bucket.num_holders == 1:
        return packed, None
    if whole:
        return packed, group.all_reduce_async(packed)
    out = torch.empty(bucket.slot_numel, dtype=packed.dtype, device=packed.device)
    return out, group.reduce_scatter_async(out, packed)


class Reduction:
    """The step's gradient sums, each bucket's started as soon as this rank's schedule has made its
    gradients whole (``ready_after[i]``: after that action; -1: none computed here) and the buckets
    before it in ``order`` are started: one order on every rank, so two buckets of one group start
    in the same order everywhere -- a collective is matched by its place in its group's sequence.
    A schedule issues no other collective on a holder group or the world group (its sends are
    point-to-point, tagged apart), and the step's own come after :meth:`start_rest`. The packed
    copy is what travels, so later folds (of other chunks) cannot touch it."""

    def __init__(self, buckets: Sequence[Bucket], groups: Sequence[Group], accumulator: GradAccumulator,
                 whole: bool, order: Sequence[int], ready_after: Sequence[int], num_actions: int,
                 link_gbps: float = 0.0):
        """``num_actions``: the schedule's; ``link_gbps`` (emulate.link_gbps): a sum also takes a
        ring all-reduce's (or reduce-scatter's) time on such a link, from when this rank started it."""
        self.buckets, self.groups, self.accumulator, self.whole = list(buckets), list(groups), accumulator, whole
        self.order = list(order)
        self.ready_after = list(ready_after)
        self.link_gbps, self.num_actions = link_gbps, num_actions
        self.reset()

    def reset(self) -> None:
        """A new step (what a failed one started is the broken epoch's, parked with its group)."""
        self._started: dict[int, tuple[torch.Tensor, object, float]] = {}
        self._next = 0
        self._watched: tuple[int, set[int]] = (-1, set())
        """(the action running, the layers it has made whole so far): :meth:`watched`."""
        self.early = 0
        """Sums started before the schedule's last action ended (overlapping its compute)."""
        self.within = 0
        """Of those, the sums started while a backward still ran (:meth:`layer_whole`)."""

    def watched(self, index: int) -> set[int]:
        """Action ``index``, a whole backward, is about to run: the layers whose gradients it makes
        whole for the sums that may start before it ends -- the buckets it readies, the next in
        the order first (a later one never starts before it)."""
        self._watched = (index, set())
        out: set[int] = set()
        for i in self.order[self._next:]:
            if self.ready_after[i] != index:
                break
            out.update(self.buckets[i].layers)
        return out

    def layer_whole(self, layer: int) -> None:
        """The watched backward has made ``layer``'s gradient whole and folded it: start every
        bucket, in the order, whose layers all are."""
        index, done = self._watched
        done.add(layer)
        while self._next < len(self.order):
            i = self.order[self._next]
            if self.ready_after[i] != index or not done.issuperset(self.buckets[i].layers):
                break
            self._begin(i)
            self._next += 1
            self.early += 1
            self.within += 1

    def after(self, index: int) -> None:
        """Action ``index`` of the step's schedule has run: start what it made whole."""
        while self._next < len(self.order) and self.ready_after[self.order[self._next]] <= index:
            self._begin(self.order[self._next])
            self._next += 1
            self.early += index < self.num_actions - 1

    def _begin(self, i: int) -> None:
        self._started[i] = (*start_sum(self.buckets[i], self.accumulator.sums, self.groups[i], self.whole),
                            time.perf_counter())

    def start_rest(self) -> None:
        """The schedule has run: start every sum not started yet."""
        for i in self.order[self._next:]:
            self._begin(i)
        self._next = len(self.order)

    def finish(self) -> list[torch.Tensor]:
        """Wait for every sum (starting what is left); each bucket's (float) sum, in bucket order."""
        self.start_rest()
        out, link_free = [], 0.0
        for i in self.order:  # (the order they took the link in)
            t, work, began = self._started[i]
            if work is not None:
                self.groups[i].wait(work, "gradient all-reduce" if self.whole else "gradient reduce-scatter")
                if self.link_gbps > 0:  # one after another on the rank's link, each from its start
                    ring = ((2 if self.whole else 1) * (self.buckets[i].num_holders - 1) * self.buckets[i].slot_numel
                            * t.element_size())  # an all-reduce moves twice a reduce-scatter's
                    link_free = max(link_free, began) + ring / (self.link_gbps * 1e9)
                    time.sleep(max(0.0, link_free - time.perf_counter()))
        for i in range(len(self.buckets)):
            out.append(self.accumulator.to_float(self._started.pop(i)[0]))
        return out


class Gathering:
    """The parameter all-gathers after ZeRO-1's update, started at the step's end (:meth:`start`)
    and each waited for only when the next step's forward first reads its bucket
    (:meth:`before_layer`: a layer in ``read_by[i]``, the layers of the bucket's units and the
    tied uses of them). They start in one order on every rank, the first
    layers first, as forwards need them; nothing else is issued on a holder group before the next
    step's sums, which come after every wait (a rank whose chunks run no forward settles at its
    schedule's end). Anything else that reads the layers between steps settles first
    (:meth:`settle`). A broken epoch's are never waited for: a recovery builds the rank anew, with
    a new one of these, and gathers every layer again from the chunks it restores (the old
    operations stay parked with their groups)."""

    def __init__(self, buckets: Sequence[Bucket], groups: Sequence[Group], read_by: Sequence[Collection[int]],
                 link_gbps: float = 0.0):
        """``link_gbps`` (emulate.link_gbps): an all-gather also takes a ring all-gather's time on such
        a link, one after another from their start."""
        self.buckets, self.groups = list(buckets), list(groups)
        self.order = sorted(range(len(self.buckets)), key=lambda i: (min(read_by[i]), i))
        self._read_by: dict[int, list[int]] = {}  # layer -> the buckets it reads, in order
        for i in self.order:
            for layer in read_by[i]:
                self._read_by.setdefault(layer, []).append(i)
        self.link_gbps = link_gbps
        # Bucket -> (what arrives, the operation, the shard it sends -- kept alive until it is done,
        # the layers' vectors it lands in, when the emulated link has carried it).
        self._pending: dict[int, tuple[torch.Tensor, object, torch.Tensor, list[torch.Tensor], float]] = {}
        self.in_forwards = 0
        """All-gathers of other ranks' chunks that forwards waited for since the last :meth:`start`."""

    def start(self, shards: Sequence[torch.Tensor], into: Sequence[list[torch.Tensor]]) -> None:
        """Bucket ``i``'s updated chunks (``shards[i]``, the owner's float32) go out to its holders,
        rounded to the layers' dtype before they travel, and land in ``into[i]`` (its layers' vectors)."""
        self.settle()  # (a gather started again before the last was read: one order on the group still)
        self.in_forwards = 0
        link_free = time.perf_counter()
        for i in self.order:
            b = self.buckets[i]
            shard = shards[i].to(into[i][0].dtype).contiguous()
            if b.num_holders == 1:
                with torch.no_grad():
                    b.unpack_into(shard, into[i])
                continue
            packed = torch.empty(b.num_holders * b.slot_numel, dtype=shard.dtype, device=shard.device)
            work = self.groups[i].all_gather_async(packed, shard)
            if self.link_gbps > 0:
                link_free += (b.num_holders - 1) * b.slot_numel * shard.element_size() / (self.link_gbps * 1e9)
            self._pending[i] = (packed, work, shard, into[i], link_free)

    def before_layer(self, layer: int) -> None:
        """A forward is about to run ``layer`` (every forward of every layer: cheap when none is out)."""
        if not self._pending:
            return
        for i in self._read_by.get(layer, ()):
            if i in self._pending:
                self.in_forwards += self._pending[i][1] is not None
                self._finish(i)

    def settle(self) -> None:
        """Wait for every all-gather still out."""
        for i in [i for i in self.order if i in self._pending]:
            self._finish(i)

    def _finish(self, i: int) -> None:
        packed, work, _, into, ends = self._pending.pop(i)
        if work is not None:
            self.groups[i].wait(work, "parameter all-gather")
        if self.link_gbps > 0:
            time.sleep(max(0.0, ends - time.perf_counter()))
        with torch.no_grad():
            self.buckets[i].unpack_into(packed, into)

