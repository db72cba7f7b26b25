"""The straggler decision (pure): the same speeds give every rank the same answer."""
from elaswave.plan.plan import initial_plan
from elaswave.runtime.straggler import WINDOW, SpeedWindow

PLAN = initial_plan(4, 2, 2, [1.0, 2.0, 2.0, 2.0, 2.0, 1.0], 8, [100] * 6, 10)


def _window(speeds, steps=WINDOW, epoch=0):
    w = SpeedWindow()
    for _ in range(steps):
        w.add(epoch, speeds)
    return w


def test_a_slow_rank_is_rebalanced_only_with_a_full_window_of_its_epoch():
    slow = {0: 10.0, 1: 3.0, 2: 10.0, 3: 10.0}
    assert _window(slow).straggles(PLAN, 8, 0.3) > 0.3
    assert _window(slow, steps=WINDOW - 1).straggles(PLAN, 8, 0.3) == 0.0
    assert _window(slow, epoch=1).straggles(PLAN, 8, 0.3) == 0.0  # the window is of another epoch
    assert _window(slow).straggles(PLAN, 8, 0.0) == 0.0  # 0: never


def test_even_speeds_and_one_noisy_step_do_not_trigger_it():
    even = {0: 10.0, 1: 10.0, 2: 10.0, 3: 10.0}
    w = _window(even)
    w.add(0, {0: 10.0, 1: 1.0, 2: 10.0, 3: 10.0})  # one slow step: the median ignores it
    assert w.straggles(PLAN, 8, 0.3) == 0.0
    assert w.median(1) == 10.0
