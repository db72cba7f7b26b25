"""Each epoch's expert-parallel groups, from real plans: cut among the pipelines that run one
schedule, so every member issues the same exchanges (the runs: tests/runtime/test_expert_parallel.py)."""
from elaswave.plan.plan import initial_plan
from elaswave.plan.replan import replan
from elaswave.runtime.experts import group_of


def test_groups_are_cut_among_pipelines_with_one_schedule():
    plan = initial_plan(4, 4, 1, [1.0] * 6, 8)
    assert [group_of(plan, r, 2) for r in range(4)] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [group_of(plan, r, 4) for r in range(4)] == [(0, 1, 2, 3)] * 4
    assert group_of(plan, 2, 1) == (2,)
    # 8 micro-batches over 3 survivors: 3, 3 and 2 -- the two pipelines of 3 form a group.
    after = replan(plan, [0, 1, 3], 1, 8)
    counts = {after.pipelines[p][0]: len(after.micro_batches[p]) for p in range(3)}
    alike = sorted(r for r in counts if list(counts.values()).count(counts[r]) == 2)
    odd = next(r for r in counts if r not in alike)
    assert sorted(counts.values()) == [2, 3, 3]
    assert [group_of(after, r, 4) for r in alike] == [tuple(alike)] * 2 and group_of(after, odd, 4) == (odd,)


def test_a_stage_groups_with_the_same_stage_of_pipelines_split_alike():
    plan = initial_plan(4, 2, 2, [1.0] * 6, 4)
    assert [group_of(plan, r, 2) for r in range(4)] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    after = replan(plan, [0, 1, 2], 1, 4)  # pipeline 1 lost its second stage: another schedule
    assert all(group_of(after, r, 2) == (r,) for r in after.ranks)
