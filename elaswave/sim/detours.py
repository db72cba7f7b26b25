"""How the simulator prices a plan with detours: the routed schedule the runtime runs
(pipeline/routed.py), when each rank's gradients are whole in it, and the lower bound no schedule of
the plan's routes can beat (the reroute baseline's price)."""
from __future__ import annotations

from elaswave.pipeline import routed
from elaswave.pipeline.schedule import BACKWARD_INPUT_SHARE
from elaswave.plan.plan import Plan


def routed_compute(plan: Plan, virtual: dict[int, tuple[float, ...]], backward_factor: float,
                   released: dict[int, tuple[float, ...]] | None,
                   schedule: str = "1f1b") -> tuple[float, dict[int, tuple[float, ...]]] | None:
    """The routed schedule's compute and each rank's chunks' ends (:func:`~elaswave.pipeline.routed.routed_timing`)
    on each pipeline's ``virtual`` stages (forward + backward; a rank's chunks with virtual stages),
    a rank's forwards after ``released`` (its all-gathers); None where it is too large to build.
    ``schedule``: the pipelines' own (the cluster model's ``pipeline_schedule``)."""
    v = plan.virtual_stages
    routes, home = routed.routes_of(plan.pipelines, plan.micro_batches, plan.route_of, v)
    forward = {}
    for d, pipe in enumerate(plan.pipelines):
        for s, r in enumerate(pipe):
            chunks = tuple(t / (1 + backward_factor) for t in virtual[d][s::len(pipe)])
            forward[r] = chunks if v > 1 else sum(chunks)
    return routed.routed_timing(routes, home, forward, backward_factor,
                                {r: at[0] for r, at in released.items()} if released else None, v, schedule)


def routed_chunk_times(plan: Plan, virtual: dict[int, tuple[float, ...]], ends: dict[int, tuple[float, ...]],
                       backward_factor: float, schedule: str = "1f1b"):
    """``sim.model._whole_at``'s ``chunk_times`` for a plan with detours: each chunk's last backward
    (under ZB-H1 its last W) on the rank in its routed schedule (``ends``: a guest's or its own, the
    same layers), as long as one of the chunk's own (a W: its share of a backward, as
    ``pipeline.schedule.gradients_whole`` has it)."""
    share = 1.0 - BACKWARD_INPUT_SHARE if schedule == "zb-h1" else 1.0
    def times(rank: int) -> tuple[tuple[float, float], ...] | None:
        if rank not in ends:
            return None
        d, s = plan.position(rank)
        p = len(plan.pipelines[d])
        return tuple((end, virtual[d][c * p + s] * backward_factor / (1 + backward_factor) * share)
                     for c, end in enumerate(ends[rank]))
    return times


def routed_lower_bound(plan: Plan, stage: dict[int, float],
                       virtual: dict[int, tuple[float, ...]] | None = None) -> float:
    """No schedule of the plan's routes finishes sooner: some rank must run every forward and
    backward that passes through it (``stage[r]`` each), cannot start before the first of them has
    come through the stages before it (their forwards), and after its last backward that one still
    goes back through them (their backwards). A schedule that fills bubbles perfectly -- ReCycle's
    decoupled backward passes aim at it -- reaches this; the runtime's greedy one runs above it.
    With virtual stages a route names the rank of each (a guest's chunk, on its host, costs what
    the host's own chunk of that place does), and what comes before a rank is the chunks before its
    first (``virtual``: :meth:`ClusterModel.virtual_stage_s` by pipeline): without detours, the first
    chunks of the ranks before it."""
    chunks = plan.virtual_stages
    if chunks > 1 and virtual is None:
        raise ValueError(f"a plan of {chunks} model chunks a rank is bounded by its chunks' times: give virtual")
    routes, _ = routed.routes_of(plan.pipelines, plan.micro_batches, plan.route_of, chunks)
    work: dict[int, float] = {}
    upstream: dict[int, float] = {}
    for mb, route in routes.items():
        size = plan.units_of(mb) / plan.units_per_micro_batch if plan.micro_batch_units else 1.0
        before, depth = 0.0, len(route) // chunks
        for v, r in enumerate(route):
            if chunks == 1:
                cost = stage[r] * size
            else:
                d, s = plan.position(r)
                cost = virtual[d][v // depth * len(plan.pipelines[d]) + s] * size
            work[r] = work.get(r, 0.0) + cost
            upstream[r] = min(upstream.get(r, before), before)
            before += cost
    # Fill (the forwards before r) and drain (the backwards before r), each at least the cheapest
    # route's to r: together its whole upstream forward + backward.
    return max(w + upstream[r] for r, w in work.items())
