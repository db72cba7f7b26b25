"""The planner's recomputation (train.activation_checkpointing=auto): each rank recomputes the
fewest blocks that fit the memory limit, chosen again at every re-plan."""
from dataclasses import replace

import pytest

from elaswave.plan.memory import MIB, MemoryModel, rank_bytes, stages_memory
from elaswave.plan.plan import Plan, PlanError, initial_plan
from elaswave.plan.replan import replan
from elaswave.plan.recompute import every_block, refitted

COSTS = [0.1] + [1.0] * 8 + [0.5]  # embedding, 8 blocks, head
NUMELS = [64] * 10
MEMORY = MemoryModel(layer_numels=tuple(NUMELS), layer_activation_bytes=(1.0 * MIB,) + (100.0 * MIB,) * 8 + (50.0 * MIB,),
                     boundary_bytes=10.0 * MIB, param_bytes=4, sum_bytes=8, chunk_numel=16, snapshots=False,
                     plan_recomputation=True)


def _plan(limit_mib: float, dp=1, pp=2, v=1, mbs=8, memory=MEMORY) -> Plan:
    return initial_plan(dp * pp, dp, pp, COSTS, mbs, NUMELS, chunk_numel=16, stage_memory_limit=limit_mib,
                        memory=memory, virtual_stages=v)


def _peak(plan: Plan, rank: int, recomputed=None) -> float:
    """``rank``'s modelled peak, recomputing ``recomputed`` (default: what the plan chose for it)."""
    if recomputed is not None:
        plan = replace(plan, recomputed=tuple(tuple(tuple(sorted(recomputed)) for _ in p) for p in plan.pipelines))
    return rank_bytes(MEMORY, plan, rank)["total"] / MIB


def _mine(plan: Plan, rank: int) -> set[int]:
    mine = set(plan.recomputed_of(rank))
    assert mine <= {i for a, b in plan.chunk_ranges(rank) for i in range(a, b)}, "only blocks it runs"
    return mine


@pytest.mark.parametrize("v", [1, 2])
def test_each_rank_recomputes_the_fewest_blocks_that_fit(v):
    free = _plan(0.0, v=v)  # no limit: nothing recomputed
    assert free.recomputed == ()
    # A limit that the first rank (more micro-batches in flight) meets only by recomputing some blocks.
    first = {i for a, b in free.chunk_ranges(0) for i in range(a, b) if 0 < i < 9}
    limit = _peak(free, 0, set(sorted(first)[:2]))
    plan = _plan(limit, v=v)
    assert all(_peak(plan, r) <= limit for r in plan.ranks)
    assert _mine(plan, 0) and len(_mine(plan, 0)) >= len(_mine(plan, 1))
    for r in plan.ranks:  # the fewest: give back any one of its blocks and the rank no longer fits
        for i in _mine(plan, r):
            assert _peak(plan, r, _mine(plan, r) - {i}) > limit
    assert Plan.from_doc(plan.to_doc()).recomputed == plan.recomputed
    # A tighter limit recomputes more; past every block the plan is refused, naming the rank.
    tighter = _plan(limit - 60, v=v)
    assert sum(len(_mine(tighter, r)) for r in plan.ranks) > sum(len(_mine(plan, r)) for r in plan.ranks)
    if v > 1:  # (one chunk a rank: below this the partition moves layers, as full does: the next test)
        with pytest.raises(PlanError, match="rank 0 would hold .* every block it runs recomputed.*, over the limit"):
            _plan(_peak(free, 0, first) - 1, v=v)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_auto_fits_wherever_full_does(schedule):
    """Where the partition by cost would pass the limit even with every block recomputed (the first
    stage keeps more micro-batches in flight), auto partitions as full does, within the limit at
    every block recomputed, and recomputes no more than full; it is refused only where full is."""
    memory = MEMORY if schedule == "1f1b" else replace(
        MEMORY, split_backward=True, layer_held_for_w_bytes=(0.0,) + (30.0 * MIB,) * 8 + (0.0,))
    full = replace(memory, plan_recomputation=False, recomputed=frozenset(range(1, 9)))
    free = _plan(0.0, memory=memory)
    limit = max(rank_bytes(memory, every_block(free), r)["total"] for r in free.ranks) / MIB - 1
    plan, fixed = _plan(limit, memory=memory), _plan(limit, memory=full)
    assert plan.layer_ranges == fixed.layer_ranges != free.layer_ranges
    assert all(rank_bytes(memory, plan, r)["total"] <= limit * MIB for r in plan.ranks)
    for r in plan.ranks:  # no more than full, and every block it recomputes is needed
        for i in _mine(plan, r):
            fewer = tuple(tuple(tuple(sorted(_mine(plan, q) - {i})) for q in p) for p in plan.pipelines)
            assert rank_bytes(memory, replace(plan, recomputed=fewer), r)["total"] > limit * MIB
    stage = stages_memory(full, 2, 1, 8)  # what full's partition weighs: its best split needs least
    least = min(max(stage(0, 0, k), stage(1, k, 10)) for k in range(1, 10))
    for m in (memory, full):  # a MiB short of that: both refused
        with pytest.raises(PlanError, match="does not fit"):
            _plan(least - 1, memory=m)


