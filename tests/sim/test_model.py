"""The cluster model prices the runtime's own plans: 1F1B, detours, reductions, migration."""
from dataclasses import replace

import pytest

from elaswave.pipeline.routed import plan_schedules, routed_schedules
from elaswave.plan.plan import initial_plan
from elaswave.plan.replan import replan
from elaswave.pipeline import routed
from elaswave.sim.model import ClusterModel, step_time
from elaswave.sim.moves import migration_s


def _model(layers=8, **kw):
    return ClusterModel(layer_forward_s=(0.01,) * layers, intra_node_latency_s=0.0, inter_node_latency_s=0.0, **kw)


def test_a_pipeline_step_is_1f1b_slots_times_the_slowest_stage_plus_overheads():
    plan = initial_plan(8, 2, 4, [1.0] * 8, 16, [9] * 8, 4)
    model = _model(per_microbatch_stage_s=0.002, step_overhead_s=0.1)
    est = step_time(plan, model)
    stage = 2 * 0.01 * 3 + 0.002  # two layers, forward + 2x backward, plus the fixed cost
    assert est.compute_s == pytest.approx((8 + 4 - 1) * stage)
    assert est.step_s == pytest.approx(est.compute_s + 0.1)
    assert est.samples == 16 and est.power_w == pytest.approx(8.0)


@pytest.mark.parametrize("dead_stage", [0, 1, 3])
def test_detours_are_priced_by_the_runtime_schedule_and_bounded_by_the_analytic_price(dead_stage, monkeypatch):
    plan = initial_plan(16, 4, 4, [1.0] * 8, 64, [9] * 8, 4)
    after = replan(plan, [r for r in plan.ranks if r != 4 + dead_stage], 1, 64, policy="reroute")
    routes, home = {}, {}
    for d, pipe in enumerate(after.pipelines):
        for mb in after.micro_batches[d]:
            routes[mb], home[mb] = after.route_of.get(mb, pipe), d
    _, makespan = routed_schedules(routes, home, {r: 0.02 for r in after.ranks})  # 2 layers x 0.01 s
    assert step_time(after, _model()).compute_s == pytest.approx(makespan)
    # Above the exact limit the analytic price (busiest host + one fill) stays within a fifth of it.
    monkeypatch.setattr(routed, "EXACT_MAX_RANKS", 0)
    analytic = step_time(after, _model()).compute_s
    assert analytic == pytest.approx(makespan, rel=0.2)
    assert set(plan_schedules(after)) == set(after.ranks)


def test_idle_pipelines_cost_nothing_and_their_micro_batches_are_not_counted():
    plan = initial_plan(8, 2, 4, [1.0] * 8, 16, [9] * 8, 4)
    after = replan(plan, [r for r in plan.ranks if r != 1], 1, 16, policy="drop_replica")
    before, est = step_time(plan, _model()), step_time(after, _model())
    assert est.samples == 8 and est.step_s == pytest.approx(before.step_s)


def test_a_rank_in_two_holder_groups_sums_them_one_after_the_other():
    """After a re-split a rank may hold layers of two holder groups: the runtime sums its buckets
    one after another, so with the link the bottleneck the step's collectives are the busiest
    rank's sum, not the largest group's (which priced a re-split pipeline's smaller groups as if
    they made the step shorter)."""
    from elaswave.sim.model import holder_collectives_s
    plan = initial_plan(12, 3, 4, [1.0] * 8, 24, [1000] * 8, 100)
    after = replan(plan, [r for r in plan.ranks if r != 5], 1, 24, detours=False)
    model = _model(layer_param_bytes=(4000.0,) * 8, inter_node_bytes_per_s=1e3,  # compute: a rounding error
                   overlap_param_gather=False)  # (both the sums and the all-gathers after the compute)
    groups = after.holder_groups()
    each = {h: holder_collectives_s(model, h, 4000.0 * len(ls)) for h, ls in groups.items()}
    busiest = max(sum(t for h, t in each.items() if r in h) for r in after.ranks)
    assert any(sum(r in h for h in groups) > 1 for r in after.ranks)  # some rank is in two
    assert busiest > max(each.values())
    assert step_time(after, model).collective_s == pytest.approx(busiest, rel=0.01)


