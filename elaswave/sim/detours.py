"""How the simulator prices a plan with detours: the routed schedule the runtime runs
(pipeline/routed.py), when each rank's gradients are whole in it, and the lower bound no schedule of
the plan's routes can beat (the reroute baseline's price)."""
from __future__ import annotations

from typing import Sequence

from elaswave.pipeline import routed
from elaswave.plan.buckets import gradient_chunks
from elaswave.plan.plan import Plan


def routed_compute(plan: Plan, virtual: dict[int, tuple[float, ...]], backward_factor: float,
                   released: dict[int, tuple[float, ...]] | None) -> tuple[float, dict[int, float]] | None:
    """The routed schedule's compute and each rank's end (:func:`~elaswave.pipeline.routed.routed_timing`)
    on each pipeline's ``virtual`` stages (forward + backward; a rank's chunks with virtual stages),
    a rank's forwards after ``released`` (its all-gathers); None where it is too large to build."""
    v = plan.virtual_stages
    routes, home = routed.routes_of(plan.pipelines, plan.micro_batches, plan.route_of, v)
    forward = {}
    for d, pipe in enumerate(plan.pipelines):
        for s, r in enumerate(pipe):
            chunks = tuple(t / (1 + backward_factor) for t in virtual[d][s::len(pipe)])
            forward[r] = chunks if v > 1 else sum(chunks)
    return routed.routed_timing(routes, home, forward, backward_factor,
                                {r: at[0] for r, at in released.items()} if released else None, v)


def routed_whole_at(plan: Plan, virtual: dict[int, tuple[float, ...]], ends: dict[int, tuple[float, ...]], model):
    """``sim.model._whole_at`` for a plan with detours: a rank's gradients of a chunk are whole
    after its last backward of the chunk (``ends``, its routed schedule's: a guest's or its own, the
    same layers), and within it once it has run the chunk's layers from the bucket's lowest up;
    without overlap, when all the rank's chunks are done."""
    split = model.split_factor(plan)

    def at(rank: int, layers: Sequence[int]) -> float:
        d, s = plan.position(rank)
        lowest = plan.layer_of(layers[0])
        chunks = gradient_chunks(plan, rank, lowest)
        if rank not in ends or not chunks:
            return 0.0
        if not model.overlap_grad_reduce:
            chunks = frozenset(range(len(ends[rank])))
        out, ranges = 0.0, plan.chunk_ranges(rank)
        for c in chunks:
            end, (start, stop) = ends[rank][c], ranges[c]
            if model.overlap_grad_reduce and model.layer_forward_s and len(chunks) == 1 and start <= lowest < stop:
                layer_s = model.layer_forward_s
                backward = virtual[d][c * len(plan.pipelines[d]) + s] * split / (1 + split)
                end -= backward * sum(layer_s[start:lowest]) / (sum(layer_s[start:stop]) or 1.0)
            out = max(out, end)
        return out
    return at


def routed_lower_bound(plan: Plan, stage: dict[int, float],
                       virtual: dict[int, tuple[float, ...]] | None = None) -> float:
    """No schedule of the plan's routes finishes sooner: some rank must run every forward and
    backward that passes through it (``stage[r]`` each), cannot start before the first of them has
    come through the stages before it (their forwards), and after its last backward that one still
    goes back through them (their backwards). A schedule that fills bubbles perfectly -- ReCycle's
    decoupled backward passes aim at it -- reaches this; the runtime's greedy one runs above it.
    With virtual stages (no detours) what comes before a rank is the first chunks of the ranks
    before it (``virtual``: :meth:`ClusterModel.virtual_stage_s` by pipeline)."""
    routes, home = routed.routes_of(plan.pipelines, plan.micro_batches, plan.route_of)
    work: dict[int, float] = {}
    upstream: dict[int, float] = {}
    for mb, route in routes.items():
        size = plan.units_of(mb) / plan.units_per_micro_batch if plan.micro_batch_units else 1.0
        before = 0.0
        for s, r in enumerate(route):
            work[r] = work.get(r, 0.0) + stage[r] * size
            upstream[r] = min(upstream.get(r, before), before)
            before += (stage[r] if plan.virtual_stages == 1 or virtual is None else virtual[home[mb]][s]) * size
    # Fill (the forwards before r) and drain (the backwards before r), each at least the cheapest
    # route's to r: together its whole upstream forward + backward.
    return max(w + upstream[r] for r, w in work.items())
