"""Gradient buckets: which layers' gradients are summed together, and when a rank's are whole (pure).

A holder group (the ranks that hold the same layers, one from each pipeline) sums its layers'
gradients each step. Under interleaved 1F1B a rank's layers sit in several model chunks, and a
chunk's gradients are whole as soon as its last backward ends -- for chunk V-1 long before the
step's compute does. So a holder group's layers are cut into *buckets* wherever the chunk that
computes them changes on any holder: each bucket's sum can start while the rank still computes
the chunks before it (runtime/step.py, zero/reduce.Reduction). Buckets are also cut by size
(``Plan.bucket_starts``, from ``parallel.bucket_numel``, Megatron's bucket size), so that a chunk's
first layers' all-gathers end before its last ones' (zero/reduce.Gathering: a forward waits only
for the layer it runs). A layer is never cut.
"""
from __future__ import annotations

from typing import Sequence

from elaswave.pipeline.schedule import Action, Op

Bucket = tuple[tuple[int, ...], tuple[int, ...]]
"""(holders, layers): a holder group's ranks and the layers of one bucket, in layer order."""


def gradient_chunks(plan, rank: int, layer: int) -> frozenset[int]:
    """The model chunks of ``rank`` whose backwards add to ``layer``'s gradient in ``plan`` (a
    :class:`~elaswave.plan.plan.Plan`, which asks this module for its buckets): the chunk that runs
    it, and the chunk of every tied use of its tensors that ``rank`` runs."""
    ranges = plan.chunk_ranges(rank)
    users = {layer} | {user for owner, user in plan.ties if owner == layer}
    return frozenset(c for c, (start, end) in enumerate(ranges) if any(start <= u < end for u in users))


def size_starts(numels: Sequence[int], bucket_numel: int, unit_layers: Sequence[int] = ()) -> tuple[int, ...]:
    """The units that start a bucket when the model's units (``numels``; ``unit_layers``: see
    :class:`~elaswave.plan.plan.Plan`), in layer order, are cut into runs of at most
    ``bucket_numel`` values (a larger unit alone); 0: no cut. A holder group's run of units is a
    part of that order, so its pieces between these starts are no larger."""
    starts, size = [], 0
    for unit in in_layer_order(len(numels) - len(unit_layers), unit_layers):
        n = numels[unit]
        if bucket_numel and size and size + n > bucket_numel:
            starts.append(unit)
            size = 0
        size += n
    return tuple(starts)


def in_layer_order(num_layers: int, unit_layers: Sequence[int]) -> list[int]:
    """Every unit, each layer's own before its experts' (model/units.py)."""
    return sorted(range(num_layers + len(unit_layers)),
                  key=lambda u: (u if u < num_layers else unit_layers[u - num_layers], u))


def gradient_buckets(plan, holder_groups: dict[tuple[int, ...], tuple[int, ...]]) -> tuple[Bucket, ...]:
    """Each holder group's layers, cut into runs that every holder computes in one model chunk (and
    the same chunks throughout) and at the plan's size cuts (``bucket_starts``), groups in
    ``holder_groups``' order."""
    out: list[Bucket] = []
    cuts = frozenset(plan.bucket_starts)
    for holders, layers in holder_groups.items():
        run: list[int] = []
        key = None
        for unit in layers:
            here = tuple(gradient_chunks(plan, h, plan.layer_of(unit)) for h in holders) if plan.virtual_stages > 1 else ()
            if run and (here != key or unit in cuts):
                out.append((holders, tuple(run)))
                run = []
            run.append(unit)
            key = here
        if run:
            out.append((holders, tuple(run)))
    return tuple(out)


def issue_order(buckets: Sequence[Bucket], layer_of=lambda unit: unit) -> list[int]:
    """The order every rank starts its buckets' sums in: the last layers first, as backwards finish
    them (a bucket's units are ``layer_of`` its layers). One order for all, so that two buckets of
    one group are started in the same order by all its holders (a collective is matched by its
    place in the group's sequence)."""
    return sorted(range(len(buckets)), key=lambda i: -max(map(layer_of, buckets[i][1])))


def ready_after(actions: Sequence[Action], chunks: frozenset[int]) -> int:
    """The index of the action after which every gradient ``chunks`` compute is whole: their last
    backward (or W, when the backward is split); -1 when they run none this step."""
    return max((i for i, a in enumerate(actions)
                if a.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT) and a.chunk in chunks), default=-1)