def test_a_stage_sums_its_gradients_while_the_stages_before_it_still_compute():
    """A 1F1B pipeline's last stage ends its backwards S - 1 backward-times before the first: its
    sum runs in that drain, as the runtime runs it, and only the first stage's is added to the
    step (with the busiest rank's all-gathers after the optimizer). Under interleaved 1F1B a
    rank's chunk V-1 is whole long before its chunk 0, so half of even the first stage's sum runs
    during the compute."""
    from elaswave.sim.model import _holder_parts, holder_collectives_s
    plan = initial_plan(8, 2, 4, [1.0] * 8, 16, [1000] * 8, 100)
    # Stage sums take about a backward (0.04 s), the last stage's (a wide head) twice that.
    model = _model(layer_param_bytes=(400.0,) * 6 + (800.0,) * 2, intra_node_bytes_per_s=2e6,
                   gradient_bytes_factor=200.0, overlap_param_gather=False)  # the all-gathers: the next test
    est = step_time(plan, model)
    first, _ = _holder_parts(model, (0, 4), 800.0)
    _, last_gathers = _holder_parts(model, (3, 7), 1600.0)
    assert est.collective_s == pytest.approx(first + last_gathers)
    assert est.step_s == pytest.approx(est.compute_s + first + last_gathers)
    assert holder_collectives_s(model, (3, 7), 1600.0) > 1.5 * est.collective_s  # all of it, priced before
    interleaved = initial_plan(8, 2, 4, [1.0] * 8, 16, [1000] * 8, 100, virtual_stages=2)
    est2 = step_time(interleaved, replace(model, pipeline_schedule="interleaved"))
    assert len(interleaved.gradient_buckets()) == 2 * len(interleaved.holder_groups())
    _, gathers = _holder_parts(model, (3, 7), 1200.0)  # rank 3 holds layers 3 and 7 now
    assert est2.collective_s == pytest.approx(first / 2 + gathers)  # layer 0's sum alone is left
    serial = step_time(interleaved, replace(model, pipeline_schedule="interleaved", overlap_grad_reduce=False))
    assert serial.collective_s == pytest.approx(first + gathers)  # parallel.overlap_grad_reduce=false


def test_a_1f1b_stage_sums_a_layer_bucket_while_its_last_backward_runs_the_layers_below():
    """With a bucket a layer, a 1F1B stage's last backward makes its upper layer whole halfway
    (zero/watch.py): that bucket's sum starts then, and only what it has not done by the backward's
    end delays the lower layer's, which starts at the end."""
    from elaswave.plan.buckets import size_starts
    from elaswave.sim.model import _holder_parts
    plan = initial_plan(8, 2, 4, [1.0] * 8, 16, [1000] * 8, 100, bucket_starts=size_starts([1000] * 8, 1))
    model = _model(layer_param_bytes=(400.0,) * 8, intra_node_bytes_per_s=2e6, gradient_bytes_factor=300.0,
                   overlap_param_gather=False)
    est = step_time(plan, model)
    layer, _ = _holder_parts(model, (0, 4), 400.0)
    _, gathers = _holder_parts(model, (3, 7), 800.0)
    backward = 2 * 0.01 * 2  # rank 0's last backward: two layers, each half of it
    assert layer > backward / 2  # its sum outlasts the lower layer's backward
    assert est.collective_s == pytest.approx(layer - backward / 2 + layer + gathers)
    serial = step_time(plan, replace(model, overlap_grad_reduce=False))
    assert serial.collective_s == pytest.approx(2 * layer + gathers)


