"""The planner for joins: where joining ranks go, which chunks they take, and what it refuses."""
import json

import pytest

from elaswave.plan.chunks import chunks_of, rebalance_owners, round_robin_owners
from elaswave.plan.plan import Plan, PlanError, initial_plan
from elaswave.plan.replan import replan

COSTS = [1.0, 2.0, 2.0, 2.0, 2.0, 1.0]
NUMELS = [40, 80, 80, 80, 80, 40]


def _plan(dp=2, pp=4, mbs=8, **kw):
    return initial_plan(dp * pp, dp, pp, COSTS, mbs, NUMELS, chunk_numel=10, **kw)


def _loads(plan):
    return {r: len(plan.chunks_of(r)) for r in plan.ranks}


def test_a_replacement_takes_the_lost_stage_back_and_the_layout_is_whole_again():
    start = _plan()
    shrunk = replan(start, [0, 1, 2, 4, 5, 6, 7], 1, 8)  # rank 3, the last stage of pipeline 0, died
    assert shrunk.pipelines[0] == (0, 1, 2)
    grown = replan(shrunk, [0, 1, 2, 4, 5, 6, 7, 8], 2, 8)
    assert grown.pipelines == ((0, 1, 2, 8), (4, 5, 6, 7))
    assert grown.layer_ranges == start.layer_ranges
    assert sorted(len(m) for m in grown.micro_batches) == [4, 4]
    assert sorted(m for ids in grown.micro_batches for m in ids) == list(range(8))


def test_a_joiner_fills_the_gap_a_detoured_pipeline_left():
    start = _plan(dp=4, pp=4, mbs=32)
    # With four pipelines elaswave leaves rank 5's survivors in place and sends its work on detours.
    shrunk = replan(start, [r for r in start.ranks if r != 5], 1, 32)
    assert shrunk.routes and shrunk.pipelines[1] == (4, 6, 7)
    grown = replan(shrunk, [r for r in start.ranks if r != 5] + [16], 2, 32)
    assert grown.pipelines[1] == (4, 16, 6, 7)  # the joiner is stage 1, where rank 5 was
    assert grown.layer_ranges == start.layer_ranges and not grown.routes


def test_extra_ranks_form_new_pipelines_of_the_configured_depth():
    start = _plan(dp=2, pp=2, mbs=12)
    grown = replan(start, [0, 1, 2, 3, 4, 5, 6], 1, 12)
    assert grown.pipelines == ((0, 1), (2, 3), (4, 5), (6,))
    assert grown.layer_ranges[2] == start.layer_ranges[0] and grown.layer_ranges[3] == ((0, 6),)
    assert sum(len(m) for m in grown.micro_batches) == 12 and all(grown.micro_batches)


def test_joiners_take_an_even_share_of_chunks_and_only_from_their_holder_groups():
    start = _plan(dp=2, pp=2, mbs=4)
    grown = replan(start, [0, 1, 2, 3, 4, 5], 1, 4)
    for holders, layers in grown.holder_groups().items():
        counts = [sum(1 for layer in layers for o in grown.chunk_owners[layer] if o == h) for h in holders]
        assert max(counts) - min(counts) <= 1, (holders, counts)
    assert _loads(grown)[4] > 0 and _loads(grown)[5] > 0
    # A chunk moves only to a joiner: the old owners keep all the others.
    for layer, (old, new) in enumerate(zip(start.chunk_owners, grown.chunk_owners)):
        assert all(n == o or n in (4, 5) for o, n in zip(old, new))


def test_rebalance_leaves_groups_without_joiners_alone():
    owners = round_robin_owners({(0, 1): [0], (2, 3): [1]}.items(), [30, 30], 10)
    uneven = ((0, 0, 0), owners[1])
    assert rebalance_owners(uneven, {(0, 1, 9): [0], (2, 3): [1]}.items(), {9}) != uneven
    assert rebalance_owners(uneven, {(0, 1, 9): [0], (2, 3): [1]}.items(), {9})[1] == owners[1]


def test_a_join_and_a_loss_in_the_same_change():
    start = _plan(dp=2, pp=2, mbs=4)
    both = replan(start, [0, 1, 2, 4], 1, 4)  # rank 3 died as rank 4 joined: 4 takes its stage
    assert both.pipelines == ((0, 1), (2, 4)) and both.layer_ranges == start.layer_ranges


def test_joins_that_no_plan_can_take_are_refused_with_the_reason():
    start = _plan(dp=2, pp=2, mbs=2)
    with pytest.raises(PlanError, match="2 micro-batches cannot feed 3 pipelines"):
        replan(start, [0, 1, 2, 3, 4, 5], 1, 2)
    with pytest.raises(PlanError, match=r"ranks \[4\] cannot join under elastic.policy=drop_replica"):
        replan(start, [0, 1, 2, 3, 4], 1, 2, policy="drop_replica")
    tight = _plan(dp=1, pp=2, mbs=4, layer_memory=[1.0] * 6, stage_memory_limit=3.0)
    with pytest.raises(PlanError, match=r"no layout for ranks \[2\] joining"):
        replan(tight, [0, 1, 2], 1, 4)


def test_a_plan_travels_through_json_unchanged():
    plan = replan(_plan(dp=4, pp=4, mbs=32), [r for r in range(16) if r != 5], 1, 32)
    assert Plan.from_doc(json.loads(json.dumps(plan.to_doc()))) == plan


def test_joiners_without_a_measured_speed_count_as_the_median_rank():
    start = _plan(dp=2, pp=2, mbs=12)
    speeds = {0: 10.0, 1: 10.0, 2: 10.0, 3: 10.0}
    grown = replan(start, [0, 1, 2, 3, 4, 5], 1, 12, speeds=speeds)
    assert [len(m) for m in grown.micro_batches] == [4, 4, 4]
    assert chunks_of(grown.chunk_owners, 4)


def test_survivors_that_cannot_hold_the_model_stand_by_until_a_join_completes_them():
    # Each stage may hold 3 of the 6 layers: rank 0 alone cannot take pipeline 0's whole model.
    start = _plan(dp=2, pp=2, mbs=8, layer_memory=[1.0] * 6, stage_memory_limit=3.0)
    shrunk = replan(start, [0, 2, 3], 1, 8)
    assert shrunk.pipelines == ((0,), (2, 3)) and shrunk.micro_batches == ((), tuple(range(8)))
    assert shrunk.layer_ranges[0] == ((0, 3),)  # rank 0 keeps its layers (and its chunks)
    assert set(shrunk.chunks_of(0)) == set(start.chunks_of(0))
    grown = replan(shrunk, [0, 2, 3, 4], 2, 8)
    assert grown.pipelines == ((0, 4), (2, 3)) and grown.layer_ranges == start.layer_ranges
    assert sorted(len(m) for m in grown.micro_batches) == [4, 4]
    with pytest.raises(PlanError, match=r"no pipeline can hold the model: pipeline 0 is left with ranks \[0\]"):
        replan(_plan(dp=1, pp=2, mbs=8, layer_memory=[1.0] * 6, stage_memory_limit=3.0), [0], 1, 8)
