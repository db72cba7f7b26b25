"""Seeded random fault schedules for chaos runs (pure): kills, hangs, joins, and their hard mixes.

A schedule is a list of ``--inject`` texts. Events are spread over the run, a few steps apart,
and drawn from: a SIGKILL in a random phase, a SIGSTOP hang, two ranks killed in the same step,
a kill and then a second one during the recovery from it, and new ranks joining. Only founding
ranks are killed (a joiner's arrival step depends on its start-up time), and at least
``min_founders`` of them are left alive. The same seed always gives the same schedule.

Those faults fire at clean points of a rank's own code. :func:`strikes` draws the other kind: a
signal sent from outside at a moment nobody chose -- mid-collective, mid-snapshot send, mid-chunk
restore, mid-migration, mid-join (``tests/helpers/striker.py`` sends them).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from elaswave.control.faults import PHASES

# (weight: ZB-H1 only; dispatch, combine: expert parallelism only)
STEP_PHASES = tuple(p for p in PHASES if p not in ("recovery", "weight", "dispatch", "combine"))
KINDS = ("kill", "stop", "double_kill", "kill_in_recovery", "join")


def schedule(seed: int, world_size: int, steps: int, events: int = 4, min_founders: int = 2,
             first_step: int = 5, gap: int = 8) -> list[str]:
    """``events`` faults (fewer if the run is too short or too few ranks are left to kill)."""
    if steps < first_step + gap:
        raise ValueError(f"steps={steps} is too short for a chaos run: need >= {first_step + gap}")
    rng = random.Random(seed)
    slots = list(range(first_step, steps - gap, gap))
    at = sorted(rng.sample(slots, min(events, len(slots))))
    alive = list(range(world_size))
    out: list[str] = []
    for step in at:
        kind = rng.choice(KINDS)
        need = {"kill": 1, "stop": 1, "double_kill": 2, "kill_in_recovery": 2, "join": 0}[kind]
        if len(alive) - need < min_founders:
            kind, need = "join", 0
        if kind == "join" and step > 0.6 * steps:  # a joiner needs seconds to start: join early enough to matter
            continue
        victims = rng.sample(alive, need)
        for r in victims:
            alive.remove(r)
        if kind == "join":
            out.append(f"join:step={step},count={rng.choice((1, 2))}")
        elif kind == "stop":
            out.append(f"stop:rank={victims[0]},step={step},phase={rng.choice(STEP_PHASES)}")
        elif kind == "kill_in_recovery":
            # Killed after its update, the first victim's recovery resumes at this step (every
            # holder verified its snapshot), where the second dies while chunks move.
            out.append(f"kill:rank={victims[0]},step={step},phase=optimizer")
            out.append(f"kill:rank={victims[1]},step={step},phase=recovery")
        else:
            phase = rng.choice(STEP_PHASES)  # a double kill: the same step and phase
            out.extend(f"kill:rank={r},step={step},phase={phase}" for r in victims)
    return out


# -- any instant: signals sent from outside the job, at times drawn from a seed ---------------------

SIGNALS = ("SIGKILL", "SIGSTOP")


@dataclass(frozen=True)
class Strike:
    """One signal sent to one worker by a process outside the job."""

    after_step: int | None
    """Fire once the job has written this step's record; None: right after the previous strike."""
    delay_s: float
    """Then wait this long: anywhere inside a step (forwards, a collective, a snapshot send), or,
    right after a strike, inside the recovery it starts (agreement, chunk restore, migration)."""
    signal: str
    pick: float
    """Which live worker, as a fraction of their number in rank order (the victim is drawn when the
    strike fires, among the processes alive then: joiners included)."""


def strikes(seed: int, steps: int, events: int = 3) -> list[Strike]:
    """``events`` strikes: the first after a step in the first half of the run; each next one either
    0-0.5 s after the previous (so inside its recovery, or the join of its replacement) or after a
    later step; a quarter of them SIGSTOP (a hang) instead of SIGKILL."""
    if steps < 12 or events < 1:
        raise ValueError(f"steps={steps} and events={events}: an any-instant chaos run needs steps >= 12 "
                         "and events >= 1")
    rng = random.Random(seed)
    out: list[Strike] = []
    step = rng.randrange(2, steps // 2)
    for i in range(events):
        signal = "SIGSTOP" if rng.random() < 0.25 else "SIGKILL"
        if i and rng.random() < 0.5:
            out.append(Strike(None, rng.uniform(0.0, 0.5), signal, rng.random()))
            continue
        if i:
            step += rng.randrange(3, 10)
        if step >= steps - 3:
            break
        out.append(Strike(step, rng.uniform(0.0, 1.0), signal, rng.random()))
    return out