def test_the_all_gathers_run_during_the_next_forwards_each_chunk_waiting_for_what_it_reads():
    """parallel.overlap_param_gather: a rank's all-gathers start with the step, the first layers
    first, one after another, and a forward waits before each layer for the bucket it reads. Under
    1F1B with a bucket a stage its first forward needs the whole gather, and the pipeline runs that much
    later (no gain: the stages after it gather during the fill, as before they gathered after the
    step); under interleaved 1F1B a rank's chunk 1 is gathered while its chunk 0 computes."""
    from elaswave.sim.model import _holder_parts, gather_releases
    model = _model(layer_param_bytes=(400.0,) * 8, intra_node_bytes_per_s=8e3)
    plan = initial_plan(8, 2, 4, [1.0] * 8, 16, [1000] * 8, 100)
    _, whole = _holder_parts(model, (0, 4), 800.0)  # a stage's two layers: 0.05 s, a forward's 2.5 times
    assert gather_releases(plan, model) == {r: (pytest.approx(whole),) for r in plan.ranks}
    on, off = step_time(plan, model), step_time(plan, replace(model, overlap_param_gather=False))
    assert on.compute_s == pytest.approx(off.compute_s + whole)
    assert on.step_s == pytest.approx(off.step_s)
    # A bucket a layer (parallel.bucket_numel): a stage's first forward waits for its first layer's
    # gather only, its second layer's ends while the first computes (0.01 s): that much sooner.
    _, half = _holder_parts(model, (0, 4), 400.0)
    layered = initial_plan(8, 2, 4, [1.0] * 8, 16, [1000] * 8, 100, bucket_starts=range(1, 8))
    assert gather_releases(layered, model) == {r: (pytest.approx(2 * half - 0.01),) for r in layered.ranks}
    on, off = step_time(layered, model), step_time(layered, replace(model, overlap_param_gather=False))
    assert on.step_s == pytest.approx(off.step_s - 0.01)
    interleaved = initial_plan(8, 2, 4, [1.0] * 8, 16, [1000] * 8, 100, virtual_stages=2)
    model = replace(model, pipeline_schedule="interleaved")  # one layer a chunk, a bucket a chunk
    assert gather_releases(interleaved, model) == {r: (pytest.approx(half), pytest.approx(2 * half))
                                                   for r in interleaved.ranks}
    on, off = step_time(interleaved, model), step_time(interleaved, replace(model, overlap_param_gather=False))
    assert on.step_s < off.step_s - half


def test_migration_is_the_slowest_receiver_and_nothing_when_nothing_changes():
    plan = initial_plan(8, 2, 4, [1.0] * 8, 16, [1000] * 8, 100)
    model = _model(layer_param_bytes=(4000.0,) * 8, inter_node_bytes_per_s=1e6)
    assert migration_s(plan, plan, model) == 0.0
    after = replan(plan, [r for r in plan.ranks if r != 1], 1, 16)
    # Rank 0 now holds layers 0-2 (was 0-1): one new layer's parameters, plus re-owned chunks.
    assert migration_s(plan, after, model) >= 4000.0 / 1e6


def test_a_model_of_another_depth_is_refused():
    with pytest.raises(ValueError, match="the cluster model has 4 layers, the plan 8"):
        step_time(initial_plan(2, 1, 2, [1.0] * 8, 2), _model(layers=4))


