"""What the planner balances and compares plans by (pure): each layer's cost, a rank's summed cost
in a pipeline, the rate (cost per second) each rank sustains from its measured speed, and from
them a rank's time a micro-batch and a plan's step."""
from __future__ import annotations

import statistics
from typing import Mapping, Sequence

from elaswave.plan.deal import chunks_step_s, detoured_step_s, step_s
from elaswave.plan.frequency import PowerModel


def layer_costs(plan) -> tuple[float, ...]:
    return plan.layer_costs or (1.0,) * plan.num_layers


def range_cost(plan, start: int, end: int) -> float:
    return sum(layer_costs(plan)[start:end])


def rank_costs(plan, pipe: Sequence[int], ranges: Sequence[tuple[int, int]]) -> list[float]:
    """Each rank's summed layer cost in a pipeline of ``ranges`` (its chunks' together)."""
    return [sum(range_cost(plan, i, j) for i, j in ranges[s::len(pipe)]) for s in range(len(pipe))]


def rank_rates(prev, speeds: Mapping[int, float], ranks: Sequence[int] = (),
               power: PowerModel | None = None) -> dict[int, float]:
    """Layer cost per second each rank sustains at nominal frequency: its measured micro-batch rate
    times the cost of the layers it ran, over the speed its frequency level gave it (``power``'s;
    in proportion without one). Ranks that did not measure (joiners among ``ranks``, or every rank
    before any step) count as the median one."""
    speed_at = power.speed if power is not None else float
    measured = {}
    for r in prev.ranks:
        speed = float(speeds.get(r, 0.0))
        if speed > 0:
            cost = sum(range_cost(prev, i, j) for i, j in prev.chunk_ranges(r))
            measured[r] = speed * cost / speed_at(prev.frequency(r))
    typical = statistics.median(measured.values()) if measured else 1.0
    return {r: measured.get(r, typical) for r in (*prev.ranks, *ranks)}


def recompute_cost(plan, schedule: str) -> dict[int, float]:
    """Each rank's recomputation a micro-batch, in layer cost: the forwards of the blocks the plan
    has it recompute (``plan.recomputed``; a block's forward is a third of its forward + backward),
    twice under ZB-H1 (its W runs a recomputed block again)."""
    if not plan.recomputed:
        return {}
    costs, runs = layer_costs(plan), 2 if schedule == "zb-h1" else 1
    return {r: runs * sum(costs[i] for i in plan.recomputed_of(r)) / 3.0 for r in plan.ranks}


def split_factor(costs: Mapping[int, float], extra: Mapping[int, float]) -> float:
    """A plan's stages' backward over forward with what they recompute (``extra``, :func:`recompute_cost`;
    ``costs``: each rank's layers, forward + backward) counted in the backward (and W), where it runs,
    as the simulator splits a stage (``sim.model.split_factor``: one factor, the plan's average).
    Lumped into a stage's time split 1:2, ZB-H1's detours of Llama 3 405B at 16,384 GPUs, whose
    blocks are nearly all recomputed, read 0.952 of the step before where the simulator times 0.983."""
    total = sum(costs.values())
    return 2.0 + 3.0 * sum(extra.get(r, 0.0) for r in costs) / total if total else 2.0


def stage_times(plan, pipe: Sequence[int], ranges: Sequence[tuple[int, int]], rate: Mapping[int, float],
                extra: Mapping[int, float]) -> list[float]:
    """Each rank's time a micro-batch in a pipeline of ``ranges``: its layers' cost and its
    recomputation (``extra``, :func:`recompute_cost`), over its rate."""
    return [(c + extra.get(r, 0.0)) / rate[r] for r, c in zip(pipe, rank_costs(plan, pipe, ranges))]


def timing(schedule: str, virtual_stages: int) -> tuple[str, int]:
    """The schedule and chunks a rank by which pipelines are timed: interleaved wherever a plan has
    virtual stages (the planner's callers may name parallel.schedule as 1f1b there)."""
    return ("interleaved", virtual_stages) if virtual_stages > 1 else (schedule, 1)


def chunk_times(plan, d: int, rate: Mapping[int, float]) -> list[float]:
    """Pipeline ``d``'s virtual stages' times a micro-batch (forward + backward), each with the blocks
    its rank recomputes, at nominal clocks."""
    costs, pipe = layer_costs(plan), plan.pipelines[d]
    again = {r: plan.recomputed_of(r) for r in pipe} if plan.recomputed else {}
    return [(range_cost(plan, i, j) + sum(costs[b] for b in again.get(pipe[k % len(pipe)], ()) if i <= b < j) / 3.0)
            / rate[pipe[k % len(pipe)]] for k, (i, j) in enumerate(plan.layer_ranges[d])]


def priced_detoured_s(plan, rate: Mapping[int, float]) -> float:
    """A plan with detours between interleaved pipelines as the planner times it: the routed schedule
    (pipeline/routed.py) on each rank's chunks, with what they recompute."""
    times = {}
    for d, pipe in enumerate(plan.pipelines):
        chunks = chunk_times(plan, d, rate)
        times.update((r, tuple(chunks[s::len(pipe)])) for s, r in enumerate(pipe))
    return detoured_step_s(plan.pipelines, plan.micro_batches, plan.routes, times, plan.virtual_stages)


def priced_step_s(plan, rate: Mapping[int, float], schedule: str) -> float:
    """The plan's step as the planner times it (:func:`~elaswave.plan.deal.step_s`), each rank's
    stage including its recomputation (:func:`recompute_cost`), at nominal clocks. Under
    interleaved 1F1B each model chunk is timed as a stage of its own, with the blocks it
    recomputes, as the simulator times it: a re-split pipeline's uneven chunks, taken as even
    shares of their rank's time, read as fast as standing it by where they were 2 % slower (Llama 3
    405B at 16,384 GPUs)."""
    run = [d for d in range(len(plan.pipelines)) if plan.micro_batches[d]]
    mbs = [plan.micro_batches[d] for d in run]
    sizes = [[plan.units_of(mb) / plan.units_per_micro_batch for mb in plan.micro_batches[d]] for d in run]
    if plan.virtual_stages > 1:
        return chunks_step_s([chunk_times(plan, d, rate) for d in run], mbs, sizes, plan.virtual_stages)
    extra = recompute_cost(plan, schedule)
    return step_s([stage_times(plan, plan.pipelines[d], plan.layer_ranges[d], rate, extra) for d in run], mbs, sizes,
                  *timing(schedule, plan.virtual_stages))
