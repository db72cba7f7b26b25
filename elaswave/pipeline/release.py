"""When a stage may free what it sent (pure: every rank works it out of its pipeline's schedules).

A send is asynchronous, and its tensor must live until the transport is done with it. Kept to the
step's end, a stage's sends add up to every micro-batch's activation and gradient: at 32
micro-batches of a 32k-token sequence of a 235B model, 16 GiB a rank. A rank cannot ask whether
its peer has taken a message without waiting, but it knows when the peer must have: the peer
sends it something only after a receive of ours it had to take first, so once this stage receives
the first message its peer sends after taking ours, ours is done, and waiting for it returns at
once. (NCCL completes a send when the peer has it; gloo no later.)

A ghost micro-batch (plan.Plan.ghosts) sends and receives nothing; its actions are skipped.
"""
from __future__ import annotations

from bisect import bisect_right
from functools import lru_cache
from typing import Collection, Sequence

from elaswave.pipeline.p2p import receives_of, sends_of
from elaswave.pipeline.schedule import Action, Op, stage_schedule


def _sends(stage: int, num_stages: int, num_chunks: int, actions: Sequence[Action],
           ghosts: Collection[int]) -> list[tuple[int, int, int]]:
    """(index in ``actions``, destination stage, tag) of each message the stage sends, in order."""
    at = [i for i, a in enumerate(actions) if a.op in (Op.SEND_ACT, Op.SEND_GRAD) and a.micro_batch not in ghosts]
    kept = [a for a in actions if a.micro_batch not in ghosts]
    return [(i, dst, tag) for i, (dst, tag) in zip(at, sends_of(stage, num_stages, num_chunks, kept))]


def send_releases(schedules: Sequence[Sequence[Action]], stage: int, num_chunks: int = 1,
                  ghosts: Collection[int] = ()) -> dict[int, list[tuple[int, int]]]:
    """Index in stage ``stage``'s actions -> the sends (destination stage, tag) it may free once
    that action (a receive) is done: for each send, the receive of the first message its
    destination sends this stage after taking it; a send to itself (a pipeline of one rank keeps
    it in process until its own receive), that receive. A send no such message follows is freed
    at the step's end."""
    p = len(schedules)
    sends = {q: _sends(q, p, num_chunks, schedules[q], ghosts) for q in {stage, (stage + 1) % p, (stage - 1) % p}}
    taken_at = {q: receives_of(q, p, num_chunks, schedules[q], ghosts) for q in {(stage + 1) % p, (stage - 1) % p}}
    mine = receives_of(stage, p, num_chunks, schedules[stage], ghosts)
    # The messages each neighbour sends this stage, by its action index (ascending).
    to_me = {q: [(i, t) for i, d, t in sends[q] if d == stage] for q in taken_at if q != stage}
    out: dict[int, list[tuple[int, int]]] = {}
    for _, dst, tag in sends[stage]:
        if dst == stage:
            at = mine.get((stage, tag))
        else:
            taken, back = taken_at[dst].get((stage, tag)), to_me[dst]
            k = bisect_right(back, (taken, float("inf"))) if taken is not None else len(back)
            at = mine[(dst, back[k][1])] if k < len(back) else None
        if at is not None:
            out.setdefault(at, []).append((dst, tag))
    return out


def alive_peak(schedules: Sequence[Sequence[Action]], stage: int, num_chunks: int = 1) -> int:
    """The most of stage ``stage``'s sends alive at once when each is freed by :func:`send_releases`
    (what the memory model counts of a stage's send buffers; a pipeline of one rank's to itself too)."""
    releases = send_releases(schedules, stage, num_chunks)
    alive, peak = 0, 0
    for i, a in enumerate(schedules[stage]):
        if a.op in (Op.SEND_ACT, Op.SEND_GRAD):
            alive += 1
            peak = max(peak, alive)
        alive -= len(releases.get(i, ()))
    return peak


@lru_cache(maxsize=1024)
def _alive_all(schedule: str, num_stages: int, num_micro_batches: int, num_chunks: int) -> tuple[int, ...]:
    schedules = [stage_schedule(schedule, s, num_stages, range(num_micro_batches), num_chunks)
                 for s in range(num_stages)]
    return tuple(alive_peak(schedules, s, num_chunks) for s in range(num_stages))


def alive_sends(schedule: str, stage: int, num_stages: int, num_micro_batches: int, num_chunks: int = 1) -> int:
    """:func:`alive_peak` of stage ``stage`` of a pipeline under ``schedule`` (every stage's at once,
    cached by shape: a plan of 10^4 ranks has a few)."""
    return _alive_all(schedule, num_stages, num_micro_batches, num_chunks)[stage]
