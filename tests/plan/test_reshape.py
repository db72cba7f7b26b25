"""Micro-batch reshaping: the global batch's units dealt so pipelines finish together."""
import pytest

from elaswave.pipeline.schedule import one_f_one_b_makespan
from elaswave.plan import microbatches
from elaswave.plan.plan import Plan, initial_plan
from elaswave.plan.replan import replan
from elaswave.sim.model import ClusterModel, step_time


def _finish(units, k, bottleneck, stages):
    return [(s - 1) * t + n * t / k for n, t, s in zip(units, bottleneck, stages)]


def test_reshape_keeps_every_unit_and_never_grows_a_micro_batch():
    ids, units = microbatches.reshape(12, 4, [1.0, 1.0, 1.3], [4, 4, 4])
    per_pipe = [sum(units[i] for i in m) for m in ids]
    assert sum(units) == 12 * 4 and sum(per_pipe) == 48
    assert all(1 <= u <= 4 for u in units)
    flat = [i for m in ids for i in m]
    assert flat == list(range(len(units)))  # contiguous ids, in pipeline order
    for m in ids:  # whole micro-batches, one smaller remainder last
        assert all(units[i] == 4 for i in m[:-1])
    assert per_pipe[2] < per_pipe[0]  # the slower pipeline gets fewer units


def test_reshape_with_one_unit_is_the_whole_micro_batch_balance():
    args = ([1.0, 1.25, 1.0, 1.1], [4, 3, 4, 4])
    ids, units = microbatches.reshape(17, 1, *args)
    assert ids == microbatches.balance(17, *args) and units == (1,) * 17


def test_units_even_out_finish_times_that_whole_micro_batches_cannot():
    """Pipelines of 16 stages, one re-partitioned 7/6 slower: whole micro-batches leave a
    micro-batch's time between them, units a unit's."""
    bottleneck, stages = [7 / 6] + [1.0] * 7, [15] + [16] * 7
    whole = [len(m) for m in microbatches.balance(8 * 32, bottleneck, stages)]
    ids, units = microbatches.reshape(8 * 32, 8, bottleneck, stages)
    per_pipe = [sum(units[i] for i in m) for m in ids]
    spread_whole = max(_finish([w * 8 for w in whole], 8, bottleneck, stages))
    spread_units = max(_finish(per_pipe, 8, bottleneck, stages))
    assert spread_units < spread_whole
    finish = _finish(per_pipe, 8, bottleneck, stages)
    assert max(finish) - min(finish) <= max(bottleneck) / 8 + 1e-9


def test_bad_reshape_input_names_the_value():
    with pytest.raises(ValueError, match="units per micro-batch must be >= 1, got 0"):
        microbatches.reshape(8, 0, [1.0], [2])
    with pytest.raises(ValueError, match="cannot give each of 3 pipelines"):
        microbatches.reshape(2, 4, [1.0] * 3, [2] * 3)


def test_makespan_with_sizes():
    times = [1.0, 1.2, 0.8, 1.0]
    assert one_f_one_b_makespan(times, 5, 2.0, [1.0] * 5) == pytest.approx(one_f_one_b_makespan(times, 5))
    doubled = one_f_one_b_makespan([2 * t for t in times], 5)
    assert one_f_one_b_makespan(times, 5, 2.0, [2.0] * 5) == pytest.approx(doubled)
    # A small last micro-batch costs less than a whole one, and more than none.
    short = one_f_one_b_makespan(times, 5, 2.0, [1, 1, 1, 1, 0.25])
    assert one_f_one_b_makespan(times, 4) < short < one_f_one_b_makespan(times, 5)
    with pytest.raises(ValueError, match="3 sizes for 5 micro-batches"):
        one_f_one_b_makespan(times, 5, 2.0, [1.0] * 3)


def _job(k, dp=8, pp=8, layers=24):
    return initial_plan(dp * pp, dp, pp, [1.0] * layers, 4 * dp * pp // 2, units_per_micro_batch=k)


def test_a_reshaped_replan_keeps_the_global_batch_and_finishes_sooner():
    model = ClusterModel(layer_forward_s=(0.01,) * 24)
    whole, shaped = _job(1), _job(4)
    m = whole.num_micro_batches
    lost = whole.pipelines[0][3]
    live = [r for r in whole.ranks if r != lost]
    after_whole = replan(whole, live, 1, m, detours=False)
    after_shaped = replan(shaped, live, 1, m, detours=False)
    assert after_shaped.batch_units == m * 4 and after_whole.batch_units == m
    assert any(u < 4 for u in after_shaped.micro_batch_units)
    t_whole, t_shaped = step_time(after_whole, model), step_time(after_shaped, model)
    assert t_shaped.samples == pytest.approx(m) and t_whole.samples == m
    assert t_shaped.step_s < t_whole.step_s
    # Never faster than the failure-free job: one device fewer, the same work.
    assert t_shaped.step_s >= step_time(shaped, model).step_s
    assert Plan.from_doc(after_shaped.to_doc()) == after_shaped


def test_a_baseline_keeps_the_units_of_the_ids_it_keeps():
    shaped = _job(4)
    live = [r for r in shaped.ranks if r != shaped.pipelines[0][3]]
    reshaped = replan(shaped, live, 1, shaped.num_micro_batches, detours=False)
    again = replan(reshaped, [r for r in live if r != reshaped.pipelines[1][0]], 2, shaped.num_micro_batches,
                   policy="drop_replica")
    assert again.micro_batch_units == reshaped.micro_batch_units
    assert again.batch_units == reshaped.batch_units - sum(reshaped.units_of(i) for i in reshaped.micro_batches[1])


def test_initial_plan_refuses_zero_units():
    with pytest.raises(ValueError, match="units_per_micro_batch=0 must be >= 1"):
        _job(0)


@pytest.mark.parametrize("seed", range(40))
def test_the_bulk_deal_gives_the_counts_of_the_greedy_a_unit_at_a_time(seed):
    """At 10^4 pipelines the deal starts from a threshold; ties and uneven speeds included."""
    import random
    rng = random.Random(seed)
    n = rng.choice([3, 17, 200, 1000])
    first = rng.choice([1, 4, 16])
    tie = rng.random() < 0.3  # many pipelines alike: equal finish times, decided by index
    each = [0.1 if tie and rng.random() < 0.7 else rng.uniform(0.01, 2.0) for _ in range(n)]
    fill = [0.0 if tie else rng.uniform(0.0, 30.0) for _ in range(n)]
    total = first * n + rng.randrange(0, 40 * n)
    one_at_a_time = microbatches._greedy([first] * n, total, each, fill)
    assert microbatches._fill(total, first, each, fill) == one_at_a_time
    if total - first * n > 4 * n:  # and the bulk start dealt all but at most one a pipeline
        assert sum(microbatches._below_threshold(total, first, each, fill)) >= total - n
