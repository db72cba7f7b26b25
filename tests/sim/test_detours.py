"""The simulator's price of a plan with detours: the runtime's routed schedule, with the gradient
sums and parameter all-gathers overlapped as the runtime overlaps them there too."""
import pytest

from elaswave.pipeline import routed
from elaswave.plan.plan import initial_plan
from elaswave.plan.replan import replan
from elaswave.sim.detours import routed_compute
from elaswave.sim.model import ClusterModel, step_time


def _model(**kw):
    return ClusterModel(layer_forward_s=(0.01,) * 8, intra_node_latency_s=0.0, inter_node_latency_s=0.0,
                        layer_param_bytes=(4000.0,) * 8, inter_node_bytes_per_s=2e5, **kw)


def test_a_detoured_plans_sums_start_within_each_ranks_last_backward():
    """A bucket a layer: the upper layer's sum starts while the rank's last backward still runs
    through the lower one, as zero/watch.py starts it -- not when the step's compute has ended."""
    plan = initial_plan(16, 4, 4, [1.0] * 8, 32, [9] * 8, 4, bucket_starts=tuple(range(8)))
    after = replan(plan, [r for r in plan.ranks if r != 7], 1, 32, policy="reroute")
    assert after.routes
    on, off = step_time(after, _model()), step_time(after, _model(overlap_grad_reduce=False))
    assert on.compute_s == pytest.approx(off.compute_s)
    assert on.compute_s <= on.step_s < off.step_s - 0.001


def test_an_interleaved_detoured_plans_chunk_sums_start_after_that_chunks_last_backward():
    """With model chunks a rank's later chunk is done long before its first: its sum runs while the
    first still computes, on a detoured plan as on any (sim.model._whole_at)."""
    from dataclasses import replace
    plan = initial_plan(16, 4, 4, [1.0] * 8, 32, [9] * 8, 4, bucket_starts=tuple(range(8)), virtual_stages=2)
    after = replan(plan, [r for r in plan.ranks if r != 6], 1, 32, policy="reroute")
    assert after.routes and all(len(route) == 8 for _, route in after.routes)
    model = replace(_model(), pipeline_schedule="interleaved")
    on, off = step_time(after, model), step_time(after, replace(model, overlap_grad_reduce=False))
    assert on.compute_s == pytest.approx(off.compute_s)
    assert on.compute_s <= on.step_s < off.step_s - 0.001


def test_a_routed_price_is_the_schedules_timing_with_each_rank_waiting_for_its_all_gathers():
    plan = initial_plan(16, 4, 4, [1.0] * 8, 32, [9] * 8, 4)
    after = replan(plan, [r for r in plan.ranks if r != 5], 1, 32, policy="reroute")
    virtual = {d: (0.06,) * len(pipe) for d, pipe in enumerate(after.pipelines)}
    span, ends = routed_compute(after, virtual, 2.0, None)
    assert span == pytest.approx(max(max(t) for t in ends.values()))
    late, _ = routed_compute(after, virtual, 2.0, {r: (0.05 if r == after.pipelines[0][0] else 0.0,) for r in after.ranks})
    assert span < late <= span + 0.05 + 1e-9
    routes, home = routed.routes_of(after.pipelines, after.micro_batches, after.route_of)
    assert routed_compute(after, virtual, 2.0, None)[0] == routed.routed_schedules(routes, home, {r: 0.02 for r in after.ranks})[1]


def test_reroutes_bound_on_interleaved_pipelines_counts_each_hosts_guest_chunks_and_no_schedule_beats_it():
    """Each lost chunk on a host costs the host what its own chunk of that place does; before its
    first computation a rank waits at least for the chunks before it on the cheapest route."""
    from dataclasses import replace
    from elaswave.sim.detours import routed_lower_bound
    costs = [1.0, 2.0, 1.0, 1.5, 1.0, 1.0, 3.0, 1.0]
    model = replace(_model(), layer_forward_s=tuple(0.01 * c for c in costs), pipeline_schedule="interleaved")
    plan = initial_plan(16, 4, 4, costs, 32, [9] * 8, 4, virtual_stages=2)
    virtual = {d: model.virtual_stage_s(plan, d) for d in range(4)}
    stage = {r: sum(virtual[d][s::4]) for d, pipe in enumerate(plan.pipelines) for s, r in enumerate(pipe)}
    # No detours: the busiest rank's micro-batches after the first chunks of the ranks before it.
    assert routed_lower_bound(plan, stage, virtual) == pytest.approx(max(
        8 * stage[r] + sum(virtual[d][:s]) for d, pipe in enumerate(plan.pipelines) for s, r in enumerate(pipe)))
    after = replan(plan, [r for r in plan.ranks if r != 6], 1, 32, policy="reroute")
    virtual = {d: model.virtual_stage_s(after, d) for d in range(len(after.pipelines))}
    stage = {r: sum(virtual[d][s::len(pipe)]) for d, pipe in enumerate(after.pipelines) for s, r in enumerate(pipe)}
    guests: dict[int, float] = {}
    for _, route in after.routes:
        for v, r in enumerate(route):
            d, s = after.position(r)
            if r not in after.pipelines[1]:  # pipeline 1 lost rank 6 (its stage 2)
                guests[r] = guests.get(r, 0.0) + virtual[d][v // 4 * 4 + s]
    assert guests and all(after.position(r)[1] == 2 for r in guests)
    bound = routed_lower_bound(after, stage, virtual)
    assert bound >= max(8 * stage[r] + g for r, g in guests.items()) - 1e-12
    assert bound <= step_time(after, model).compute_s
