import itertools
import random

import pytest

from elaswave.plan.memory import MIB, OPTIMIZER_BYTES, STATE_BYTES, MemoryModel, rank_bytes
from elaswave.plan.partition import PartitionError, least_memory, partition
from elaswave.plan.plan import Plan, PlanError, initial_plan
from elaswave.plan.replan import replan

NUMELS = (64, 128, 128, 128, 128, 64)
ACT = (10.0, 1000.0, 1000.0, 1000.0, 1000.0, 300.0)


def _model(**kw) -> MemoryModel:
    args = dict(layer_numels=NUMELS, layer_activation_bytes=ACT, boundary_bytes=40.0, param_bytes=4, sum_bytes=0,
                chunk_numel=16, snapshots=False)
    return MemoryModel(**{**args, **kw})


def _plan(dp, pp, mbs, memory, limit=0.0):
    return initial_plan(dp * pp, dp, pp, [1.0] * len(NUMELS), mbs, NUMELS, memory.chunk_numel,
                        stage_memory_limit=limit, memory=memory)


def test_stage_i_of_a_1f1b_pipeline_keeps_up_to_pp_minus_i_micro_batches():
    m = _model()
    plan = _plan(1, 3, 8, m)  # stages of two layers each: [0,2) [2,4) [4,6)
    acts = [rank_bytes(m, plan, r)["activations"] for r in plan.ranks]
    # A send is freed once its peer must have taken it (pipeline/release.py): stage 0 has 3
    # activations out when stage 1's first gradient comes back (stage 1 took the first two before
    # its first backward); stage 1 as many activations and gradients together, stage 2 two gradients
    # (stage 1 takes the first only before it sends stage 2 its next activation). 8 micro-batches:
    # kept to the step's end they were 8, 16 and 8.
    sent = [3 * 40.0, 3 * 40.0, 2 * 40.0]
    assert acts == [3 * (10 + 1000) + sent[0], 2 * 2000 + sent[1], 1 * 1300 + sent[2]]
    few = _plan(1, 3, 1, m)  # one micro-batch: never more than one in flight
    assert rank_bytes(m, few, 0)["activations"] == 1010 + 40.0


def test_under_zb_h1_every_stage_keeps_up_to_pp_micro_batches():
    m = _model(split_backward=True)  # each held until its W, which stage s holds back s of
    plan = _plan(1, 3, 8, m)
    sent = [3 * 40.0, 3 * 40.0, 2 * 40.0]  # (as under 1F1B: B sends its gradient where the backward did)
    assert [rank_bytes(m, plan, r)["activations"] for r in plan.ranks] == [
        3 * (10 + 1000) + sent[0], 3 * 2000 + sent[1], 3 * 1300 + sent[2]]
    assert m.stage_memory(3, 1, 8)(2, 4, 6) * MIB == rank_bytes(m, plan, 2)["total"]


def test_checkpointed_layers_keep_their_input_and_hold_one_layer_again_in_the_backward():
    full = _model(recomputed=frozenset({1, 2, 3, 4}))
    plan = _plan(1, 1, 4, full)
    # One micro-batch in flight: the embedding's 10 and four inputs of 40, then the head's 300;
    # in the backward of block 4 (head freed) 10 + 3 * 40 + its 1000 again.
    assert rank_bytes(full, plan, 0)["activations"] == max(10 + 4 * 40 + 300, 10 + 3 * 40 + 1000)
    assert rank_bytes(_model(), plan, 0)["activations"] == sum(ACT)


