"""When a stage may free a send (pipeline/release.py): only once its peer has taken it, in every
order the ranks can run in, and early enough that the stage holds a few sends, not the step's."""
import random

import pytest

from elaswave.pipeline.p2p import SIDE, _tag, sends_of
from elaswave.pipeline.release import alive_peak, send_releases
from elaswave.pipeline.schedule import Op, stage_schedule


def _run(schedules, num_chunks, ghosts, rng):
    """Every stage's actions in a random order the messages allow (a receive waits for its send);
    checks each release against what the peer has taken by then. Returns the sends freed."""
    p = len(schedules)
    releases = [send_releases(schedules, s, num_chunks, ghosts) for s in range(p)]
    sent = [iter(sends_of(s, p, num_chunks, [a for a in schedules[s] if a.micro_batch not in ghosts]))
            for s in range(p)]
    in_flight, taken, pos, freed = set(), set(), [0] * p, 0
    while any(pos[s] < len(schedules[s]) for s in range(p)):
        ready = []
        for s in range(p):
            if pos[s] == len(schedules[s]):
                continue
            a = schedules[s][pos[s]]
            if a.micro_batch not in ghosts and a.op in (Op.RECV_ACT, Op.RECV_GRAD):
                src = (s - 1) % p if a.op is Op.RECV_ACT else (s + 1) % p
                if (src, s, _tag(num_chunks, a.micro_batch, a.chunk, a.op is Op.RECV_GRAD)) not in in_flight:
                    continue
            ready.append(s)
        assert ready, "the schedules deadlock"
        s = rng.choice(ready)
        a = schedules[s][pos[s]]
        if a.micro_batch not in ghosts:
            if a.op in (Op.SEND_ACT, Op.SEND_GRAD):
                dst, tag = next(sent[s])
                in_flight.add((s, dst, tag))
            elif a.op in (Op.RECV_ACT, Op.RECV_GRAD):
                src = (s - 1) % p if a.op is Op.RECV_ACT else (s + 1) % p
                key = (src, s, _tag(num_chunks, a.micro_batch, a.chunk, a.op is Op.RECV_GRAD))
                in_flight.remove(key)
                taken.add(key)
        for dst, tag in releases[s].get(pos[s], ()):
            assert (s, dst, tag) in taken and tag < SIDE, (s, pos[s], dst, tag)
            freed += 1
        pos[s] += 1
    return freed


@pytest.mark.parametrize("schedule,chunks", [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved", 3)])
def test_a_send_is_freed_only_once_its_peer_has_taken_it_in_any_order(schedule, chunks):
    rng = random.Random(7)
    for p in range(1, 6):  # (a pipeline of one rank: a ring to itself under interleaved, kept in process)
        for m in range(1, 2 * p + 3):
            ghosts = frozenset(range(m - rng.randint(0, 1), m))  # a ghost at the end, or none
            schedules = [stage_schedule(schedule, s, p, range(m), chunks) for s in range(p)]
            freed = _run(schedules, chunks, ghosts, rng)
            sends = sum(len(sends_of(s, p, chunks, [a for a in schedules[s] if a.micro_batch not in ghosts]))
                        for s in range(p))
            assert freed <= sends and (not sends or m - len(ghosts) < 2 or freed > 0)


def test_a_stage_holds_about_its_in_flight_count_of_sends_not_the_steps():
    # 16 stages of 1F1B, 32 micro-batches: stage 0 sends 32 activations, a middle stage 64 messages.
    schedules = [stage_schedule("1f1b", s, 16, range(32)) for s in range(16)]
    assert [alive_peak(schedules, s) for s in range(16)] == [16, 16, *range(15, 1, -1)]
    assert [alive_peak(schedules, s) for s in (0, 8, 15)] == [16, 9, 2]
