"""Re-planning by measured speeds: the cheap bound never hides a gain the full re-plan would find."""
import pytest

from elaswave.plan.plan import initial_plan
from elaswave.plan.rebalance import rebalance_gain

M = 32


def _plan():
    return initial_plan(16, 4, 4, [1.0] * 8, M, [64] * 8, 16)


def test_even_speeds_are_answered_by_the_bound_without_a_re_plan():
    plan = _plan()
    even = {r: 10.0 for r in plan.ranks}
    bound, candidate = rebalance_gain(plan, even, M, min_gain=0.3)
    assert candidate is None and bound < 0.3
    full, _ = rebalance_gain(plan, even, M)
    assert full <= bound + 1e-12


@pytest.mark.parametrize("slow_rank, factor", [(5, 4.0), (0, 1.5), (15, 2.5)])
def test_a_straggler_gets_the_same_answer_with_the_bound_first(slow_rank, factor):
    plan = _plan()
    speeds = {r: 10.0 / (factor if r == slow_rank else 1.0) for r in plan.ranks}
    full, full_plan = rebalance_gain(plan, speeds, M)
    for min_gain in (0.05, 0.3, 0.6):
        gain, candidate = rebalance_gain(plan, speeds, M, min_gain=min_gain)
        if full >= min_gain:  # the bound must not have stopped it
            assert candidate == full_plan and gain == pytest.approx(full)
        else:
            assert candidate is None or gain == pytest.approx(full)
            assert gain >= full - 1e-12  # the bound is an upper bound