def test_the_optimizer_share_is_per_holder_with_chunk_padding_and_two_generations():
    m = _model()
    plan = _plan(3, 1, 6, m)
    assert sum(-(-n // 16) for n in NUMELS) == 40  # chunks over 3 holders: 14, 13, 13; every slot is 14
    assert {rank_bytes(m, plan, r)["optimizer"] for r in plan.ranks} == {OPTIMIZER_BYTES * 14 * 16}
    snap = _model(snapshots=True)
    # Three buffers of rank 2's slot (13 chunks owned, 14 with the slot's padding), whose snapshot
    # it keeps; its own is sent from its state.
    assert plan.snapshot_owners(0)[0] == 2
    assert rank_bytes(snap, plan, 0)["snapshots"] == STATE_BYTES * 16 * 3 * 14


def test_the_partitioner_sees_what_rank_bytes_predicts():
    for kw in ({}, {"snapshots": True}, {"recomputed": frozenset({2, 3})}, {"sum_bytes": 8, "data_bytes": 500.0},
               {"ties": ((0, 5),), "tied_numels": (64,)}):
        m = _model(**kw)
        for dp, pp in ((1, 3), (2, 2), (2, 3)):
            plan = _plan(dp, pp, 6, m)
            fn = m.stage_memory(pp, dp, 6)
            for r in plan.ranks:
                d, s = plan.position(r)
                i, j = plan.layer_ranges[d][s]
                # Equal but for chunk padding (the partitioner divides values evenly; 16-value
                # chunks of 64-value layers make it a large share here).
                assert fn(s, i, j) * MIB == pytest.approx(rank_bytes(m, plan, r)["total"], rel=0.15), (kw, dp, pp, r)


@pytest.mark.parametrize("seed", range(20))
def test_least_memory_is_the_smallest_limit_a_partition_meets(seed):
    r = random.Random(seed)
    n, stages = r.randint(2, 7), 0
    stages = r.randint(1, n)
    m = _model(layer_numels=tuple(r.randint(1, 200) for _ in range(n)),
               layer_activation_bytes=tuple(r.random() * 3000 for _ in range(n)))
    fn = m.stage_memory(stages, 1, 8)
    brute = min(max(fn(s, a, b) for s, (a, b) in enumerate(zip((0, *cuts), (*cuts, n))))
                for cuts in itertools.combinations(range(1, n), stages - 1))
    least = least_memory(n, stages, fn)
    assert least == pytest.approx(brute)
    partition([1.0] * n, stages, memory_limit=least * (1 + 1e-9), stage_memory=fn)
    with pytest.raises(PartitionError, match=f"the least any needs is {least:.4g}"):
        partition([1.0] * n, stages, memory_limit=least * 0.999, stage_memory=fn)


def test_a_loss_re_partitions_within_the_limit_or_the_survivors_stand_by():
    m = _model(snapshots=True)
    fn = m.stage_memory
    two, one = least_memory(6, 2, fn(2, 2, 8)), least_memory(6, 1, fn(1, 2, 8))
    assert two < one
    roomy = _plan(2, 2, 8, m, limit=(one + 1e-6))
    assert replan(roomy, [0, 2, 3], 1, 8).micro_batches[0]  # rank 0 takes pipeline 0 alone
    tight = _plan(2, 2, 8, m, limit=(two + one) / 2)
    after = replan(tight, [0, 2, 3], 1, 8, detours=False)
    assert after.micro_batches[0] == () and sum(map(len, after.micro_batches)) == 8  # stands by
    with pytest.raises(PlanError, match="the least any needs is"):
        _plan(2, 2, 8, m, limit=two * 0.99)


def test_a_plan_carries_its_memory_model_to_a_joiner():
    m = _model(recomputed=frozenset({1}), ties=((0, 5),), tied_numels=(64,))
    plan = _plan(2, 2, 8, m, limit=1.0)
    again = Plan.from_doc(plan.to_doc())
    assert again == plan and again.memory == m


@pytest.mark.parametrize("seed", range(10))
def test_the_partitioners_activations_are_the_stages_exactly(seed):
    r = random.Random(seed)
    n = r.randint(2, 12)
    m = _model(layer_numels=(0,) * n, layer_activation_bytes=tuple(float(r.randint(1, 999)) for _ in range(n)),
               recomputed=frozenset(i for i in range(n) if r.random() < 0.5))
    for stages in range(1, n + 1):
        fn = m.stage_memory(stages, 1, 5)
        for s in range(stages):
            for i in range(n):
                for j in range(i + 1, n + 1):
                    want = m.activation_bytes(i, j, min(stages - s, 5), m.sends_alive(s, stages, 5))
                    assert fn(s, i, j) * MIB == pytest.approx(want), (s, i, j)


@pytest.mark.parametrize("on_gpu", [False, True])
@pytest.mark.parametrize("holders", [1, 2, 4])
def test_the_bytes_per_parameter_table_adds_up_to_what_a_rank_holds(holders, on_gpu):
    """plan/memory.bytes_per_parameter, the table of what each byte is for, against rank_bytes on a
    real plan: a rank's layers, optimizer and snapshots are its held values times the table's
    per-parameter bytes (one chunk a layer, no padding)."""
    from elaswave.plan.memory import MemoryModel, bytes_per_parameter, rank_bytes
    from elaswave.plan.plan import initial_plan

    numel = 1 << 12
    model = MemoryModel(layer_numels=(numel,) * 4, layer_activation_bytes=(0.0,) * 4, boundary_bytes=0.0,
                        param_bytes=2, sum_bytes=4, chunk_numel=numel // holders, snapshot_copies=1,
                        grad_bytes=0, snapshots_to_host=on_gpu, generation_before_to_host=on_gpu)
    plan = initial_plan(2 * holders, holders, 2, [1.0] * 4, 2 * holders, [numel] * 4, numel // holders)
    table = bytes_per_parameter(model, holders)
    got = rank_bytes(model, plan, plan.pipelines[0][0])
    held = 2 * numel  # two layers a stage
    parts = {"layers": ("weights", "gradient", "gradient sum"),
             "optimizer": ("optimizer (master, moments)", "optimizer, the generation before (a step can be redone)"),
             "snapshots": ("snapshots kept for peers (on the device)",)}
    for part, rows in parts.items():
        assert got[part] == pytest.approx(held * sum(table[r] for r in rows)), part
    # bf16 fast mode: Megatron's 2 + 4 + 12/dp, plus elasticity's own bytes (on a GPU: the
    # snapshot arriving -- its own is sent from its state; the rest waits in host memory).
    elastic = 12 * (1 if on_gpu else 3) / holders + (0 if on_gpu else 12 / holders)
    assert sum(table.values()) == pytest.approx(2 + 4 + 12 / holders + elastic)


def test_with_detours_every_send_a_rank_makes_is_counted_to_the_steps_end():
    """The reroute baseline's routed schedules free no send early: the model counts a rank's own
    micro-batches' by the layers it holds (rank 2 is last in its pipeline of three but sends onto
    a detour) and a host's guests' (ranks 7 and 11), at least what each rank's schedule sends."""
    from elaswave.pipeline.routed import plan_schedules
    from elaswave.pipeline.schedule import Op
    from elaswave.plan.replan import replan
    m = MemoryModel(layer_numels=(9,) * 8, layer_activation_bytes=(0.0,) * 8, boundary_bytes=1.0, param_bytes=2,
                    sum_bytes=4, chunk_numel=4)
    plan = initial_plan(12, 3, 4, [1.0] * 8, 12, [9] * 8, 4, memory=m)
    after = replan(plan, [r for r in range(12) if r != 3], 1, 12, policy="reroute")
    schedules = plan_schedules(after)
    for r in after.ranks:
        sent = sum(a.op in (Op.SEND_ACT, Op.SEND_GRAD) and a.peer != r for a in schedules.get(r, []))
        assert rank_bytes(m, after, r)["activations"] >= sent > 0, r
    assert rank_bytes(m, after, 2)["activations"] == 8.0


@pytest.mark.parametrize("lost", [0, 1, 2, 3])
def test_with_detours_a_rank_holds_no_more_micro_batches_at_once_than_the_model_counts(lost):
    """A broken pipeline's survivor runs 1F1B at its place in the whole layout (a survivor before
    the lost stage keeps as many micro-batches alive as before the loss, not as in a shorter
    pipeline), and a host its own plus the guests whose places are close (pipeline/routed.py)."""
    from elaswave.pipeline.routed import guests_in_flight, layout_stage, plan_schedules
    from elaswave.pipeline.schedule import Op
    from elaswave.plan.replan import replan
    m = MemoryModel(layer_numels=(9,) * 8, layer_activation_bytes=(1.0,) * 8, boundary_bytes=1.0, param_bytes=2,
                    sum_bytes=4, chunk_numel=4)
    plan = initial_plan(16, 4, 4, [1.0] * 8, 32, [9] * 8, 4, memory=m)
    after = replan(plan, [r for r in range(16) if r != 4 + lost], 1, 32, policy="reroute")
    tight = 0
    for r, actions in plan_schedules(after).items():
        alive = peak = 0
        for a in actions:
            alive += (a.op is Op.FORWARD) - (a.op is Op.BACKWARD)
            peak = max(peak, alive)
        d, s = after.position(r)
        at, whole = layout_stage(after, r, s, len(after.pipelines[d]))
        counted = m.in_flight(at, whole, len(after.micro_batches[d])) + guests_in_flight(after, r, whole - at)
        assert peak <= counted, (r, peak, counted)
        tight += peak == counted
    assert tight >= len(after.ranks) // 2