def test_after_a_loss_the_survivors_recompute_more_instead_of_standing_by():
    """dp=2 x pp=2 and rank 1 lost: rank 0 alone must hold the whole model. Recomputing, it fits
    and trains; with the same limit and nothing to recompute (a memory-aware partition), its
    pipeline stands by (at a far larger limit) and the other takes the batch."""
    free = _plan(0.0, dp=2)
    alone = replan(free, [0, 2, 3], 1, 8)
    # Between what rank 0 alone needs with every block recomputed and with none.
    limit = (_peak(alone, 0, set(range(1, 9))) + _peak(alone, 0, set())) / 2
    plan = _plan(limit, dp=2)
    assert all(_peak(plan, r) <= limit for r in plan.ranks)
    before = _mine(plan, 0)
    after = replan(plan, [0, 2, 3], 1, 8)
    assert after.micro_batches[0] and len(_mine(after, 0)) > len(before)
    assert _peak(after, 0) <= limit
    # Each rank recomputes what it needs, not what another chose: the intact pipeline's ranks keep theirs.
    assert [_mine(after, r) for r in (2, 3)] == [_mine(plan, r) for r in (2, 3)]
    # The join gives rank 0 its partner back: it recomputes what it did before the loss.
    back = replan(after, [0, 2, 3, 4], 2, 8)
    assert _mine(back, 0) == before
    # Recomputing nothing, rank 0 alone stands by even a MiB short of what it needs.
    fixed = replace(MEMORY, plan_recomputation=False)
    stood = replan(_plan(_peak(alone, 0, set()) - 1, dp=2, memory=fixed), [0, 2, 3], 1, 8)
    assert stood.micro_batches[0] == () and not stood.recomputed


def test_a_plan_refitted_after_its_snapshot_copies_change_still_fits():
    """The runtime sets the snapshot copies after planning (elastic.snapshot_copies): each rank then
    keeps more of its peers' optimizer state, and what it recomputes is chosen again to fit."""
    numels = [1 << 20] * 10  # optimizer chunks large enough for snapshots to matter beside activations
    memory = replace(MEMORY, snapshots=True, layer_numels=tuple(numels), chunk_numel=1 << 18)

    def plan_of(limit):
        return initial_plan(4, 2, 2, COSTS, 8, numels, chunk_numel=1 << 18, stage_memory_limit=limit, memory=memory)
    free = plan_of(0.0)

    def peak(plan, r):
        return rank_bytes(memory, plan, r)["total"] / MIB
    every = replace(free, recomputed=tuple(tuple(tuple(range(1, 9)) for _ in p) for p in free.pipelines))
    limit = (peak(free, 0) + peak(every, 0)) / 2
    plan = plan_of(limit)
    more = refitted(replace(plan, snapshot_copies=3))
    assert all(peak(more, r) <= limit for r in more.ranks)
    assert sum(len(more.recomputed_of(r)) for r in more.ranks) > sum(len(plan.recomputed_of(r)) for r in plan.ranks)
    stale = replace(plan, snapshot_copies=3)  # unrefitted, some rank would pass the limit
    assert any(peak(stale, r) > limit for r in stale.ranks)
