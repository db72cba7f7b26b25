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
