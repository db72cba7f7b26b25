"""Routed schedules (detours): 1F1B when nothing is detoured, deadlock-free and complete when a
broken pipeline's micro-batches pass through other pipelines, each guest in its host's 1F1B order."""
import pytest

from elaswave.pipeline import routed
from elaswave.pipeline.routed import check_deadlock_free, plan_schedules, routed_schedules
from elaswave.pipeline.schedule import (Action, DeadlockError, Op, one_f_one_b, one_f_one_b_makespan, schedule_makespan,
                                         zb_h1)
from elaswave.plan.plan import initial_plan
from elaswave.plan.replan import replan


def _layout(dp, pp, m):
    routes = {mb: tuple(d * pp + s for s in range(pp)) for d in range(dp) for mb in range(d * m, (d + 1) * m)}
    return routes, {mb: mb // m for mb in routes}


def _compute(actions):
    return [(a.op, a.micro_batch) for a in actions
            if a.op in (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)]


@pytest.mark.parametrize("dp,pp,m", [(1, 4, 8), (2, 3, 5), (3, 2, 1)])
def test_without_detours_it_is_1f1b(dp, pp, m):
    routes, home = _layout(dp, pp, m)
    schedules, makespan = routed_schedules(routes, home, {r: 1.0 for r in range(dp * pp)})
    for d in range(dp):
        for s in range(pp):
            assert _compute(schedules[d * pp + s]) == _compute(one_f_one_b(s, pp, range(d * m, (d + 1) * m)))
    assert makespan == pytest.approx((m + pp - 1) * 3.0)
    check_deadlock_free(schedules)


@pytest.mark.parametrize("dp,pp,m", [(1, 4, 8), (2, 3, 5)])
def test_without_detours_it_is_zb_h1(dp, pp, m):
    routes, home = _layout(dp, pp, m)
    stage_s = [1.0 + 0.25 * s for s in range(pp)]
    schedules, makespan = routed_schedules(routes, home, {d * pp + s: stage_s[s] for d in range(dp) for s in range(pp)},
                                           schedule="zb-h1")
    for d in range(dp):
        for s in range(pp):
            assert _compute(schedules[d * pp + s]) == _compute(zb_h1(s, pp, range(d * m, (d + 1) * m)))
    assert makespan == pytest.approx(schedule_makespan("zb-h1", [3 * t for t in stage_s], m))
    check_deadlock_free(schedules)


def test_under_zb_h1_guests_keep_their_hosts_zb_h1_order_and_hold_their_w_back_as_the_host_does():
    """ZB-H1 pipelines (the runtime's parallel.schedule=zb-h1): each guest's F, B and W go before the
    host's own of the same place in its ZB-H1 order, so its W waits as the host's own do and fills the
    drain; the step is shorter than with the detours in 1F1B's order (whole backwards), which is what
    ran under ZB-H1 until session 56."""
    routes, home, forward = _detoured([1.0] * 4, 5, 8, 2, 3)  # pipeline 4 hosts nothing
    schedules, span = routed_schedules(routes, home, forward, schedule="zb-h1")
    check_deadlock_free(schedules)
    for s in range(4):
        assert _compute(schedules[16 + s]) == _compute(zb_h1(s, 4, range(32, 40)))
    for d in (1, 2, 3):
        ops, own = _compute(schedules[d * 4 + 2]), list(range(d * 8, d * 8 + 8))
        assert [x for x in ops if x[1] in own] == _compute(zb_h1(2, 4, own))
        guests = [x for x in ops if x[1] not in own]
        assert guests == [x for x in _compute(zb_h1(2, 4, range(8))) if x[1] % 3 == d - 1]  # its home's order
        for j in range(d - 1, 8, 3):  # before the host's own of the same place
            for op in (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT):
                assert ops[ops.index((op, own[j])) - 1] == (op, j)
    assert span < routed_schedules(routes, home, forward)[1]


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


def _detoured(stages, pipelines, m, lost, hosts):
    """``pipelines`` of ``stages`` (forward + backward each), pipeline 0 lost stage ``lost``: its
    micro-batches pass through that stage of pipelines 1..hosts in turn."""
    p = len(stages)
    routes, home, forward = {}, {}, {}
    for d in range(pipelines):
        for s in range(p):
            forward[d * p + s] = stages[s] / 3
        for j in range(m):
            route = [d * p + s for s in range(p)]
            if d == 0:
                route[lost] = (1 + j % hosts) * p + lost
            routes[d * m + j], home[d * m + j] = tuple(route), d
    return routes, home, forward


def test_pipelines_no_detour_touches_run_1f1b_and_guests_go_before_their_hosts_own_of_the_same_place():
    routes, home, forward = _detoured([1.0] * 4, 5, 8, 2, 3)  # pipeline 4 hosts nothing
    schedules, _ = routed_schedules(routes, home, forward)
    check_deadlock_free(schedules)
    for s in range(4):
        assert _compute(schedules[16 + s]) == _compute(one_f_one_b(s, 4, range(32, 40)))
    for d in (1, 2, 3):
        host, own = d * 4 + 2, list(range(d * 8, d * 8 + 8))
        ops = _compute(schedules[host])
        assert [x for x in ops if x[1] in own] == _compute(one_f_one_b(2, 4, own))
        for j in range(d - 1, 8, 3):  # pipeline 0's micro-batch j is the guest of host 1 + j % 3
            for op in (Op.FORWARD, Op.BACKWARD):
                assert ops[ops.index((op, own[j])) - 1] == (op, j)


@pytest.mark.parametrize("broken,hosted,lost", [(4, 2, 0), (8, 3, 1), (2, 1, 2), (12, 6, 3)])
def test_a_broken_pipeline_dealt_more_than_its_host_keeps_its_order_among_the_hosts_guests(broken, hosted, lost):
    """Guests past the host's own count went to the end of its order and deadlocked (a rank of
    the home waiting for a backward the host ran only after a forward that rank would send later):
    the list schedule ran instead, seconds at the simulator's 95-rank sets. A guest now goes before
    the host's own computation of its place in its home's order."""
    pp = 4
    routes = {mb: tuple(pp + s if s == lost else s for s in range(pp)) for mb in range(broken)}
    routes.update({broken + j: tuple(pp + s for s in range(pp)) for j in range(hosted)})
    home = {mb: 0 if mb < broken else 1 for mb in routes}
    found = routed._inserted(routes, home, {r: 1.0 for r in range(2 * pp)}, 2.0)
    assert found is not None
    schedules = found[0]
    check_deadlock_free(schedules)
    ops = _compute(schedules[pp + lost])
    assert [x for x in ops if x[1] < broken] == _compute(one_f_one_b(lost, pp, range(broken)))
    assert [x for x in ops if x[1] >= broken] == _compute(one_f_one_b(lost, pp, range(broken, broken + hosted)))


def test_two_broken_pipelines_sharing_their_hosts_keep_one_order_of_their_guests_past_the_hosts_count():
    """Pipelines of 3 stages with 1, 3, 6 and 3 micro-batches; pipelines 2 and 3 lose stage 0 and
    send their micro-batches to ranks 0 and 3 in turn. Their guests past a host's own count used to
    go to its end home by home -- in opposite orders on the two hosts, each waiting on the other
    (found by a review): both anchorings deadlocked and the list schedule ran."""
    counts, p = (1, 3, 6, 3), 3
    routes, home, turn = {}, {}, 0
    for d, m in enumerate(counts):
        for _ in range(m):
            route = [d * p + s for s in range(p)]
            if d >= 2:
                route[0], turn = (0, 3)[turn % 2], turn + 1
            routes[len(routes)], home[len(home)] = tuple(route), d
    found = routed._inserted(routes, home, {r: 1.0 for route in routes.values() for r in route}, 2.0)
    assert found is not None
    check_deadlock_free(found[0])


def test_guests_placed_where_their_hosts_wait_cost_less_than_the_list_schedule():
    """Llama 3 405B's 1F1B stages at 16,384 GPUs as the simulator has them (the early ones
    recompute more): a stage-8 host waits for stages 1-3 a little every micro-batch, enough to
    absorb one guest; the list schedule lets the guests delay their hosts' pipelines."""
    stages = [0.2766, 0.3222, 0.3222, 0.3222, 0.3099, 0.3099, 0.2977, 0.2855] + [0.2733] * 7 + [0.2573]
    before = one_f_one_b_makespan(stages, 16)
    routes, home, forward = _detoured(stages, 17, 16, 8, 16)
    _, inserted = routed_schedules(routes, home, forward)
    _, listed, _ = routed._greedy(routes, home, forward, 2.0, routed.SPARE_IN_FLIGHT)
    assert before < inserted < before * 1.025 and inserted < listed * 0.96


def test_routes_that_share_no_rank_are_scheduled_alone():
    routes, home, forward = _detoured([1.0, 2.0, 1.0], 4, 5, 1, 2)  # pipeline 3 alone
    whole, span = routed_schedules(routes, home, forward)
    part = {mb: r for mb, r in routes.items() if home[mb] < 3}
    alone, part_span = routed_schedules(part, home, forward)
    assert all(whole[r] == alone[r] for r in alone) and part_span <= span
    assert routed.routed_timing(routes, home, forward)[0] == span


def test_a_host_holds_its_guests_at_once_only_where_their_places_are_close():
    plan = initial_plan(6, 3, 2, [1.0] * 8, 6, [9] * 8, 4)
    after = replan(plan, [r for r in plan.ranks if r != 2], 1, 6, policy="reroute")
    assert {r: routed.guests_in_flight(after, r, 2) for r in after.ranks} == {0: 1, 1: 0, 3: 0, 4: 1, 5: 0}
    plan = initial_plan(4, 2, 2, [1.0] * 8, 16, [9] * 8, 4)
    after = replan(plan, [r for r in plan.ranks if r != 0], 1, 16, policy="reroute")
    assert after.guest_places[2] == tuple((j, 0) for j in range(8))
    assert [routed.guests_in_flight(after, 2, w) for w in (1, 2, 8, 9)] == [1, 2, 8, 8]


def _survivors_hosting(draw, chunks):
    """Up to five pipelines of 2-5 stages and 1-10 micro-batches, one to three of them broken,
    each lost stage's work (chunk by chunk) on that stage of a pipeline that kept it -- which may be
    broken at another stage, so that a broken pipeline's survivor hosts too."""
    dp, p = draw.randint(2, 5), draw.randint(2, 5)
    counts = [draw.randint(1, 10) for _ in range(dp)]
    lost = {d: draw.randrange(p) for d in draw.sample(range(dp), draw.randint(1, min(3, dp - 1)))}
    routes, home = {}, {}
    for d, m in enumerate(counts):
        for j in range(m):
            route = [d * p + s for s in range(p)] * chunks
            if d in lost:
                s = lost[d]
                hosts = [e for e in range(dp) if e != d and lost.get(e) != s]
                if not hosts:
                    return None
                for c in range(chunks):
                    route[c * p + s] = (draw.choice(hosts) if draw.random() < 0.5 else hosts[(j + c) % len(hosts)]) * p + s
            routes[len(routes)], home[len(home)] = tuple(route), d
    forward = {r: tuple(draw.uniform(0.5, 1.5) for _ in range(chunks)) if chunks > 1 else draw.uniform(0.5, 1.5)
               for route in routes.values() for r in route}
    return routes, home, forward


@pytest.mark.parametrize("chunks, schedule", [(1, "1f1b"), (1, "zb-h1"), (2, "interleaved")])
def test_the_order_by_time_never_deadlocks(chunks, schedule):
    """Every rank's computations by when each ends in its home's own schedule run alone: no ring of
    waits can close, whoever hosts whom (random layouts with survivors of broken pipelines hosting)."""
    import random
    draw = random.Random(chunks)
    for _ in range(150):
        layout = _survivors_hosting(draw, chunks)
        if layout is not None:
            found = routed._inserted(*layout, 2.0, chunks, by_time=True, schedule=schedule)
            assert found is not None
            check_deadlock_free(found[0])


@pytest.mark.parametrize("chunks", [1, 2])
def test_a_survivor_that_hosts_too_is_scheduled_by_time_where_both_anchorings_deadlock(chunks):
    """Pipelines of 5 stages with 1, 7 and 4 micro-batches: pipeline 0 lost stage 1 (its
    micro-batch through rank 6, of pipeline 1), pipeline 1 lost stage 2 (through rank 2 -- pipeline
    0's survivor -- and rank 12). Both anchorings deadlock (found in random layouts): interleaved
    plans were refused. Now ordered by time; under 1F1B the list schedule too, the shorter run."""
    hosts, p = (2, 2, 2, 12, 2, 12, 2), 5
    routes, home = {}, {}
    for d, m in enumerate((1, 7, 4)):
        for j in range(m):
            route = [d * p + s for s in range(p)] * chunks
            for c in range(chunks):
                if d == 0:
                    route[c * p + 1] = 6
                elif d == 1:
                    route[c * p + 2] = hosts[(j + c) % len(hosts)]
            routes[len(routes)], home[len(home)] = tuple(route), d
    forward = {r: (1.0,) * chunks if chunks > 1 else 1.0 for route in routes.values() for r in route}
    assert routed._inserted(routes, home, forward, 2.0, chunks) is None
    schedules, span = routed_schedules(routes, home, forward, num_chunks=chunks)
    check_deadlock_free(schedules)
    forwards = [a.micro_batch for acts in schedules.values() for a in acts if a.op is Op.FORWARD]
    assert sorted(forwards) == sorted(mb for mb, route in routes.items() for _ in route)
    by_time = routed._inserted(routes, home, forward, 2.0, chunks, by_time=True)[1]
    listed = routed._greedy(routes, home, forward, 2.0, routed.SPARE_IN_FLIGHT)[1] if chunks == 1 else by_time
    assert span == min(by_time, listed)
