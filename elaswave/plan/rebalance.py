"""Re-planning the same ranks by their measured speeds (a straggler): what it is predicted to save."""
from __future__ import annotations

from typing import Mapping

from elaswave.plan.errors import PlanError
from elaswave.plan.plan import Plan
from elaswave.plan.replan import replan
from elaswave.plan.rates import range_cost, rank_costs, rank_rates


def rebalance_gain(prev: Plan, speeds: Mapping[int, float], num_micro_batches: int,
                   min_gain: float = 0.0) -> tuple[float, Plan | None]:
    """The fraction of a step that re-planning the same ranks by their measured ``speeds`` is
    predicted to save (1F1B with each stage at its rank's rate), and that plan. A plan with
    detours or idle pipelines (the baselines) is not rebalanced: (0, None).

    Every rank asks this after every step, and a re-plan re-partitions every pipeline (seconds at
    10^4 ranks), so with ``min_gain`` a bound comes first. A pipeline of S stages, m micro-batches
    and summed rate R_p takes at least (m + S - 1) C / R_p for layers of total cost C; spreading
    the M micro-batches to equalise that gives every plan of these pipelines at least
    C (M + sum(S - 1)) / sum(R_p). When even that saves less than ``min_gain`` -- the usual case,
    speeds even -- no re-plan is made: (the bound, None)."""
    if prev.routes or not all(prev.micro_batches) or not all(speeds.get(r, 0) > 0 for r in prev.ranks):
        return 0.0, None
    rate = rank_rates(prev, speeds)

    def step_s(plan: Plan) -> float:
        return max((len(m) + len(p) - 1) * max(c / rate[r] for r, c in zip(p, rank_costs(plan, p, rng)))
                   for p, rng, m in zip(plan.pipelines, plan.layer_ranges, plan.micro_batches))

    now = step_s(prev)
    slots = sum(len(m) + len(p) - 1 for p, m in zip(prev.pipelines, prev.micro_batches))
    bound = 1.0 - range_cost(prev, 0, prev.num_layers) * slots / sum(rate.values()) / now
    if bound < min_gain:
        return bound, None
    try:
        candidate = replan(prev, prev.ranks, prev.epoch + 1, num_micro_batches, speeds, rebalance=True)
    except PlanError:  # no re-split keeps within the memory limit (interleaved): the layout stays
        return 0.0, None
    return 1.0 - step_s(candidate) / now, candidate
