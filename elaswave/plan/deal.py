"""How a step's batch is dealt over pipelines of known stage times (pure): whole micro-batches or
units (reshaped), with or without a frequency plan, and what the pipelines' step then takes."""
from __future__ import annotations

from functools import lru_cache
from typing import Mapping, Sequence

from elaswave.pipeline import routed
from elaswave.pipeline.schedule import makespan, schedule_makespan, stage_schedule
from elaswave.plan import microbatches
from elaswave.plan.frequency import PowerModel, plan_frequencies


def deal(stage_s: Sequence[Sequence[float]], num_micro_batches: int, k: int, power: PowerModel | None,
         power_cap_w: float | None):
    """The pipelines' micro-batches, frequency levels, units (reshaped, ``k > 1``), sizes, stage
    times at their levels, and the frequency planner's solver.

    Reshaping deals units at the levels the frequency planner chose for whole micro-batches; where
    that is slower than reshaping at nominal clocks (the planner lowered stages that whole
    micro-batches left waiting, and units would have filled), the nominal one is taken: it is
    within the cap whenever the cap is the live devices' nominal power."""
    def whole(levels: bool):
        if levels and power is not None:
            fp = plan_frequencies(stage_s, num_micro_batches, power, power_cap_w)
            mbs, freqs, solver = fp.micro_batches, fp.levels, fp.solver
        else:
            mbs = tuple(microbatches.balance(num_micro_batches, [max(p) for p in stage_s], [len(p) for p in stage_s],
                                             [sum(p) - max(p) for p in stage_s]))
            freqs, solver = (), ""
        return mbs, freqs, [[t / power.speed(f) for t, f in zip(p, fs)] for p, fs in zip(stage_s, freqs)] if freqs else stage_s, solver

    def reshaped(levels: bool):
        mbs, freqs, at, solver = whole(levels)
        if k == 1:
            return mbs, freqs, (), None, at, solver
        ids, units = microbatches.reshape(num_micro_batches, k, [max(p) for p in at], [len(p) for p in at],
                                          [sum(p) - max(p) for p in at])
        return tuple(ids), freqs, units, [[units[i] / k for i in m] for m in ids], at, solver

    best = reshaped(True)
    stages = sum(len(p) for p in stage_s)
    nominal_ok = power is None or power_cap_w is None or power.power(1.0) * stages <= power_cap_w * (1 + 1e-9)
    if k > 1 and power is not None and nominal_ok:
        plain = reshaped(False)
        if step_s(plain[4], plain[0], plain[3]) < step_s(best[4], best[0], best[3]) * (1 - 1e-9):
            best = plain
    return best


def step_s(stage_s: Sequence[Sequence[float]], mbs, sizes: Sequence[Sequence[float]] | None = None,
           schedule: str = "1f1b", num_chunks: int = 1, backward_factor: float = 2.0) -> float:
    """The pipelines' step as the planner compares its candidate plans by: each pipeline timed by
    the runtime's order of ``schedule`` (parallel.schedule; ``num_chunks`` model chunks a rank,
    interleaved), each kind of pipeline once. (Timing only the 8 slowest by an analytic estimate
    above 256 ranks missed the slowest: Llama 3 405B 1F1B at 16,384 GPUs read 0.957 after a loss,
    0.967 timed whole.) ``sizes``: each pipeline's micro-batches as shares of a whole one (reshaped).
    ``backward_factor``: a stage's backward over its forward (:func:`~elaswave.plan.rates.split_factor`)."""
    if sizes is None:
        sizes = [[1.0] * len(m) for m in mbs]
    return max(_pipeline_s(schedule, tuple(p), tuple(z), num_chunks, backward_factor)
               for p, z, m in zip(stage_s, sizes, mbs) if m)


@lru_cache(maxsize=4096)
def _pipeline_s(schedule: str, stage_s: tuple[float, ...], sizes: tuple[float, ...], num_chunks: int,
                backward_factor: float = 2.0) -> float:
    return schedule_makespan(schedule, stage_s, len(sizes), backward_factor, sizes=sizes, num_chunks=num_chunks)


def chunks_step_s(virtual_s: Sequence[Sequence[float]], mbs, sizes: Sequence[Sequence[float]],
                  num_chunks: int) -> float:
    """:func:`step_s` of interleaved pipelines from each virtual stage's own time (``chunk * p +
    stage``), not a rank's time split evenly over its chunks."""
    return max(_chunked_s(tuple(v), tuple(z), num_chunks) for v, z, m in zip(virtual_s, sizes, mbs) if m)


@lru_cache(maxsize=4096)
def _chunked_s(virtual_s: tuple[float, ...], sizes: tuple[float, ...], num_chunks: int) -> float:
    depth = len(virtual_s) // num_chunks
    return makespan([stage_schedule("interleaved", s, depth, range(len(sizes)), num_chunks) for s in range(depth)],
                    virtual_s, sizes=sizes)


def detoured_step_s(pipelines, mbs, routes, stage_s: Mapping[int, float | tuple[float, ...]],
                    num_chunks: int = 1, schedule: str = "1f1b", backward_factor: float = 2.0) -> float:
    """Predicted compute of a plan with detours: its routed schedule's length (the schedule the
    ranks would run; ``stage_s`` is forward + backward, split 1 : ``backward_factor``, with
    ``num_chunks`` model chunks a rank each chunk's), or above ``routed.EXACT_MAX_RANKS`` ranks in
    a connected set of routes the busiest rank's micro-batches (own and guests') plus one fill.
    ``schedule``: the pipelines' own, which each rank keeps with its guests in (1f1b or zb-h1; with
    chunks interleaved)."""
    all_routes, home = routed.routes_of(pipelines, mbs, dict(routes), num_chunks)
    share = 1.0 + backward_factor
    forward = {r: tuple(c / share for c in t) if isinstance(t, tuple) else t / share for r, t in stage_s.items()}
    exact = routed.routed_timing(all_routes, home, forward, backward_factor, num_chunks=num_chunks, schedule=schedule)
    if exact is not None:
        return exact[0]
    whole = {r: sum(t) if isinstance(t, tuple) else t for r, t in stage_s.items()}
    count: dict[int, int] = {}
    for route in all_routes.values():
        for r in set(route):
            count[r] = count.get(r, 0) + 1
    depth = max(len(route) for route in all_routes.values()) // num_chunks
    return max(whole[r] * n for r, n in count.items()) + (depth - 1) * max(whole.values())
