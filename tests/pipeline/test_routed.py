"""Routed schedules (the reroute baseline): 1F1B when nothing is detoured, deadlock-free and
complete when a broken pipeline's micro-batches pass through other pipelines."""
import pytest

from elaswave.pipeline.routed import check_deadlock_free, plan_schedules, routed_schedules
from elaswave.pipeline.schedule import Action, DeadlockError, Op, one_f_one_b
from elaswave.plan.plan import initial_plan
from elaswave.plan.replan import replan


def _layout(dp, pp, m):
    routes = {mb: tuple(d * pp + s for s in range(pp)) for d in range(dp) for mb in range(d * m, (d + 1) * m)}
    return routes, {mb: mb // m for mb in routes}


def _compute(actions):
    return [(a.op, a.micro_batch) for a in actions if a.op in (Op.FORWARD, Op.BACKWARD)]


@pytest.mark.parametrize("dp,pp,m", [(1, 4, 8), (2, 3, 5), (3, 2, 1)])
def test_without_detours_it_is_1f1b(dp, pp, m):
    routes, home = _layout(dp, pp, m)
    schedules, makespan = routed_schedules(routes, home, {r: 1.0 for r in range(dp * pp)})
    for d in range(dp):
        for s in range(pp):
            assert _compute(schedules[d * pp + s]) == _compute(one_f_one_b(s, pp, range(d * m, (d + 1) * m)))
    assert makespan == pytest.approx((m + pp - 1) * 3.0)
    check_deadlock_free(schedules)


@pytest.mark.parametrize("dead_stage", [0, 1, 3])
def test_detours_run_every_micro_batch_once_and_cannot_deadlock(dead_stage):
    dp, pp, m = 4, 4, 8
    plan = initial_plan(dp * pp, dp, pp, [1.0] * 8, dp * m, [9] * 8, 4)
    dead = 1 * pp + dead_stage  # pipeline 1
    after = replan(plan, [r for r in plan.ranks if r != dead], 1, dp * m, policy="reroute")
    schedules = plan_schedules(after)
    check_deadlock_free(schedules)
    assert dead not in schedules
    done = {}
    for r, actions in schedules.items():
        for op, mb in _compute(actions):
            done.setdefault((op, mb), []).append(r)
    for mb in range(dp * m):
        route = after.route_of.get(mb, after.pipelines[mb // m])
        assert sorted(done[(Op.FORWARD, mb)]) == sorted(route)
        assert sorted(done[(Op.BACKWARD, mb)]) == sorted(route)
    # The lost stage's work is spread over the same stage of the other pipelines.
    hosts = {after.route_of[mb][dead_stage] for mb in after.micro_batches[1]}
    assert hosts == {d * pp + dead_stage for d in (0, 2, 3)}


def test_rerouting_costs_throughput_that_the_hosts_pay():
    routes, home = _layout(4, 4, 16)
    _, before = routed_schedules(routes, home, {r: 1.0 for r in range(16)})
    for i, mb in enumerate(range(16, 32)):  # pipeline 1 lost stage 1: ranks 1, 9, 13 host it
        routes[mb] = (4, (1, 9, 13)[i % 3], 6, 7)
    _, after = routed_schedules(routes, home, {r: 1.0 for r in range(16)})
    hosts_work = (16 + 6) * 3.0  # the busiest host: its own 16 micro-batches and 6 guests
    assert hosts_work <= after < before * 4 / 3 * 1.2


def test_the_checker_catches_a_deadlock():
    crossed = {0: [Action(Op.RECV_ACT, 0, 1), Action(Op.SEND_ACT, 1, 1)],
               1: [Action(Op.RECV_ACT, 1, 0), Action(Op.SEND_ACT, 0, 0)]}
    with pytest.raises(DeadlockError, match="deadlocks"):
        check_deadlock_free(crossed)
