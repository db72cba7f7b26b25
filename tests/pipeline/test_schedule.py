import random

import pytest

from elaswave.pipeline.schedule import (Action, DeadlockError, Op, check_deadlock_free, interleaved_1f1b, makespan,
                                        one_f_one_b, one_f_one_b_makespan, peak_in_flight, stage_schedule,
                                        zb_h1)


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("num_mb", [1, 2, 3, 5, 8])
def test_one_f_one_b_is_deadlock_free_and_complete(stages, num_mb):
    mbs = list(range(10, 10 + num_mb))
    scheds = [one_f_one_b(s, stages, mbs) for s in range(stages)]
    check_deadlock_free(scheds)
    for s, sched in enumerate(scheds):
        assert [a.micro_batch for a in sched if a.op is Op.FORWARD] == mbs
        assert sorted(a.micro_batch for a in sched if a.op is Op.BACKWARD) == mbs


def test_one_f_one_b_bounds_live_activations():
    sched = one_f_one_b(0, 4, list(range(8)))
    live = peak = 0
    for a in sched:
        live += (a.op is Op.FORWARD) - (a.op is Op.BACKWARD)
        peak = max(peak, live)
    assert peak == 4


def test_deadlock_is_detected():
    # Stage 1 waits for a gradient that stage 0 never sends before waiting itself.
    bad = [[Action(Op.RECV_GRAD, 0), Action(Op.FORWARD, 0), Action(Op.SEND_ACT, 0)],
           [Action(Op.RECV_ACT, 0), Action(Op.FORWARD, 0), Action(Op.BACKWARD, 0), Action(Op.SEND_GRAD, 0)]]
    with pytest.raises(DeadlockError, match="deadlocks"):
        check_deadlock_free(bad)


def test_the_general_timing_is_the_exact_1f1b_timing_on_1f1b():
    rng = random.Random(7)
    for _ in range(200):
        p, m = rng.randint(1, 6), rng.randint(1, 12)
        times = [rng.uniform(0.5, 2.0) for _ in range(p)]
        sizes = [rng.choice([0.5, 1.0, 2.0]) for _ in range(m)] if rng.random() < 0.3 else None
        general = makespan([one_f_one_b(s, p, range(m)) for s in range(p)], times, 2.0, sizes=sizes)
        assert general == pytest.approx(one_f_one_b_makespan(times, m, 2.0, sizes), rel=1e-12)


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
def test_zb_h1_is_deadlock_free_complete_and_holds_no_more_than_1f1b(stages):
    for num_mb in range(1, 2 * stages + 4):
        scheds = [zb_h1(s, stages, range(num_mb)) for s in range(stages)]
        check_deadlock_free(scheds)
        for sched in scheds:
            ops = [(a.op, a.micro_batch) for a in sched]
            for mb in range(num_mb):  # each once, in the order the gradients need
                f, b, w = (ops.index((op, mb)) for op in (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT))
                assert f < b < w
            assert len(ops) - sum(op in (Op.RECV_ACT, Op.SEND_ACT, Op.RECV_GRAD, Op.SEND_GRAD) for op, _ in ops) \
                == 3 * num_mb
            assert peak_in_flight(sched) <= min(stages, num_mb)
        assert max(map(peak_in_flight, scheds)) == max(peak_in_flight(one_f_one_b(s, stages, range(num_mb)))
                                                       for s in range(stages))


@pytest.mark.parametrize("stages,num_mb", [(2, 4), (4, 4), (4, 8), (8, 8), (8, 16)])
def test_zb_h1_leaves_a_third_of_1f1b_bubble(stages, num_mb):
    """Stages alike, the backward twice the forward and split evenly (B = W = F, the paper's
    setting): 1F1B idles (p - 1)(F + B + W) per stage, ZB-H1 a third of it."""
    times, work = [3.0] * stages, 3.0 * num_mb
    one = makespan([one_f_one_b(s, stages, range(num_mb)) for s in range(stages)], times)
    zb = makespan([zb_h1(s, stages, range(num_mb)) for s in range(stages)], times)
    assert one - work == pytest.approx(3.0 * (stages - 1))
    assert zb - work == pytest.approx((one - work) / 3)


def _valid_counts(stages, chunks):
    """Micro-batch counts Megatron's interleaving takes, up to 4p: any with one chunk, multiples of
    p above (elaswave takes any: test_interleaved_takes_any_micro_batch_count)."""
    step = stages if chunks > 1 else 1
    return range(step, 4 * stages + 1, step)