@pytest.mark.parametrize("dead", [0, 5, 6, 7, 13])
def test_the_routed_lower_bound_is_below_every_schedule_and_tight_without_detours(dead):
    """ReCycle's steps are priced at the routes' lower bound (its schedule is not modelled): the
    bound must stay under the schedule the runtime runs for the same routes, and equal 1F1B where
    no micro-batch takes a detour and the stages are even."""
    import random

    rng = random.Random(dead)
    costs = [rng.uniform(0.5, 1.5) for _ in range(8)]
    model = ClusterModel(layer_forward_s=tuple(0.01 * c for c in costs), intra_node_latency_s=0.0,
                         inter_node_latency_s=0.0)
    plan = initial_plan(16, 4, 4, costs, 32, [9] * 8, 4)
    after = replan(plan, [r for r in plan.ranks if r != dead], 1, 32, policy="reroute")
    assert after.routes
    bound = step_time(after, model, "lower_bound").compute_s
    ran = step_time(after, model).compute_s
    assert 0 < bound <= ran * (1 + 1e-12)
    # The busiest rank's work alone is a bound too: the lower bound is not looser than it.
    assert bound >= max(len(m) for m in after.micro_batches) * min(
        sum(model.layer_forward_s[i:j]) * 3 for i, j in after.layer_ranges[1])
    even = initial_plan(8, 2, 4, [1.0] * 8, 16, [9] * 8, 4)
    assert step_time(even, _model(), "lower_bound").compute_s == pytest.approx(step_time(even, _model()).compute_s)
    with pytest.raises(ValueError, match="schedule='list' is invalid"):
        step_time(even, _model(), "list")


def _uneven(pp: int, m: int, schedule: str, layers: int = 8, dp: int = 2):
    """A plan with uneven stages (random layer costs) and its model running ``schedule``, and each
    stage's forward + backward time computed here, not by the model."""
    import random

    rng = random.Random(pp * 100 + m)
    costs = [rng.uniform(0.5, 2.0) for _ in range(layers)]
    model = ClusterModel(layer_forward_s=tuple(0.01 * c for c in costs), intra_node_latency_s=0.0,
                         inter_node_latency_s=0.0, pipeline_schedule=schedule)
    plan = initial_plan(dp * pp, dp, pp, costs, dp * m, [9] * layers, 4)
    stage_s = [3 * sum(model.layer_forward_s[i:j]) for i, j in plan.layer_ranges[0]]
    return plan, model, stage_s


@pytest.mark.parametrize("pp,m", [(2, 2), (4, 4), (4, 9), (8, 16)])
def test_a_zb_h1_pipeline_is_priced_by_timing_the_runtimes_own_zb_h1_schedules(pp, m):
    """The simulator's compute of a whole pipeline is :func:`makespan` of the action lists the
    runtime runs (``zb_h1`` per stage) on the same stage times, uneven stages included; 1F1B's is
    still the 1F1B timing it was."""
    from elaswave.pipeline.schedule import makespan, one_f_one_b_makespan, zb_h1

    plan, model, stage_s = _uneven(pp, m, "zb-h1")
    assert len(set(stage_s)) > 1  # the stages are uneven
    expected = makespan([zb_h1(s, pp, range(m)) for s in range(pp)], stage_s, 2.0)
    assert step_time(plan, model).compute_s == pytest.approx(expected, rel=1e-12)
    plan, model, stage_s = _uneven(pp, m, "1f1b")
    assert step_time(plan, model).compute_s == pytest.approx(one_f_one_b_makespan(stage_s, m), rel=1e-12)


def test_reshaped_micro_batches_are_timed_at_their_sizes_under_zb_h1():
    from elaswave.pipeline.schedule import makespan, zb_h1
    from elaswave.sim.model import pipeline_compute_s

    times, sizes = (0.3, 0.5, 0.2, 0.4), (1.0, 1.0, 0.5, 1.0, 0.25)
    expected = makespan([zb_h1(s, 4, range(5)) for s in range(4)], times, 2.0, sizes=sizes)
    assert pipeline_compute_s("zb-h1", times, sizes, 2.0) == pytest.approx(expected, rel=1e-12)
    assert pipeline_compute_s("zb-h1", times, sizes, 2.0) < pipeline_compute_s("zb-h1", times, 5, 2.0)


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 8), (4, 4), (4, 16), (16, 16)])
def test_zb_h1_is_faster_than_1f1b_whenever_1f1b_has_a_bubble(pp, m):
    zb = step_time(*_uneven(pp, m, "zb-h1", layers=16)[:2]).compute_s
    one = step_time(*_uneven(pp, m, "1f1b", layers=16)[:2]).compute_s
    # No faster than the busiest stage's own work: every schedule runs it all.
    busiest = m * max(_uneven(pp, m, "1f1b", layers=16)[2])
    assert busiest <= zb < one


