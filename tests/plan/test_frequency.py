"""Frequency planning (pure): the bottleneck is raised, waiting stages are lowered, the power cap holds."""
import random

import pytest

from elaswave.plan.frequency import PowerModel, nominal_plan, plan_frequencies

MODEL = PowerModel()


def _step(plan, stage_s):
    return max((len(m) + len(p) - 1) * max(t / f for t, f in zip(p, fs))
               for m, p, fs in zip(plan.micro_batches, stage_s, plan.levels))


@pytest.mark.parametrize("seed", range(25))
def test_plan_is_consistent_no_slower_than_nominal_and_within_the_cap(seed):
    r = random.Random(seed)
    stage_s = [[r.uniform(0.5, 2.0) for _ in range(r.randint(1, 4))] for _ in range(r.randint(1, 4))]
    m = r.randint(len(stage_s), 12)
    plan = plan_frequencies(stage_s, m, MODEL)
    base = nominal_plan(stage_s, m, MODEL)
    assert plan.step_s == pytest.approx(_step(plan, stage_s))
    assert plan.step_s <= base.step_s * (1 + 1e-9)
    n = sum(len(p) for p in stage_s)
    assert plan.energy_j / plan.step_s <= MODEL.power(1.0) * n * (1 + 1e-9)
    assert sorted(x for mb in plan.micro_batches for x in mb) == list(range(m))
    # Minimal: one level lower on any stage would slow the step down.
    for d, (p, fs) in enumerate(zip(stage_s, plan.levels)):
        for s, f in enumerate(fs):
            lower = [x for x in MODEL.levels if x < f]
            if lower:
                slots = len(plan.micro_batches[d]) + len(p) - 1
                assert slots * p[s] / max(lower) > plan.step_s * (1 + 1e-9)


def test_waiting_stages_pay_for_a_raised_bottleneck():
    # One slow stage and two that mostly wait: boosting the first is paid for by slowing the others.
    stage_s = [[2.0, 0.5, 0.5]]
    plan = plan_frequencies(stage_s, 4, MODEL)
    base = nominal_plan(stage_s, 4, MODEL)
    assert plan.levels == ((1.2, 0.6, 0.6),)
    assert plan.step_s == pytest.approx(base.step_s / 1.2)
    assert plan.energy_j / plan.step_s <= MODEL.power(1.0) * 3


def test_after_a_re_partition_the_stages_that_would_wait_are_lowered():
    # Three intact 4-stage pipelines and one re-partitioned over 3 survivors (4/3 of the work each):
    # every stage is someone's bottleneck, so there is no power to boost with, but the pipelines
    # that finish early slow down -- same step time, less energy.
    intact, broken = [1.0] * 4, [4 / 3] * 3
    plan = plan_frequencies([intact, intact, intact, broken], 16, MODEL)
    base = nominal_plan([intact, intact, intact, broken], 16, MODEL)
    assert plan.step_s <= base.step_s and plan.energy_j < base.energy_j
    assert min(f for row in plan.levels for f in row) < 1.0


def test_a_tight_cap_keeps_nominal_and_bad_input_is_named():
    stage_s = [[1.0, 1.0], [2.0]]
    plan = plan_frequencies(stage_s, 4, MODEL, power_cap_w=0.0)
    assert all(f <= 1.0 for row in plan.levels for f in row)
    with pytest.raises(ValueError, match="include the nominal 1.0"):
        PowerModel(levels=(0.5, 0.8))
    with pytest.raises(ValueError, match="stages of time > 0"):
        plan_frequencies([[1.0], []], 4)


def test_only_the_slow_pipeline_is_raised_when_raising_all_would_break_the_cap():
    # The 16-rank case: 4-stage pipelines at nominal, one re-partitioned over 3 survivors. Raising
    # every pipeline's bottleneck needs power that is not there; raising the broken one alone,
    # paid for by the intact pipelines' light last stages, is.
    intact, broken = [1.0, 1.0, 1.0, 0.8], [1.25, 1.25, 1.05]
    stage_s = [intact, broken, intact, intact]
    cap = MODEL.power(1.0) * 16  # the original world at nominal
    plan = plan_frequencies(stage_s, 64, MODEL, cap)
    base = nominal_plan(stage_s, 64, MODEL)
    assert max(plan.levels[1]) > 1.0 and all(max(row) == 1.0 for d, row in enumerate(plan.levels) if d != 1)
    assert plan.step_s < base.step_s * 0.99
    assert plan.energy_j / plan.step_s <= cap * (1 + 1e-9)