@pytest.mark.parametrize("stages", range(1, 9))
@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
def test_interleaved_is_deadlock_free_and_runs_every_micro_batch_once_per_virtual_stage(stages, chunks):
    for num_mb in _valid_counts(stages, chunks):
        mbs = list(range(10, 10 + num_mb))
        scheds = [interleaved_1f1b(s, stages, chunks, mbs) for s in range(stages)]
        check_deadlock_free(scheds)
        every = sorted((mb, v) for mb in mbs for v in range(chunks))
        for sched in scheds:
            forwards = [(a.micro_batch, a.chunk) for a in sched if a.op is Op.FORWARD]
            backwards = [(a.micro_batch, a.chunk) for a in sched if a.op is Op.BACKWARD]
            assert sorted(forwards) == every and sorted(backwards) == every
            ops = [(a.op, a.micro_batch, a.chunk) for a in sched]
            assert all(ops.index((Op.FORWARD, *u)) < ops.index((Op.BACKWARD, *u)) for u in every)
            for v in range(chunks):  # each chunk takes the micro-batches in order
                assert [mb for mb, c in forwards if c == v] == mbs


@pytest.mark.parametrize("stages", range(1, 9))
def test_interleaved_with_one_chunk_is_1f1b(stages):
    for num_mb in range(1, 2 * stages + 4):
        for s in range(stages):
            assert interleaved_1f1b(s, stages, 1, range(num_mb)) == one_f_one_b(s, stages, range(num_mb))


def test_interleaved_is_megatrons_order():
    """p = 2, V = 2, m = 4, rank 0: 2 * 1 + 1 * 2 = 4 warm-up forwards (mb 0, 1 on chunk 0, then on
    chunk 1), 1F1B pairs, then the drain; chunk 1's input comes round the ring from rank 1."""
    got = " ".join(str(a) for a in interleaved_1f1b(0, 2, 2, range(4)) if a.op in (Op.FORWARD, Op.BACKWARD))
    assert got == ("forward(0) forward(1) forward(0,c1) forward(1,c1) "
                   "forward(2) backward(0,c1) forward(3) backward(1,c1) forward(2,c1) backward(0) "
                   "forward(3,c1) backward(1) backward(2,c1) backward(3,c1) backward(2) backward(3)")
    rank1 = interleaved_1f1b(1, 2, 2, range(4))
    assert str(rank1[2]) == "send_act(0)" and str(rank1[-1]) == "send_grad(3)"  # to rank 0's chunk 1 / 0
    assert str(Action(Op.RECV_ACT, 0, 1)) == "recv_act(0)@1" and Action(Op.RECV_ACT, 0, 1).chunk == 0


@pytest.mark.parametrize("stages", range(1, 9))
@pytest.mark.parametrize("chunks", [2, 3, 4])
def test_interleaved_takes_any_micro_batch_count(stages, chunks):
    """A re-planned pipeline of p ranks gets whatever count the deal gives it: groups of at least p
    (all m when fewer), as even as possible, are deadlock-free for every count (a short last group
    behind full ones is not: the order this replaced deadlocked at p=4, V=3, m=5)."""
    for num_mb in range(1, 4 * stages + 2):
        scheds = [interleaved_1f1b(s, stages, chunks, range(num_mb)) for s in range(stages)]
        check_deadlock_free(scheds)
        every = sorted((mb, v) for mb in range(num_mb) for v in range(chunks))
        for sched in scheds:
            assert sorted((a.micro_batch, a.chunk) for a in sched if a.op is Op.BACKWARD) == every
        # Never worse than plain 1F1B over the same work, whatever the count.
        plain = makespan([one_f_one_b(s, stages, range(num_mb)) for s in range(stages)], [3.0 * chunks] * stages)
        assert makespan(scheds, [3.0] * (stages * chunks)) <= plain * (1 + 1e-12)


def test_interleaved_refuses_what_cannot_be_scheduled():
    with pytest.raises(ValueError, match="num_chunks 0"):
        interleaved_1f1b(0, 4, 0, range(8))
    with pytest.raises(ValueError, match="stage 4 out of range"):
        interleaved_1f1b(4, 4, 2, range(8))
    with pytest.raises(ValueError, match="schedule 'zb-h1' runs one model chunk a rank, not 2"):
        stage_schedule("zb-h1", 0, 4, range(8), 2)
    assert stage_schedule("interleaved", 1, 4, range(8), 2) == interleaved_1f1b(1, 4, 2, range(8))


def test_a_message_to_the_wrong_chunk_is_a_deadlock():
    scheds = [interleaved_1f1b(s, 2, 2, range(2)) for s in range(2)]
    check_deadlock_free(scheds)
    i = next(i for i, a in enumerate(scheds[0]) if a.op is Op.RECV_ACT)  # chunk 1's input, from rank 1
    scheds[0][i] = Action(Op.RECV_ACT, scheds[0][i].micro_batch, chunk=0)
    with pytest.raises(DeadlockError, match="deadlocks"):
        check_deadlock_free(scheds)


@pytest.mark.parametrize("stages,chunks,num_mb", [(2, 2, 2), (2, 2, 4), (4, 2, 4), (4, 2, 8), (4, 4, 8),
                                                  (8, 2, 8), (8, 2, 16), (8, 4, 16), (8, 3, 32), (3, 4, 12)])
