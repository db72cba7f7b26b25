"""Gradient buckets: holder groups cut where a holder's model chunk changes, started in one order."""
from elaswave.pipeline.schedule import Op, stage_schedule
from elaswave.plan.buckets import gradient_chunks, issue_order, ready_after, size_starts
from elaswave.plan.plan import initial_plan
from elaswave.plan.replan import replan


def _plan(virtual_stages: int, dp: int = 2, pp: int = 2, layers: int = 8):
    return initial_plan(dp * pp, dp, pp, [1.0] * layers, 4 * dp, layer_numels=[10] * layers, chunk_numel=4,
                        virtual_stages=virtual_stages, ties=[(0, layers - 1)])


def test_without_virtual_stages_a_holder_group_is_one_bucket():
    plan = _plan(1)
    assert plan.gradient_buckets() == tuple(plan.holder_groups().items())


def test_a_holder_group_is_cut_at_its_model_chunks_and_a_tie_goes_with_its_user():
    plan = _plan(2)
    # Rank 0 runs layers 0-1 (chunk 0) and 4-5 (chunk 1); rank 1 layers 2-3 and 6-7, and the
    # embedding's tie to the head, whose gradient its chunk 1 computes.
    assert plan.gradient_buckets() == (((0, 1, 2, 3), (0,)), ((0, 2), (1,)), ((0, 2), (4, 5)),
                                       ((1, 3), (2, 3)), ((1, 3), (6, 7)))
    assert gradient_chunks(plan, 1, 0) == {1} and gradient_chunks(plan, 0, 0) == {0}
    # Slots are per bucket: rank 0's chunks of layer 1 (3 chunks over 2 holders) fill a slot of 2.
    assert plan.slot_chunks(0) == (1, 2, 3)


def test_buckets_are_cut_by_size_never_within_a_layer_and_the_cut_survives_a_re_plan():
    """parallel.bucket_numel: the model's layers, in order, in runs of at most that many values (a
    larger layer alone), so a holder group's buckets are no larger; a re-split pipeline keeps them."""
    assert size_starts([10, 10, 10, 25, 5, 5], 20) == (2, 3, 4)
    assert size_starts([10, 10, 10, 25, 5, 5], 30) == (3, 5)
    assert size_starts([10] * 6, 0) == ()
    plan = initial_plan(4, 2, 2, [1.0] * 8, 8, layer_numels=[10] * 8, chunk_numel=4, ties=[(0, 7)],
                        bucket_starts=size_starts([10] * 8, 20))
    assert plan.gradient_buckets() == (((0, 1, 2, 3), (0,)), ((0, 2), (1,)), ((0, 2), (2, 3)),
                                       ((1, 3), (4, 5)), ((1, 3), (6, 7)))
    # A slot per bucket: layer 0's 3 chunks over 4 holders, layer 1's over 2, layers 2-3's 6 over 2.
    assert plan.slot_chunks(0) == (1, 2, 3) and plan.slot_chunks(1) == (1, 3, 3)
    after = replan(plan, [0, 1, 2], 1, 8, detours=False)
    assert after.bucket_starts == plan.bucket_starts
    for holders, layers in after.gradient_buckets():
        assert sum(10 for _ in layers) <= 20, (holders, layers)


def test_after_a_loss_every_bucket_is_one_chunk_on_each_holder():
    plan = _plan(2, dp=3, pp=4, layers=16)
    after = replan(plan, [r for r in plan.ranks if r != 5], 1, 12, detours=False)
    assert after.virtual_stages == 2 and any(len(p) == 3 for p in after.pipelines)
    for holders, layers in after.gradient_buckets():
        for h in holders:
            assert len({gradient_chunks(after, h, layer) for layer in layers}) == 1, (holders, layers, h)
    covered = sorted(layer for h, layers in after.gradient_buckets() for layer in layers)
    assert covered == sorted(layer for layers in after.holder_groups().values() for layer in layers)


def test_buckets_start_last_layers_first_as_the_backwards_finish_them():
    plan = _plan(2)
    buckets = plan.gradient_buckets()
    assert [max(buckets[i][1]) for i in issue_order(buckets)] == [7, 5, 3, 1, 0]
    actions = stage_schedule("interleaved", 0, 2, range(4), 2)
    last = {c: max(i for i, a in enumerate(actions) if a.op is Op.BACKWARD and a.chunk == c) for c in (0, 1)}
    assert ready_after(actions, frozenset({1})) == last[1] < last[0] == ready_after(actions, frozenset({0, 1}))
    assert last[0] == len(actions) - 1 - sum(a.op is Op.SEND_GRAD for a in actions[last[0]:])
    assert ready_after(actions, frozenset()) == -1
    zb = stage_schedule("zb-h1", 1, 2, range(4))
    assert zb[ready_after(zb, frozenset({0}))].op is Op.BACKWARD_WEIGHT  # W, not B, makes it whole
