"""Frequency (DVFS) planning (pure): even out stage times after a re-plan, spending power only
where it buys step time.

A stage's compute time scales as ``1 / f`` with its device's relative frequency ``f`` (compute
bound), and its power as ``static + dynamic * f**3``. After a re-partition the pipelines no longer
have equal stages, so under 1F1B every stage waits for its pipeline's slowest one, and the
pipelines wait for the slowest pipeline at the step's end. For a bottleneck level ``F`` the plan

1. runs each pipeline's bottleneck stage at ``F`` (that is what sets the step time),
2. balances the micro-batches with those bottleneck times (:func:`microbatches.balance`),
3. lets every other stage run at the lowest level that keeps it within the time its pipeline may
   take per micro-batch without delaying the step -- stages that would only wait slow down;

and it takes the highest ``F`` whose total power stays within the cap (by default what every
device draws at nominal frequency): the power the waiting stages give up pays for the bottleneck.

One ``F`` for every pipeline is often too dear: after a loss, the re-partitioned pipeline is the
slow one, and raising every pipeline's bottleneck costs the power of all of them. So the plan also
raises the slowest pipelines alone, a level at a time (the pipelines with the largest bottleneck
time first), while the power stays within the cap, and keeps the fastest plan found (the least
energy on a tie).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from elaswave.plan import microbatches


@dataclass(frozen=True)
class PowerModel:
    levels: tuple[float, ...] = (0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2)
    """Relative frequencies a device can be set to (1.0 = nominal, above it: boost)."""
    static_w: float = 0.3
    dynamic_w: float = 0.7
    """Power at frequency f is ``static_w + dynamic_w * f**3`` (1.0 at nominal with the defaults)."""

    def __post_init__(self) -> None:
        if not self.levels or any(f <= 0 for f in self.levels) or 1.0 not in self.levels:
            raise ValueError(f"frequency levels must be > 0 and include the nominal 1.0, got {list(self.levels)}")
        if self.static_w < 0 or self.dynamic_w < 0:
            raise ValueError(f"power terms must be >= 0, got static_w={self.static_w}, dynamic_w={self.dynamic_w}")

    def power(self, f: float) -> float:
        return self.static_w + self.dynamic_w * f ** 3


@dataclass(frozen=True)
class FrequencyPlan:
    levels: tuple[tuple[float, ...], ...]
    """levels[d][s]: the frequency of stage s of pipeline d."""
    micro_batches: tuple[tuple[int, ...], ...]
    step_s: float
    """Predicted step time: max over pipelines of (micro-batches + stages - 1) x bottleneck."""
    energy_j: float
    """Predicted energy of one step: every device at its power for the whole step."""


def plan_frequencies(stage_s: Sequence[Sequence[float]], num_micro_batches: int,
                     model: PowerModel = PowerModel(), power_cap_w: float | None = None) -> FrequencyPlan:
    """``stage_s[d][s]``: the compute time of one micro-batch on stage s of pipeline d at nominal
    frequency (forward + backward). ``power_cap_w``: the most all devices together may draw."""
    if not stage_s or any(not p for p in stage_s) or any(t <= 0 for p in stage_s for t in p):
        raise ValueError(f"need at least one pipeline, each with stages of time > 0, got {stage_s!r}")
    cap = model.power(1.0) * sum(len(p) for p in stage_s) if power_cap_w is None else power_cap_w

    def fits(plan: FrequencyPlan) -> bool:
        return plan.energy_j / plan.step_s <= cap * (1 + 1e-9)

    best = None
    for top in sorted((f for f in model.levels if f >= 1.0), reverse=True):
        best = _plan_at(stage_s, num_micro_batches, model, [top] * len(stage_s))
        if fits(best) or top == 1.0:
            break
    raised = sorted(f for f in model.levels if f >= 1.0)
    tops = [1.0] * len(stage_s)
    while True:
        slowest = max(max(p) / f for p, f in zip(stage_s, tops))
        group = [d for d, (p, f) in enumerate(zip(stage_s, tops)) if max(p) / f >= slowest * (1 - 1e-9)]
        if any(tops[d] == raised[-1] for d in group):
            break
        for d in group:
            tops[d] = raised[raised.index(tops[d]) + 1]
        plan = _plan_at(stage_s, num_micro_batches, model, tops)
        if not fits(plan):
            break
        if _faster_or_leaner(plan, best):
            best = plan
    return best


def _faster_or_leaner(a: FrequencyPlan, b: FrequencyPlan) -> bool:
    if a.step_s < b.step_s * (1 - 1e-9):
        return True
    return a.step_s <= b.step_s * (1 + 1e-9) and a.energy_j < b.energy_j


def _plan_at(stage_s: Sequence[Sequence[float]], num_micro_batches: int, model: PowerModel,
             tops: Sequence[float]) -> FrequencyPlan:
    """Pipeline ``d``'s bottleneck stage at level ``tops[d]``; the rest as low as the step allows."""
    bottleneck = [max(p) / top for p, top in zip(stage_s, tops)]
    mbs = microbatches.balance(num_micro_batches, bottleneck, [len(p) for p in stage_s])
    slots = [len(m) + len(p) - 1 for m, p in zip(mbs, stage_s)]
    step = max(n * b for n, b in zip(slots, bottleneck))
    levels, power = [], 0.0
    # At 10^5 devices most pipelines are alike: each distinct one is worked out once.
    seen: dict[tuple, tuple[tuple[float, ...], float]] = {}
    for p, n, top in zip(stage_s, slots, tops):
        key = (tuple(p), n, top)
        if key not in seen:
            usable = sorted(f for f in model.levels if f <= top)
            allowed = step / n  # per-micro-batch time this pipeline may take without delaying the step
            row = tuple(next(f for f in usable if t / f <= allowed * (1 + 1e-9)) for t in p)
            seen[key] = (row, sum(model.power(f) for f in row))
        row, watts = seen[key]
        levels.append(row)
        power += watts
    return FrequencyPlan(tuple(levels), tuple(mbs), step, step * power)


def nominal_plan(stage_s: Sequence[Sequence[float]], num_micro_batches: int,
                 model: PowerModel = PowerModel()) -> FrequencyPlan:
    """The same micro-batch balance with every device left at nominal frequency (1.0): the
    baseline a frequency plan is compared with."""
    bottleneck = [max(p) for p in stage_s]
    mbs = microbatches.balance(num_micro_batches, bottleneck, [len(p) for p in stage_s])
    step = max((len(m) + len(p) - 1) * b for m, p, b in zip(mbs, stage_s, bottleneck))
    levels = tuple(tuple(1.0 for _ in p) for p in stage_s)
    return FrequencyPlan(levels, tuple(mbs), step, step * model.power(1.0) * sum(len(p) for p in stage_s))