def test_one_stage_has_no_bubble_so_both_schedules_cost_the_same():
    plan, model, (stage,) = _uneven(1, 6, "zb-h1")
    zb = step_time(plan, model).compute_s
    one = step_time(*_uneven(1, 6, "1f1b")[:2]).compute_s
    assert zb == pytest.approx(one, rel=1e-12)
    assert zb == pytest.approx(6 * stage, rel=1e-12)  # every micro-batch back to back


def test_detours_run_the_routed_schedule_of_the_pipelines_own_schedule():
    """A plan with detours is priced by the routed schedule the runtime runs, each rank keeping its
    pipeline's own order with its guests in: under ZB-H1 that order's, whose held-back W passes fill
    the drain (until session 56 the same 1F1B order ran under both, at the same price)."""
    from elaswave.sim.detours import routed_compute
    plan = initial_plan(16, 4, 4, [1.0] * 8, 64, [9] * 8, 4)
    after = replan(plan, [r for r in plan.ranks if r != 5], 1, 64, policy="reroute")
    assert after.routes
    zb_model = _model(pipeline_schedule="zb-h1")
    zb, one = step_time(after, zb_model).compute_s, step_time(after, _model()).compute_s
    assert zb < one
    virtual = {d: zb_model.virtual_stage_s(after, d) for d in range(len(after.pipelines))}
    factor = zb_model.split_factor(after)
    compute, ends = routed_compute(after, virtual, factor, None, "zb-h1")
    assert zb == compute
    # A rank's gradients are whole over its last W, half a backward (as gradients_whole has it for a
    # pipeline without detours): timed over a whole backward, the sums started early and a detoured
    # ZB-H1 step of Llama 3 405B read 0.995 of the one before where its compute was 0.983.
    from elaswave.sim.detours import routed_chunk_times
    w, whole = routed_chunk_times(after, virtual, ends, factor, "zb-h1"), routed_chunk_times(after, virtual, ends, factor)
    assert all(w(r)[0] == (whole(r)[0][0], pytest.approx(whole(r)[0][1] / 2)) for r in after.ranks)


def test_an_unknown_pipeline_schedule_is_one_clear_error():
    from elaswave.comm.config import SCHEDULES
    from elaswave.pipeline.schedule import GENERATORS

    assert tuple(GENERATORS) == SCHEDULES  # the simulator knows every schedule the runtime runs
    with pytest.raises(ValueError, match=r"^pipeline_schedule='zb-h2' is invalid: choose from 1f1b, zb-h1, interleaved$"):
        _model(pipeline_schedule="zb-h2")
    # ... and prices every one of them, interleaved included.
    plan = initial_plan(4, 2, 2, [1.0] * 8, 8, virtual_stages=2)
    assert step_time(plan, _model(pipeline_schedule="interleaved")).compute_s > 0
    # A plan of chunks is run by the interleaved schedule only: not priced as anything else.
    with pytest.raises(ValueError, match=r"2 model chunks a rank, which only the interleaved schedule runs; .* '1f1b'"):
        step_time(plan, _model())


