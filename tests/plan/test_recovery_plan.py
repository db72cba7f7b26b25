"""Pure planner pieces of a recovery: chunk re-ownership, re-plan, and where to resume."""
from dataclasses import replace

import pytest

from elaswave.plan.chunks import chunks_of, reassign_owners, round_robin_owners
from elaswave.plan.plan import PlanError, initial_plan
from elaswave.plan.replan import replan
from elaswave.plan.recovery import Holding, plan_restore

NUMELS = [10, 33, 33, 7]


def _plan(dp=4, pp=1, mbs=12):
    return initial_plan(dp * pp, dp, pp, [1.0] * len(NUMELS), mbs, NUMELS, chunk_numel=4)


def test_only_the_lost_owners_chunks_move_and_load_stays_even():
    plan = _plan()
    after = replan(plan, [0, 1, 3], 1, 12)
    for layer, (old, new) in enumerate(zip(plan.chunk_owners, after.chunk_owners)):
        for o, n in zip(old, new):
            assert n == o if o != 2 else n in (0, 1, 3)
    counts = [len(chunks_of(after.chunk_owners, r)) for r in (0, 1, 3)]
    assert max(counts) - min(counts) <= 1
    assert sum(counts) == sum(-(-n // 4) for n in NUMELS)


def test_replan_keeps_the_global_batch_and_its_ids():
    after = replan(_plan(), [0, 1, 3], 1, 12)
    ids = sorted(m for mbs in after.micro_batches for m in mbs)
    assert ids == list(range(12))
    assert after.ranks == (0, 1, 3) and after.epoch == 1
    assert sorted(len(m) for m in after.micro_batches) == [4, 4, 4]


def test_replan_balances_micro_batches_by_speed():
    after = replan(_plan(), [0, 1, 3], 1, 12, speeds={0: 1.0, 1: 1.0, 3: 2.0})
    assert [len(m) for m in after.micro_batches] == [3, 3, 6]


def test_drop_replica_baseline_skips_the_dead_ranks_micro_batches():
    plan = _plan()
    after = replan(plan, [0, 1, 3], 1, 12, policy="drop_replica")
    assert after.num_micro_batches == 9
    assert after.micro_batches == (plan.micro_batches[0], plan.micro_batches[1], plan.micro_batches[3])


def test_a_broken_pipeline_goes_on_re_partitioned_over_its_survivors():
    plan = initial_plan(6, 2, 3, [1.0, 2.0, 2.0, 2.0, 2.0, 1.0], 16, [9] * 6, 4)
    after = replan(plan, [0, 2, 3, 4, 5], 1, 16)  # rank 1, the middle stage of pipeline 0, died
    assert after.pipelines == ((0, 2), (3, 4, 5))
    assert after.layer_ranges[1] == plan.layer_ranges[1]  # the intact pipeline keeps its layout
    assert after.layer_ranges[0] == ((0, 3), (3, 6))  # minimax over two stages: 5 and 5
    # Every layer is held once per pipeline; the global batch and its ids are kept, and the
    # two-stage pipeline (bottleneck 5) gets fewer micro-batches than the three-stage one (4).
    assert all(len(after.holders(layer)) == 2 for layer in range(6))
    assert sorted(m for mbs in after.micro_batches for m in mbs) == list(range(16))
    assert len(after.micro_batches[0]) < len(after.micro_batches[1])
    # Chunks stay with owners that still hold their layer; each chunk has a holder as owner.
    for layer, (old, new) in enumerate(zip(plan.chunk_owners, after.chunk_owners)):
        for o, n in zip(old, new):
            assert n in after.holders(layer)
            if o in after.holders(layer):
                assert n == o


def test_a_pipeline_that_lost_every_rank_is_gone():
    plan = _plan(dp=2, pp=2, mbs=4)
    after = replan(plan, [2, 3], 1, 4)
    assert after.pipelines == ((2, 3),) and after.micro_batches == ((0, 1, 2, 3),)


def test_drop_replica_idles_a_broken_pipeline():
    plan = initial_plan(6, 3, 2, [1.0] * 4, 12, [9] * 4, 4)
    after = replan(plan, [0, 2, 3, 4, 5], 1, 12, policy="drop_replica")  # rank 1 (pipeline 0) died
    assert after.pipelines == ((0,), (2, 3), (4, 5))
    assert after.layer_ranges[0] == ((0, 2),) and not after.is_complete(0)
    assert after.micro_batches == ((),) + plan.micro_batches[1:]
    assert after.num_micro_batches == 8 and after.routes == ()
    # Rank 0 still holds (and may own chunks of) its layers; rank 1's layers are held by the others.
    assert after.holders(0) == (0, 2, 4) and after.holders(3) == (3, 5)


def test_reroute_sends_a_broken_pipelines_micro_batches_through_the_others():
    plan = initial_plan(9, 3, 3, [1.0] * 6, 12, [9] * 6, 4)
    after = replan(plan, [0, 2, 3, 4, 5, 6, 7, 8], 1, 12, policy="reroute")  # rank 1 died
    assert after.micro_batches == plan.micro_batches  # every micro-batch keeps its pipeline
    assert after.num_micro_batches == 12
    routes = after.route_of
    assert sorted(routes) == list(plan.micro_batches[0])
    # Own survivors at stages 0 and 2; the middle stage alternates between ranks 4 and 7.
    assert [routes[mb] for mb in sorted(routes)] == [(0, 4, 2), (0, 7, 2), (0, 4, 2), (0, 7, 2)]


def test_pipeline_replans_give_clear_errors():
    plan = _plan(dp=2, pp=2, mbs=4)
    for policy in ("drop_replica", "reroute"):
        with pytest.raises(PlanError, match=f"policy={policy} needs a pipeline that still holds every layer"):
            replan(plan, [0, 2], 1, 4, policy=policy)
    with pytest.raises(PlanError, match="2 micro-batches cannot feed 3 pipelines"):
        replan(initial_plan(6, 3, 2, [1.0] * 4, 3, [9] * 4, 4), [0, 2, 4], 1, 2)


def test_snapshot_ring():
    plan = _plan()
    assert [plan.snapshot_holders(r)[0] for r in range(4)] == [1, 2, 3, 0]
    assert [plan.snapshot_owners(r)[0] for r in range(4)] == [3, 0, 1, 2]


def test_snapshot_copies_go_to_the_next_ranks_and_shrink_with_the_epoch():
    plan = replace(_plan(), snapshot_copies=2)
    assert [plan.snapshot_holders(r) for r in range(4)] == [(1, 2), (2, 3), (3, 0), (0, 1)]
    assert [plan.snapshot_owners(r) for r in range(4)] == [(3, 2), (0, 3), (1, 0), (2, 1)]
    two = replan(plan, [0, 2], 1, 4)  # one peer left each: one copy, and the copies setting carried on
    assert two.snapshot_copies == 2 and two.snapshot_holders(0) == (2,) and two.snapshot_owners(2) == (0,)


def test_snapshots_leave_their_host_so_a_lost_host_is_a_recovery_from_memory():
    plan = replace(initial_plan(6, 3, 2, [1.0] * 4, 12, NUMELS, chunk_numel=4), ranks_per_node=2)  # 3 hosts
    for r in plan.ranks:
        assert plan.snapshot_holders(r)[0] // 2 != r // 2 and plan.snapshot_owners(plan.snapshot_holders(r)[0])[0] == r
    lost = {2, 3}  # the second host, a whole pipeline
    gens = {r: (5,) for r in plan.ranks}
    new = replan(plan, [0, 1, 4, 5], 1, 12)
    assert new.ranks_per_node == 2  # the next epoch's ring leaves its host too
    restore = plan_restore(plan.chunk_owners, new.chunk_owners, _holdings(plan, gens, gens, lost))
    assert restore.resume_step == 5 and not restore.is_fallback
    one_host = replace(plan, ranks_per_node=0)  # the ring in rank order: rank 2's holder is 3, lost with it
    assert plan_restore(plan.chunk_owners, new.chunk_owners, _holdings(one_host, gens, gens, lost)).is_fallback


def _holdings(plan, gens_own, gens_held, lost):
    out = []
    for r in plan.ranks:
        if r in lost:
            continue
        mine = chunks_of(plan.chunk_owners, r)
        owner = plan.snapshot_owners(r)[0]
        held = chunks_of(plan.chunk_owners, owner)
        out.append(Holding(r, {g: mine for g in gens_own[r]}, {g: held for g in gens_held.get(r, ())}))
    return out


def test_resume_at_newest_generation_every_chunk_has():
    plan = _plan()
    new = replan(plan, [0, 1, 3], 1, 12)
    # Rank 1 already updated (has 12, 13); the others not (11, 12); rank 3 holds rank 2's 11 and 12.
    own = {0: (11, 12), 1: (12, 13), 3: (11, 12)}
    held = {0: (12,), 1: (11, 12), 3: (11, 12)}
    restore = plan_restore(plan.chunk_owners, new.chunk_owners, _holdings(plan, own, held, [2]))
    assert restore.resume_step == 12 and not restore.is_fallback
    lost = chunks_of(plan.chunk_owners, 2)
    assert all(restore.sources[k] == (3, "held") for k in lost)
    transfers = restore.transfers(new.chunk_owners)
    # Disjoint: rank 3 sends each survivor a distinct part; nothing else moves.
    assert set(transfers) == {(3, 0), (3, 1)}
    sent = [k for keys in transfers.values() for k in keys]
    assert len(sent) == len(set(sent))
    assert set(sent) | {k for k in lost if new.chunk_owners[k[0]][k[1]] == 3} == set(lost)


def test_owner_and_holder_dying_together_is_a_loud_fallback():
    plan = _plan()
    new = replan(plan, [0, 1], 1, 12)
    own = {0: (11, 12), 1: (11, 12)}
    held = {0: (11, 12), 1: (11, 12)}  # rank 2's snapshot was on rank 3, which died too
    restore = plan_restore(plan.chunk_owners, new.chunk_owners, _holdings(plan, own, held, [2, 3]))
    assert restore.is_fallback and restore.resume_step == 0
    assert restore.unrecoverable_owners == (2,)
    assert {kind for _, kind in restore.sources.values()} == {"init"}


def test_the_fallback_takes_the_disk_checkpoint_when_there_is_one():
    plan = _plan()
    new = replan(plan, [0, 1], 1, 12)
    own = {0: (11, 12), 1: (11, 12)}
    held = {0: (11, 12), 1: (11, 12)}
    restore = plan_restore(plan.chunk_owners, new.chunk_owners, _holdings(plan, own, held, [2, 3]), disk_step=10)
    assert restore.is_fallback and restore.resume_step == 10 and restore.unrecoverable_owners == (2,)
    # Nobody has generation 10 in memory: every new owner reads its chunks from disk; nothing travels.
    assert set(restore.sources.values()) == {(None, "disk")}
    assert restore.transfers(new.chunk_owners) == {}


def test_memory_is_preferred_to_disk_when_both_have_the_generation():
    plan = _plan()
    new = replan(plan, [0, 1, 3], 1, 12)
    own = {0: (11, 12), 1: (11, 12), 3: (11, 12)}
    held = {0: (12,), 1: (12,), 3: (12,)}
    restore = plan_restore(plan.chunk_owners, new.chunk_owners, _holdings(plan, own, held, [2]), disk_step=12)
    assert restore.resume_step == 12 and not restore.is_fallback
    assert all(kind in ("own", "held") for _, kind in restore.sources.values())


def test_round_robin_matches_the_initial_rule():
    owners = round_robin_owners({(0, 1): (0, 1)}.items(), [9, 9], 4)
    assert owners == ((0, 1, 0), (1, 0, 1))
    assert reassign_owners(owners, {(1,): (0, 1)}.items()) == ((1, 1, 1), (1, 1, 1))


def test_replan_scales_to_ten_thousand_ranks():
    # Guards against anything quadratic in the number of ranks (10^5 takes < 1 s: bench/sim/planner.py).
    import time
    plan = initial_plan(10_000, 625, 16, [1.0] * 34, 2500, [1 << 20] * 34, 1 << 16)
    began = time.perf_counter()
    after = replan(plan, [r for r in plan.ranks if r != 8], 1, 2500)
    assert time.perf_counter() - began < 5.0
    assert len(after.pipelines[0]) == 15 and len(after.ranks) == 9_999


def test_partitions_keep_within_the_stage_memory_limit_or_say_why_not():
    costs, memory = [1.0] * 6, [1.0, 1.0, 1.0, 1.0, 1.0, 3.0]
    plan = initial_plan(6, 2, 3, costs, 8, [9] * 6, 4, memory, stage_memory_limit=4.0)
    after = replan(plan, [0, 2, 3, 4, 5], 1, 8)  # rank 1 died: pipeline 0 has two stages left
    # By cost alone it would be 3 + 3 layers, but the last three need 5 units: memory moves the cut.
    assert after.layer_ranges[0] == ((0, 4), (4, 6))
    # One rank cannot hold 8 units: rank 0 stands by, the other pipeline runs the whole batch.
    alone = replan(after, [0, 3, 4, 5], 2, 8)
    assert alone.micro_batches[0] == () and len(alone.micro_batches[1]) == 8
    with pytest.raises(PlanError, match="no pipeline can hold the model: pipeline 0 is left with ranks \\[0\\].*memory_limit=4.0"):
        replan(after, [0], 2, 8)
    with pytest.raises(PlanError, match="initial layout does not fit"):
        initial_plan(2, 1, 2, costs, 2, [9] * 6, 4, memory, stage_memory_limit=2.0)


@pytest.mark.parametrize("dp,expect_detours", [(16, True), (2, False)])
def test_elaswave_takes_detours_only_when_they_are_predicted_faster(dp, expect_detours):
    # Stages of cost 2, 2, 2 and 2.6 (the last is the bottleneck); stage 1 of pipeline 0 is lost.
    costs = [1.0] * 7 + [1.6]
    plan = initial_plan(4 * dp, dp, 4, costs, 8 * dp, [9] * 8, 4)
    after = replan(plan, [r for r in plan.ranks if r != 1], 1, 8 * dp)
    assert sorted(m for mbs in after.micro_batches for m in mbs) == list(range(8 * dp))
    if expect_detours:
        # 16 pipelines: re-partitioning makes pipeline 0's bottleneck 3 > 2.6, so one of its
        # micro-batches must go to a pipeline that then takes 9 x 2.6; a stage-1 host has the
        # slack for one guest (9 x 2 < 8 x 2.6). Layout kept, micro-batches on detours.
        assert after.layer_ranges == tuple(((0, 2), (4, 6), (6, 8)) if d == 0 else plan.layer_ranges[d]
                                           for d in range(dp))
        assert sorted(after.route_of) == list(plan.micro_batches[0])
    else:
        # 2 pipelines: one host would take all 8 guests; re-partitioning is faster.
        assert after.routes == () and len(after.pipelines[0]) == 3 and after.is_complete(0)


@pytest.mark.parametrize("dp,detours", [(3, False), (16, True)])
def test_under_zb_h1_detours_and_a_re_partition_are_each_timed_by_zb_h1(dp, detours):
    """The same loss as above: under 1F1B the survivors keep their layout and micro-batches take
    detours. Under ZB-H1 a re-partitioned pipeline runs ZB-H1 (its W fills the drain), and since
    session 56 so do detours (each host's ZB-H1 order with its guests' F, B and W in): with 3
    pipelines, 2 hosts take 4 guests each and re-partitioning is as fast (25.4 against 25.4 by the
    planner's timing), so it is kept; with 16, 15 hosts take one or none and the detours are faster
    (23.5 against 25.4). Until session 56 detours ran 1F1B's order under ZB-H1 too and lost both."""
    from elaswave.plan.deal import detoured_step_s
    from elaswave.plan.rates import priced_step_s, range_cost
    costs = [1.0] * 7 + [1.6]
    plan = initial_plan(4 * dp, dp, 4, costs, 8 * dp, [9] * 8, 4)
    live = [r for r in plan.ranks if r != 1]
    assert replan(plan, live, 1, 8 * dp).routes  # 1f1b, the default
    after = replan(plan, live, 1, 8 * dp, schedule="zb-h1")
    split = replan(plan, live, 1, 8 * dp, schedule="zb-h1", detours=False)
    assert split.routes == () and len(split.pipelines[0]) == 3 and split.is_complete(0)
    split_s = priced_step_s(split, dict.fromkeys(split.ranks, 1.0), "zb-h1")
    if not detours:
        assert after.routes == () and after.layer_ranges == split.layer_ranges
        return
    assert after.routes and after.pipelines[0] == (0, 2, 3)
    forward = {r: range_cost(after, i, j) for pipe, ranges in zip(after.pipelines, after.layer_ranges)
               for r, (i, j) in zip(pipe, ranges)}
    assert detoured_step_s(after.pipelines, after.micro_batches, after.routes, forward, schedule="zb-h1") < split_s
    assert sorted(m for mbs in after.micro_batches for m in mbs) == list(range(8 * dp))


def test_the_step_a_re_partition_is_weighed_by_is_the_schedules_own_timing():
    from elaswave.pipeline.schedule import makespan, one_f_one_b_makespan, zb_h1
    from elaswave.plan.deal import step_s
    stages, mbs = [[2.0, 3.0, 2.5], [2.0, 2.0]], [tuple(range(5)), tuple(range(5, 9))]
    zb = max(makespan([zb_h1(s, len(p), range(len(m))) for s in range(len(p))], p) for p, m in zip(stages, mbs))
    assert step_s(stages, mbs, schedule="zb-h1") == zb
    assert step_s(stages, mbs) == max(one_f_one_b_makespan(p, len(m)) for p, m in zip(stages, mbs)) > zb


@pytest.mark.parametrize("mbs,stands_by", [(24, True), (16, False)])
def test_a_broken_pipeline_stands_by_when_that_is_faster_than_re_splitting_it(monkeypatch, mbs, stands_by):
    """8 interleaved pipelines (V = 2) of 4 stages over 8 even layers, rank 1 lost. Re-split over 3
    ranks (6 chunks of 8 layers) the slowest holds 3 layers where an intact one holds 2; at 3
    micro-batches a pipeline its survivors standing by (keeping their layers, as a restart on whole
    pipelines would leave them) and the others taking a fourth is the faster plan, at 2 re-splitting
    is. Each plan is the faster of the two by the planner's own timing (plan.rates.priced_step_s,
    each chunk timed as its own stage: the next test). (Over 10 layers the re-split is faster at
    every count of micro-batches by that timing; by even shares of a rank's chunks it had looked
    slower at 4 a pipeline.)"""
    from elaswave.plan import replan as planner
    from elaswave.plan.rates import priced_step_s, rank_rates
    plan = initial_plan(32, 8, 4, [1.0] * 8, mbs, [8] * 8, chunk_numel=4, virtual_stages=2)
    live = [r for r in plan.ranks if r != 1]
    after = replan(plan, live, 1, mbs, schedule="interleaved", detours=False)  # (detours: the next test)
    assert sorted(m for ids in after.micro_batches for m in ids) == list(range(mbs)) and not after.routes
    assert (after.micro_batches[0] == ()) == stands_by
    if stands_by:  # the survivors keep their chunks of the old layout
        assert after.layer_ranges[0] == tuple(r for k, r in enumerate(plan.layer_ranges[0]) if k % 4 != 1)
    # The other candidate: with every plan priced alike the planner keeps the re-split one.
    monkeypatch.setattr(planner, "priced_step_s", lambda *_: 1.0)
    resplit = replan(plan, live, 1, mbs, schedule="interleaved", detours=False)
    assert resplit.micro_batches[0] and resplit.is_complete(0)
    rate = rank_rates(plan, {})
    mine, other = priced_step_s(after, rate, "interleaved"), priced_step_s(resplit, rate, "interleaved")
    assert mine < other if stands_by else mine == other


def test_an_interleaved_pipeline_that_lost_a_rank_sends_its_chunks_through_a_peer_where_that_is_fastest():
    """The same 8 x 4 pipelines, V = 2, 24 micro-batches, rank 1 lost: the lost rank's two chunks of
    each of its pipeline's 3 micro-batches go to stage 1 of six other pipelines, one chunk each,
    priced by the routed schedule the runtime runs (each chunk its own time) below standing by,
    which the planner takes without detours."""
    from elaswave.plan.rates import priced_detoured_s, priced_step_s, rank_rates
    plan = initial_plan(32, 8, 4, [1.0] * 8, 24, [8] * 8, chunk_numel=4, virtual_stages=2)
    live = [r for r in plan.ranks if r != 1]
    after = replan(plan, live, 1, 24, schedule="interleaved")
    assert len(after.routes) == 3 and after.micro_batches[0] == plan.micro_batches[0]
    assert sorted(route[v] for _, route in after.routes for v in (1, 5)) == [5, 9, 13, 17, 21, 25]
    standby = replan(plan, live, 1, 24, schedule="interleaved", detours=False)
    rate = rank_rates(plan, {})
    assert priced_detoured_s(after, rate) < priced_step_s(standby, rate, "interleaved") * (1 - 1e-3)


def test_an_interleaved_re_split_is_priced_chunk_by_chunk_as_the_simulator_times_it():
    """The planner weighs standing by against re-splitting by each model chunk's own time: taking a
    re-split rank's uneven chunks as even shares of its time read the re-split as fast as standing
    by at Llama 3 405B's 16,384 GPUs, which the simulator then timed 2 % slower. Here the planner's
    price of a re-split plan is the simulator's compute of it, and above the even shares'."""
    from elaswave.plan.deal import step_s
    from elaswave.plan.rates import priced_step_s, rank_rates, stage_times
    from elaswave.sim.model import ClusterModel, step_time
    plan = initial_plan(32, 8, 4, [1.0] * 9, 16, [8] * 9, chunk_numel=4, virtual_stages=2)
    after = replan(plan, [r for r in plan.ranks if r != 1], 1, 16, schedule="interleaved")
    assert after.micro_batches[0] and len(after.pipelines[0]) == 3  # re-split
    rate = rank_rates(plan, {})
    price = priced_step_s(after, rate, "interleaved")
    model = ClusterModel(layer_forward_s=(1.0 / 3,) * 9, intra_node_latency_s=0.0, inter_node_latency_s=0.0,
                         pipeline_schedule="interleaved")
    assert price == pytest.approx(step_time(after, model).compute_s, rel=1e-9)
    run = [d for d in range(len(after.pipelines)) if after.micro_batches[d]]
    even = step_s([stage_times(after, after.pipelines[d], after.layer_ranges[d], rate, {}) for d in run],
                  [after.micro_batches[d] for d in run], schedule="interleaved", num_chunks=2)
    assert even < price
