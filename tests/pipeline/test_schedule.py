import pytest

from elaswave.pipeline.schedule import Action, DeadlockError, Op, check_deadlock_free, one_f_one_b


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