@pytest.mark.parametrize("pp,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 6), (3, 2, 7), (4, 4, 4)])
def test_an_interleaved_pipeline_is_timed_on_its_own_uneven_chunks(pp, v, m):
    """The simulator's compute of an interleaved pipeline is :func:`makespan` of the runtime's
    interleaved 1F1B action lists on each virtual stage's own time (the planner's p x V chunks,
    uneven), not on a rank's time split evenly over its chunks."""
    import random

    from elaswave.pipeline.schedule import interleaved_1f1b, makespan, schedule_makespan

    rng = random.Random(pp * 100 + v * 10 + m)
    costs = [rng.uniform(0.5, 2.0) for _ in range(16)]
    model = ClusterModel(layer_forward_s=tuple(0.01 * c for c in costs), intra_node_latency_s=0.0,
                         inter_node_latency_s=0.0, pipeline_schedule="interleaved")
    plan = initial_plan(2 * pp, 2, pp, costs, 2 * m, [9] * 16, 4, virtual_stages=v)
    chunks = [3 * sum(model.layer_forward_s[i:j]) for i, j in plan.layer_ranges[0]]
    assert len(chunks) == pp * v and len(set(chunks)) > 1
    expected = makespan([interleaved_1f1b(s, pp, v, range(m)) for s in range(pp)], chunks, 2.0)
    assert step_time(plan, model).compute_s == pytest.approx(expected, rel=1e-12)
    ranks = [sum(chunks[s::pp]) for s in range(pp)]
    even = schedule_makespan("interleaved", ranks, m, 2.0, num_chunks=v)
    assert abs(expected / even - 1) > 1e-6  # the even split would price another figure


def test_interleaved_sends_go_round_the_ring_and_none_past_its_ends():
    """Rank s of p sends each chunk's activation to pipe[(s + 1) % p] and its gradient to
    pipe[s - 1], except the first virtual stage's gradient and the last one's activation; two
    devices a node: ranks 0 and 1 share one, rank 2 (and the ring's step back to 0) cross."""
    plan = initial_plan(3, 1, 3, [1.0] * 12, 6, virtual_stages=2)
    kw = dict(layer_forward_s=(0.01,) * 12, devices_per_node=2, intra_node_latency_s=0.0, inter_node_latency_s=0.0,
              intra_node_bytes_per_s=1e10, inter_node_bytes_per_s=1e9, pipeline_schedule="interleaved")
    sends = ClusterModel(activation_bytes=1e6, **kw)
    silent = ClusterModel(**kw)
    intra, inter = 1e-4, 1e-3
    # rank 0: v0 act->1; v3 act->1, grad->2 | rank 1: v1 act->2, grad->0; v4 the same
    # rank 2: v2 act->0 (round the ring), grad->1; v5 (the last) grad->1 only
    expected = {0: 2 * intra + inter, 1: 2 * inter + 2 * intra, 2: 3 * inter}
    for r, comm in expected.items():
        assert sends.stage_s(plan, r) - silent.stage_s(plan, r) == pytest.approx(comm, rel=1e-9)
    # A pipeline of one rank passes its chunks' activations to itself: no link, nothing priced.
    alone = initial_plan(2, 2, 1, [1.0] * 12, 4, virtual_stages=3)
    assert sends.stage_s(alone, 0) == pytest.approx(silent.stage_s(alone, 0), rel=1e-12)


def test_migration_counts_every_chunk_a_rank_newly_holds():
    plan = initial_plan(4, 2, 2, [1.0] * 8, 8, virtual_stages=2)
    assert not plan.chunk_owners  # no ZeRO chunks: only the layers move
    model = _model(layer_param_bytes=tuple(1000.0 * (i + 1) for i in range(8)), inter_node_bytes_per_s=1e6,
                   pipeline_schedule="interleaved")
    after = replan(plan, [0, 2, 3], 1, 8)
    assert after.virtual_stages == 2 and after.pipelines[0] == (0,)

    assert plan.chunk_ranges(0) == ((0, 2), (4, 6)) and after.chunk_ranges(0) == ((0, 4), (4, 8))
    new = {2, 3, 6, 7}  # what rank 0 did not hold in either of its chunks before
    assert migration_s(plan, after, model) == pytest.approx(sum(1000.0 * (i + 1) for i in new) / 1e6)
