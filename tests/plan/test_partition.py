import itertools
import random

import pytest

from elaswave.plan import microbatches
from elaswave.plan.chunks import ChunkIndex, chunk_range, num_chunks, owner
from elaswave.plan.partition import PartitionError, max_stage_cost, partition
from elaswave.plan.plan import initial_plan


def brute_force(costs, stages):
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_partition_is_minimax_optimal_and_covers_every_layer_in_order(seed):
    r = random.Random(seed)
    n = r.randint(1, 9)
    stages = r.randint(1, n)
    costs = [r.choice([0.5, 1, 2, 3, 7]) * r.random() + 0.01 for _ in range(n)]
    ranges = partition(costs, stages)
    assert len(ranges) == stages
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(ranges, ranges[1:]))
    assert max_stage_cost(costs, ranges) == pytest.approx(brute_force(costs, stages))


def test_partition_errors_name_the_numbers():
    with pytest.raises(PartitionError, match="cannot split 3 layers into 4 stages"):
        partition([1, 1, 1], 4)
    with pytest.raises(PartitionError, match="memory_limit"):
        partition([1, 1, 1], 2, memory=[5, 5, 5], memory_limit=4)


def test_microbatches_keep_the_global_batch_and_follow_speed():
    for m, speeds in [(8, [1, 1]), (7, [1, 1, 1]), (16, [2, 1, 1]), (5, [1] * 5)]:
        out = microbatches.assign(m, speeds)
        assert sorted(x for p in out for x in p) == list(range(m))
        assert all(len(p) >= 1 for p in out)
    assert [len(p) for p in microbatches.assign(16, [2, 1, 1])] == [8, 4, 4]
    with pytest.raises(ValueError, match="3 micro-batches cannot give each of 4"):
        microbatches.assign(3, [1] * 4)


def test_chunks_are_interleaved_over_holders():
    assert num_chunks(10, 4) == 3 and chunk_range(10, 4, 2) == (8, 10)
    assert [owner((3, 5, 9), c) for c in range(5)] == [3, 5, 9, 3, 5]
    idx = ChunkIndex.build([10, 4, 9], 4)
    assert idx.offsets == (0, 3, 4) and idx.total == 7


def test_initial_plan_layout():
    plan = initial_plan(6, 3, 2, [1.0] * 6, 9)
    assert plan.pipelines == ((0, 1), (2, 3), (4, 5))
    assert plan.position(3) == (1, 1)
    assert plan.holders(0) == (0, 2, 4) and plan.holders(5) == (1, 3, 5)
    assert list(plan.holder_groups()) == [(0, 2, 4), (1, 3, 5)]
    with pytest.raises(ValueError, match="dp=2 x pp=2 = 4 must equal the world size 6"):
        initial_plan(6, 2, 2, [1.0] * 6, 4)


def _finish(counts, times, stages):
    return max((m + s - 1) * t for m, t, s in zip(counts, times, stages))


@pytest.mark.parametrize("seed", range(30))
def test_balance_is_minimax_over_1f1b_step_times(seed):
    r = random.Random(seed)
    d = r.randint(1, 4)
    times = [r.choice([0.5, 1.0, 1.5, 2.0]) for _ in range(d)]
    stages = [r.randint(1, 4) for _ in range(d)]
    m = r.randint(d, 10)
    out = microbatches.balance(m, times, stages)
    assert sorted(x for p in out for x in p) == list(range(m))
    best = min(_finish(c, times, stages) for c in itertools.product(range(1, m + 1), repeat=d) if sum(c) == m)
    assert _finish([len(p) for p in out], times, stages) == pytest.approx(best)


def test_balance_gives_a_shorter_pipeline_with_a_bigger_bottleneck_fewer_micro_batches():
    # 3-stage pipeline (bottleneck 4) and its broken twin re-partitioned over 2 stages (bottleneck 5).
    assert [len(p) for p in microbatches.balance(8, [5.0, 4.0], [2, 3])] == [4, 4]
    assert [len(p) for p in microbatches.balance(16, [5.0, 4.0], [2, 3])] == [7, 9]
