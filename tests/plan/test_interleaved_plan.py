"""Plans of interleaved pipelines (parallel.virtual_stages = V): p x V chunks, minimax on the layer
costs, kept interleaved on the survivors of a loss and after a join."""
from dataclasses import replace

import pytest

from elaswave.plan.chunks import chunks_of
from elaswave.plan.memory import MemoryModel, rank_bytes
from elaswave.plan.plan import PlanError, initial_plan
from elaswave.plan.replan import replan
from elaswave.plan.rebalance import rebalance_gain

COSTS = [1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 1.5]  # embedding, 8 blocks, head
NUMELS = [40, 64, 64, 64, 64, 64, 64, 64, 64, 40]


def _plan(dp=2, pp=2, v=2, mbs=8):
    return initial_plan(dp * pp, dp, pp, COSTS, mbs, NUMELS, chunk_numel=16, virtual_stages=v)


def _rank_cost(plan, rank):
    return sum(sum(COSTS[i:j]) for i, j in plan.chunk_ranges(rank))


def test_each_rank_holds_v_non_adjacent_chunks_in_megatrons_layout():
    plan = _plan()
    ranges = plan.layer_ranges[0]
    assert len(ranges) == 4 and ranges[0][0] == 0 and ranges[-1][1] == len(COSTS)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # p x V contiguous chunks, in order
    assert plan.chunk_ranges(0) == (ranges[0], ranges[2]) and plan.chunk_ranges(1) == (ranges[1], ranges[3])
    # Minimax over the four chunks: no chunk costs more than a quarter of the model and one layer.
    assert max(sum(COSTS[i:j]) for i, j in ranges) <= sum(COSTS) / 4 + max(COSTS)
    for layer in range(len(COSTS)):  # one holder a pipeline: the rank whose chunk has the layer
        assert len(plan.holders(layer)) == 2
    with pytest.raises(ValueError, match="runs 2 chunks: ask chunk_ranges"):
        plan.layers_of(0)


def test_a_loss_re_partitions_the_survivors_into_p_minus_1_times_v_chunks():
    plan = _plan()
    after = replan(plan, [0, 2, 3], 1, 8)
    assert after.virtual_stages == 2
    assert after.pipelines == ((0,), (2, 3)) and after.layer_ranges[1] == plan.layer_ranges[1]
    assert len(after.layer_ranges[0]) == 2 and after.is_complete(0)  # rank 0 alone: two chunks of its own
    assert sum(len(m) for m in after.micro_batches) == 8 and not after.routes  # no detours between layouts
    # The lone rank does the whole model's work per micro-batch; the deal gives it fewer.
    assert len(after.micro_batches[0]) < len(after.micro_batches[1])
    owned = {r: len(chunks_of(after.chunk_owners, r)) for r in after.ranks}
    assert all(owned.values())  # every survivor still owns optimizer chunks


def test_a_join_gives_the_pipeline_back_its_depth_still_interleaved():
    after = replan(_plan(), [0, 2, 3], 1, 8)
    back = replan(after, [0, 2, 3, 4], 2, 8)
    assert back.pipelines == ((0, 4), (2, 3)) and [len(r) for r in back.layer_ranges] == [4, 4]
    assert back.layer_ranges[0] == back.layer_ranges[1]


def test_a_straggler_gets_less_of_every_chunk():
    plan = _plan(dp=1, pp=2)
    gain, candidate = rebalance_gain(plan, {0: 1.0, 1: 0.4}, 8)
    assert gain > 0 and candidate.virtual_stages == 2
    assert _rank_cost(candidate, 1) < _rank_cost(plan, 1)


