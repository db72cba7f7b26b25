"""Expert placement: groups of a stage's pipelines, contiguous blocks, and the minimax by load."""
import itertools
import random

import pytest

from elaswave.plan.experts import busiest_share, by_load, contiguous, groups_of, place


def test_groups_cut_the_pipelines_in_order_the_last_group_smaller():
    assert groups_of([3, 0, 2, 1], 2) == [(0, 1), (2, 3)]
    assert groups_of([0, 2, 3], 2) == [(0, 2), (3,)]
    assert groups_of([5], 4) == [(5,)]
    with pytest.raises(ValueError, match="parallel.ep=0"):
        groups_of([0, 1], 0)


def test_contiguous_blocks_as_megatron_lays_them_out():
    assert contiguous(8, 4) == (0, 0, 1, 1, 2, 2, 3, 3)
    assert contiguous(8, 3) == (0, 0, 0, 1, 1, 1, 2, 2)
    assert place(8, 1) == (0,) * 8
    assert place(4, 2, [0.0] * 4) == (0, 0, 1, 1)  # no counts yet: blocks


def test_by_load_is_optimal_on_small_cases_within_lpts_bound():
    """LPT's makespan is at most 4/3 of the optimum; on these it is found exactly or nearly."""
    rng = random.Random(0)
    for _ in range(200):
        E, n = rng.randint(2, 7), rng.randint(2, 3)
        loads = [float(rng.randint(0, 20)) for _ in range(E)]
        owners = by_load(loads, n)
        busiest = max(sum(l for l, o in zip(loads, owners) if o == m) for m in range(n))
        best = min(max(sum(l for l, o in zip(loads, assign) if o == m) for m in range(n))
                   for assign in itertools.product(range(n), repeat=E))
        assert busiest <= best * 4 / 3 + 1e-9, (loads, owners)


def test_a_hot_expert_gets_a_member_to_itself():
    loads = [100.0, 10.0, 10.0, 10.0, 10.0, 10.0]
    owners = place(6, 2, loads)
    assert [e for e, o in enumerate(owners) if o == owners[0]] == [0]
    assert busiest_share(owners, loads, 2) == pytest.approx(100 / 75)
    assert busiest_share(contiguous(6, 2), loads, 2) == pytest.approx(120 / 75)


def test_every_rank_computes_the_same_placement_from_the_same_counts():
    loads = [5.0, 5.0, 5.0, 5.0]  # ties everywhere: broken by counts, then index
    assert by_load(loads, 2) == (0, 1, 0, 1)
    with pytest.raises(ValueError, match="3 expert loads for 4 experts"):
        place(4, 2, [1.0, 2.0, 3.0])