def test_interleaved_bubble_is_1f1b_bubble_over_v(stages, chunks, num_mb):
    """Virtual stages alike, F = 1 and B = 2 each: a rank works 3 V m and idles (p - 1)(F + B),
    so makespan / work = 1 + (p - 1) / (V m) exactly -- 1F1B's bubble over V (Megatron's figure)."""
    scheds = [interleaved_1f1b(s, stages, chunks, range(num_mb)) for s in range(stages)]
    work = 3.0 * chunks * num_mb
    assert makespan(scheds, [3.0] * (stages * chunks)) / work == pytest.approx(1 + (stages - 1) / (chunks * num_mb),
                                                                               rel=1e-12)
    plain = makespan([one_f_one_b(s, stages, range(num_mb)) for s in range(stages)], [3.0 * chunks] * stages)
    assert plain / work == pytest.approx(1 + (stages - 1) / num_mb, rel=1e-12)


def test_makespan_times_each_virtual_stage():
    # One rank, two chunks of 1 and 2 s: no bubble, 3 s a micro-batch (the ring closes on itself).
    assert makespan([interleaved_1f1b(0, 1, 2, range(5))], [1.0, 2.0]) == pytest.approx(15.0)
    # p = 2, V = 2, m = 4, one virtual stage twice as slow: its rank works 4 x (3 + 6) = 36. On rank 0
    # (virtual stage 2) it never waits; on rank 1 (virtual stage 3) it idles 3 s in all.
    scheds = [interleaved_1f1b(s, 2, 2, range(4)) for s in range(2)]
    assert makespan(scheds, [3.0, 3.0, 6.0, 3.0]) == pytest.approx(36.0)
    assert makespan(scheds, [3.0, 3.0, 3.0, 6.0]) == pytest.approx(39.0)
    with pytest.raises(ValueError, match="stage_s has 2 times for 2 stages x 2 chunks: one per virtual stage, 4"):
        makespan(scheds, [3.0, 3.0])


@pytest.mark.parametrize("stages", [2, 4, 8])
@pytest.mark.parametrize("chunks", [2, 3, 4])
def test_interleaved_first_rank_holds_more_than_1f1b(stages, chunks):
    """Megatron's warm-up plus the steady state's one forward ahead: rank s holds
    min(2 (p - s - 1) + (V - 1) p + 1, V m) micro-batch-chunks; rank 0 at m >= 2p holds V p + p - 1,
    i.e. p + (p - 1) / V whole stages' worth -- (1 + (p - 1) / (p V)) x 1F1B's first stage (p)."""
    for num_mb in _valid_counts(stages, chunks):
        scheds = [interleaved_1f1b(s, stages, chunks, range(num_mb)) for s in range(stages)]
        for s, sched in enumerate(scheds):
            assert peak_in_flight(sched) == min(2 * (stages - s - 1) + (chunks - 1) * stages + 1, chunks * num_mb)
        if num_mb >= 2 * stages:
            assert peak_in_flight(scheds[0]) == chunks * stages + stages - 1
            assert peak_in_flight(scheds[0]) / chunks > peak_in_flight(one_f_one_b(0, stages, range(num_mb))) == stages


def test_a_pair_of_ranks_receives_in_the_order_its_peer_sends():
    """NCCL matches a pair's messages by order, not tag. With chunks a pipeline of two ranks sends
    activations and gradients over one pair, and at odd m >= 5 the interleaved schedule sends a
    gradient before an activation the other rank receives first -- so the runtime receives each
    peer's messages in its send order (pipeline/p2p.P2P.expect), from ``sends_of`` the peer's schedule."""
    from elaswave.pipeline.p2p import _tag, sends_of

    def received(stage, sched, p, v):  # (source stage, tag) of each receive, in the order it is posted
        out = []
        for a in sched:
            if a.op is Op.RECV_ACT:
                out.append(((stage - 1) % p, _tag(v, a.micro_batch, a.chunk, False)))
            elif a.op is Op.RECV_GRAD:
                out.append(((stage + 1) % p, _tag(v, a.micro_batch, a.chunk, True)))
        return out
    mismatched = []
    for p in (2, 3, 4):
        for m in range(1, 4 * p + 3):
            scheds = [interleaved_1f1b(s, p, 2, range(m)) for s in range(p)]
            for dst in range(p):
                for src in range(p):
                    sent = [tag for d, tag in sends_of(src, p, 2, scheds[src]) if d == dst and src != dst]
                    posted = [tag for s, tag in received(dst, scheds[dst], p, 2) if s == src]
                    assert sorted(sent) == sorted(posted)  # every message sent is received, by its tag
                    if sent != posted:
                        mismatched.append((p, m))
    assert mismatched and {p for p, _ in mismatched} == {2} and (2, 5) in mismatched and (2, 4) not in mismatched


def test_what_travels_beside_a_message_is_in_the_send_order_right_after_it():
    from elaswave.pipeline.p2p import SIDE, sends_of
    sched = interleaved_1f1b(0, 2, 2, range(5))
    plain, beside = sends_of(0, 2, 2, sched), sends_of(0, 2, 2, sched, beside=True)
    assert beside[0::2] == plain and beside[1::2] == [(d, SIDE + tag) for d, tag in plain]
