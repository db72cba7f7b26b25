import random

import pytest

from elaswave.pipeline.schedule import (Action, DeadlockError, Op, check_deadlock_free, makespan, one_f_one_b,
                                        one_f_one_b_makespan, peak_in_flight, zb_h1)


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("num_mb", [1, 2, 3, 5, 8])
def test_one_f_one_b_is_deadlock_free_and_complete(stages, num_mb):
    mbs = list(range(10, 10 + num_mb))
    scheds = [one_f_one_b(s, stages, mbs) for s in range(stages)]
    check_deadlock_free(scheds)
    for s, sched in enumerate(scheds):
        assert [a.micro_batch for a in sched if a.op is Op.FORWARD] == mbs
        assert sorted(a.micro_batch for a in sched if a.op is Op.BACKWARD) == mbs


def test_one_f_one_b_bounds_live_activations():
    sched = one_f_one_b(0, 4, list(range(8)))
    live = peak = 0
    for a in sched:
        live += (a.op is Op.FORWARD) - (a.op is Op.BACKWARD)
        peak = max(peak, live)
    assert peak == 4


def test_deadlock_is_detected():
    # Stage 1 waits for a gradient that stage 0 never sends before waiting itself.
    bad = [[Action(Op.RECV_GRAD, 0), Action(Op.FORWARD, 0), Action(Op.SEND_ACT, 0)],
           [Action(Op.RECV_ACT, 0), Action(Op.FORWARD, 0), Action(Op.BACKWARD, 0), Action(Op.SEND_GRAD, 0)]]
    with pytest.raises(DeadlockError, match="deadlocks"):
        check_deadlock_free(bad)


def test_the_general_timing_is_the_exact_1f1b_timing_on_1f1b():
    rng = random.Random(7)
    for _ in range(200):
        p, m = rng.randint(1, 6), rng.randint(1, 12)
        times = [rng.uniform(0.5, 2.0) for _ in range(p)]
        sizes = [rng.choice([0.5, 1.0, 2.0]) for _ in range(m)] if rng.random() < 0.3 else None
        general = makespan([one_f_one_b(s, p, range(m)) for s in range(p)], times, 2.0, sizes=sizes)
        assert general == pytest.approx(one_f_one_b_makespan(times, m, 2.0, sizes), rel=1e-12)


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
def test_zb_h1_is_deadlock_free_complete_and_holds_no_more_than_1f1b(stages):
    for num_mb in range(1, 2 * stages + 4):
        scheds = [zb_h1(s, stages, range(num_mb)) for s in range(stages)]
        check_deadlock_free(scheds)
        for sched in scheds:
            ops = [(a.op, a.micro_batch) for a in sched]
            for mb in range(num_mb):  # each once, in the order the gradients need
                f, b, w = (ops.index((op, mb)) for op in (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT))
                assert f < b < w
            assert len(ops) - sum(op in (Op.RECV_ACT, Op.SEND_ACT, Op.RECV_GRAD, Op.SEND_GRAD) for op, _ in ops) \
                == 3 * num_mb
            assert peak_in_flight(sched) <= min(stages, num_mb)
        assert max(map(peak_in_flight, scheds)) == max(peak_in_flight(one_f_one_b(s, stages, range(num_mb)))
                                                       for s in range(stages))


@pytest.mark.parametrize("stages,num_mb", [(2, 4), (4, 4), (4, 8), (8, 8), (8, 16)])
def test_zb_h1_leaves_a_third_of_1f1b_bubble(stages, num_mb):
    """Stages alike, the backward twice the forward and split evenly (B = W = F, the paper's
    setting): 1F1B idles (p - 1)(F + B + W) per stage, ZB-H1 a third of it."""
    times, work = [3.0] * stages, 3.0 * num_mb
    one = makespan([one_f_one_b(s, stages, range(num_mb)) for s in range(stages)], times)
    zb = makespan([zb_h1(s, stages, range(num_mb)) for s in range(stages)], times)
    assert one - work == pytest.approx(3.0 * (stages - 1))
    assert zb - work == pytest.approx((one - work) / 3)