def test_the_memory_model_counts_every_chunk():
    memory = MemoryModel(layer_numels=tuple(NUMELS), layer_activation_bytes=tuple([1000.0] * len(COSTS)),
                         boundary_bytes=100.0, param_bytes=4, sum_bytes=4, chunk_numel=16)
    one = initial_plan(2, 1, 2, COSTS, 8, NUMELS, chunk_numel=16, memory=memory)
    two = _plan(dp=1)
    for rank in (0, 1):
        held = sorted({i for a, b in two.chunk_ranges(rank) for i in range(a, b)})
        assert rank_bytes(memory, two, rank)["layers"] == pytest.approx(memory.value_bytes * sum(NUMELS[i] for i in held))
    # Interleaving holds more micro-batch-chunks' activations at rank 0 than 1F1B's stage 0 whole ones.
    assert rank_bytes(memory, two, 0)["activations"] > 0 and rank_bytes(memory, one, 0)["activations"] > 0


def test_a_memory_limit_is_kept_on_the_interleaved_plan_or_said():
    """The p x V partition is by cost; the plan's modelled peaks are checked against the limit after."""
    memory = MemoryModel(layer_numels=tuple(NUMELS), layer_activation_bytes=tuple([1000.0] * len(COSTS)),
                         boundary_bytes=100.0, param_bytes=4, sum_bytes=4, chunk_numel=16)
    plan = initial_plan(4, 2, 2, COSTS, 8, NUMELS, chunk_numel=16, memory=memory, virtual_stages=2,
                        stage_memory_limit=1.0)  # 1 MiB: these layers need a few KiB
    need = max(rank_bytes(memory, plan, r)["total"] for r in plan.ranks) / 2 ** 20
    with pytest.raises(PlanError, match=r"the initial layout does not fit: rank \d+ would hold .* under interleaved "
                                        r"1F1B \(2 chunks\), over the limit of [0-9.]+ MiB; parallel.virtual_stages=1"):
        initial_plan(4, 2, 2, COSTS, 8, NUMELS, chunk_numel=16, memory=memory, virtual_stages=2,
                     stage_memory_limit=need * 0.99)
    # After a loss, a survivor that would hold too much as V chunks of the whole model stands by (as
    # under 1F1B when no partition fits): its pipeline gets no micro-batches, the other takes them.
    # (Weights and optimizer state dominate here, as in real models: the lone survivor holds them all.)
    heavy = replace(memory, layer_numels=tuple(10 * n for n in NUMELS), layer_activation_bytes=(10.0,) * len(COSTS),
                    boundary_bytes=1.0)
    plan = initial_plan(4, 2, 2, COSTS, 8, [10 * n for n in NUMELS], chunk_numel=16, memory=heavy, virtual_stages=2,
                        stage_memory_limit=1.0)
    free = replan(plan, [0, 2, 3], 1, 8)
    lone, others = rank_bytes(heavy, free, 0)["total"], max(rank_bytes(heavy, free, r)["total"] for r in (2, 3))
    assert lone > others * 1.1
    limited = replace(plan, stage_memory_limit=(lone + others) / 2 / 2 ** 20)
    after = replan(limited, [0, 2, 3], 1, 8)
    assert after.micro_batches[0] == () and len(after.micro_batches[1]) == 8
    assert after.chunk_ranges(0) == plan.chunk_ranges(0)  # it keeps its layers (and ZeRO chunks) for a join
    from elaswave.plan.frequency import PowerModel  # and with clocks planned (a re-deal after standing it by)
    assert replan(limited, [0, 2, 3], 1, 8, power=PowerModel(), schedule="interleaved").micro_batches[0] == ()
    back = replan(after, [0, 2, 3, 4], 2, 8)  # a join completes its pipeline, which trains again
    assert back.pipelines[0] == (0, 4) and len(back.micro_batches[0]) > 0
    with pytest.raises(PlanError, match=r"epoch 1: no pipeline can hold the model: ranks \[0\] hold too much"):
        replan(limited, [0, 2], 1, 8)  # every pipeline broken and over the limit


@pytest.mark.parametrize("lost", [1, 4, 5, 8])
def test_reroute_on_interleaved_pipelines_sends_each_chunk_of_the_lost_rank_to_the_next_host(lost):
    """A route names the rank of each virtual stage: the broken pipeline's survivors keep theirs,
    the lost rank's chunks go to the same stage of other pipelines, a micro-batch's chunks to the
    hosts in turn; each rank keeps its interleaved order with its guests inserted, deadlock-free."""
    from elaswave.pipeline.routed import check_deadlock_free, plan_schedules
    from elaswave.pipeline.schedule import Op
    plan = _plan(dp=3, pp=3, mbs=9)
    after = replan(plan, [r for r in plan.ranks if r != lost], 1, 9, policy="reroute")
    d, s = plan.position(lost)
    assert len(after.routes) == 3 and all(len(route) == 6 for _, route in after.routes)
    hosts = [route[v] for _, route in after.routes for v in (s, s + 3)]
    assert [plan.position(h) for h in hosts] == [(e, s) for e in [k for k in range(3) if k != d] * 3]
    for mb, route in after.routes:
        assert all(route[v] == plan.pipelines[d][v % 3] for v in range(6) if v % 3 != s)
    schedules = plan_schedules(after)
    check_deadlock_free(schedules)
    done = sorted((a.op.value, a.micro_batch, a.chunk, r) for r, acts in schedules.items() for a in acts
                  if a.op in (Op.FORWARD, Op.BACKWARD))
    route_of = {mb: after.route_of.get(mb, plan.pipelines[mb // 3] * 2) for mb in range(9)}
    assert done == sorted((op.value, mb, v // 3, route_of[mb][v]) for op in (Op.FORWARD, Op.BACKWARD)
                          for mb in range(9) for v in range(6))


def test_a_rebalance_over_the_limit_keeps_a_whole_pipeline_training():
    """A straggler's re-split that passes the memory limit does not stand a whole pipeline by (it
    would idle for good: rebalance_gain never looks at a plan with an idle pipeline again): the
    plan is refused and the job keeps the layout it has."""
    memory = MemoryModel(layer_numels=tuple(NUMELS), layer_activation_bytes=tuple([1000.0] * len(COSTS)),
                         boundary_bytes=100.0, param_bytes=4, sum_bytes=4, chunk_numel=16)
    plan = initial_plan(4, 2, 2, COSTS, 8, NUMELS, chunk_numel=16, memory=memory, virtual_stages=2)
    need = max(rank_bytes(memory, plan, r)["total"] for r in plan.ranks) / 2 ** 20
    limited = replace(plan, stage_memory_limit=need * 1.01)
    speeds = {0: 1.0, 1: 0.3, 2: 1.0, 3: 1.0}
    with pytest.raises(PlanError, match="over the limit"):
        replan(limited, limited.ranks, 1, 8, speeds, rebalance=True)
    assert rebalance_gain(limited, speeds, 8) == (0.0, None)  # the straggler logic keeps the layout
    gain, candidate = rebalance_gain(plan, speeds, 8)  # without the limit the re-split is taken
    assert gain > 0 and all(candidate.micro_batches)


def test_a_chunks_sum_packed_early_counts_beside_the_activations_still_kept():
    """With overlapped sums (parallel.overlap_grad_reduce) chunk 1's sums are packed right after
    its last backward, while chunk 0 still keeps micro-batches' activations. With chunk 1's layers
    wide and activations long, that moment is rank 0's peak, above both the activations' peak and
    the reduce's (a reduce-scatter over 4 holders)."""
    numels = [40, 64, 64, 64, 64, 100_000, 100_000, 64, 64, 40]  # rank 0: chunk 0 = layers 0-2, chunk 1 = 5-6
    memory = MemoryModel(layer_numels=tuple(numels), layer_activation_bytes=(40_000.0,) * len(COSTS),
                         boundary_bytes=100.0, param_bytes=4, sum_bytes=4, chunk_numel=16,
                         overlap_param_gather=False)  # (the all-gathers: the next test)
    plan = initial_plan(8, 4, 2, COSTS, 32, numels, chunk_numel=16, memory=memory, virtual_stages=2)
    assert plan.chunk_ranges(0) == ((0, 3), (5, 7))
    on, off = rank_bytes(memory, plan, 0), rank_bytes(replace(memory, overlap_grad_reduce=False), plan, 0)
    assert off["overlap"] == 0.0 and on["overlap"] > max(on["activations"], on["update"]), on
    assert on["total"] - off["total"] == pytest.approx(on["overlap"] - max(off["activations"], off["update"]))
    chunk1 = 4 * 200_000  # chunk 1's sums, packed
    assert chunk1 < on["overlap"] < on["activations"] + chunk1  # and fewer activations than at their peak
    one_f_one_b = initial_plan(8, 4, 2, COSTS, 32, numels, chunk_numel=16, memory=memory)
    assert rank_bytes(memory, one_f_one_b, 0)["overlap"] == 0.0  # a rank's one chunk is whole at its end


def test_a_layers_sum_packed_within_its_backward_counts_beside_the_layers_below():
    """With a bucket a layer, a 1F1B stage's last backward starts each layer's sum as it passes it
    (zero/watch.py): the packed sums of its wide upper layers are alive while its lower layers still
    hold the micro-batch's activations -- here above the activations' peak and the reduce's (a
    reduce-scatter over 4 holders)."""
    from elaswave.plan.buckets import size_starts
    numels = [40, 64, 64, 100_000, 100_000, 64, 64, 64, 64, 40]
    memory = MemoryModel(layer_numels=tuple(numels), layer_activation_bytes=(90_000.0,) * len(COSTS),
                         boundary_bytes=100.0, param_bytes=4, sum_bytes=4, chunk_numel=16, overlap_param_gather=False)
    plan = initial_plan(8, 4, 2, COSTS, 8, numels, chunk_numel=16, memory=memory, bucket_starts=size_starts(numels, 1))
    (start, end), = plan.chunk_ranges(0)
    assert start == 0 and end == 5, plan.chunk_ranges(0)
    on, off = rank_bytes(memory, plan, 0), rank_bytes(replace(memory, overlap_grad_reduce=False), plan, 0)
    at = {a: 4 * sum(numels[a:end]) + memory.activation_bytes(start, a, 1) for a in range(1, end)}
    assert off["overlap"] == 0.0 and on["overlap"] == pytest.approx(max(at.values()))
    assert max(at, key=at.get) == 3 and on["overlap"] > max(on["activations"], on["update"]), on
    per_stage = replace(plan, bucket_starts=())  # a bucket a stage: it starts at the backward's end
    assert rank_bytes(memory, per_stage, 0)["overlap"] == 0.0


def test_all_gathers_still_out_count_beside_the_warm_ups_first_activations():
    """With overlapped all-gathers (parallel.overlap_param_gather) chunk 1's parameters arrive in a
    packed buffer that waits for chunk 1's first forward, while chunk 0 already keeps the warm-up's
    activations: with chunk 1's layers wide, that moment is rank 0's peak (a helper's review found
    it missing: the model then under-counted, and a partition could pass a limit it breaks)."""
    numels = [40, 64, 64, 64, 64, 100_000, 100_000, 64, 64, 40]
    memory = MemoryModel(layer_numels=tuple(numels), layer_activation_bytes=(40_000.0,) * len(COSTS),
                         boundary_bytes=100.0, param_bytes=4, sum_bytes=4, chunk_numel=16, overlap_grad_reduce=False)
    plan = initial_plan(8, 4, 2, COSTS, 32, numels, chunk_numel=16, memory=memory, virtual_stages=2)
    on, off = rank_bytes(memory, plan, 0), rank_bytes(replace(memory, overlap_param_gather=False), plan, 0)
    assert off["gather"] == 0.0 and on["gather"] > max(on["activations"], on["update"]), on
    assert on["total"] - off["total"] == pytest.approx(on["gather"] - max(off["activations"], off["update"]))
    chunk1 = 4 * 200_000  # chunk 1's parameters, gathered
    assert chunk1 < on["gather"] < on["activations"] + chunk1 + memory.param_bytes * sum(numels)
