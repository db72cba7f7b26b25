"""Chaos at any instant: a thread outside the job SIGKILLs or SIGSTOPs its workers at times drawn
from a seed (:func:`elaswave.control.chaos.strikes`), and the run is judged against the reference.

Unlike ``--inject`` (a rank signals itself at a chosen point of its own code), the victim is doing
whatever it is doing: a collective, a snapshot send, a chunk restore, a migration, a join.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from elaswave.control.chaos import Strike, strikes
from tests.helpers.spawn import Running, Result, children, rank_of, session_members, steps_written

POLL_S = 0.005


class Striker(threading.Thread):
    """Sends ``plan``'s signals to the workers of the launcher ``pid``, never leaving fewer than
    ``min_alive`` running; ``fired`` records each (wall time, rank, signal, steps written by then)."""

    def __init__(self, pid: int, metrics: Path, plan: list[Strike], min_alive: int):
        super().__init__(name="elaswave-striker", daemon=True)
        self.pid, self.metrics, self.plan, self.min_alive = pid, metrics, plan, min_alive
        self.fired: list[dict] = []
        self.skipped: list[str] = []
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        for strike in self.plan:
            if strike.after_step is not None:
                while steps_written(self.metrics) <= strike.after_step:
                    if self._halt.wait(POLL_S):
                        return
            if self._halt.wait(strike.delay_s):
                return
            live = sorted((r, p) for p in children(self.pid) if (r := rank_of(p)) is not None)
            if len(live) <= self.min_alive:
                self.skipped.append(f"{strike}: " + (f"only {len(live)} workers running" if live else "the job was over"))
                continue
            rank, victim = live[int(strike.pick * len(live))]
            try:
                os.kill(victim, getattr(signal, strike.signal))
            except ProcessLookupError:
                self.skipped.append(f"{strike}: rank {rank} was gone")
                continue
            self.fired.append({"wall_time": time.time(), "rank": rank, "signal": strike.signal,
                               "steps_written": steps_written(self.metrics)})


@dataclass
class Outcome:
    seed: int
    verdict: str
    """equal | fallback_equal (a loud return to a disk checkpoint, then equal) | failed (a loud
    non-zero exit) | diverged (exit 0 but not the reference's run: silent) | hang."""
    fired: list[dict] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    recoveries: int = 0
    joins: int = 0
    left_behind: int = 0
    wall_s: float = 0.0
    detail: str = ""


def _differences(res: Result, summary: dict, reference: Result, steps: int) -> list[str]:
    """What makes a run not the reference's: each check that fails, with the first step it shows."""
    out = []
    written = [r["step"] for r in res.steps]
    if written != list(range(steps)):
        out.append(f"steps written {written}")
    bad = [(r["step"], r["loss"], reference.losses[r["step"]]) for r in res.steps
           if r["step"] < len(reference.losses) and r["loss"] != reference.losses[r["step"]]]
    if bad:
        out.append(f"{len(bad)} losses differ, first at step {bad[0][0]}: {bad[0][1]!r} != {bad[0][2]!r}")
    for key in ("params_sha256", "state_sha256"):
        if summary.get(key) != reference.summary[key]:
            out.append(f"{key} differs")
    return out


def strike_run(seed: int, args: list[str], metrics: Path, reference: Result, steps: int, events: int = 3,
               min_alive: int = 3, timeout_s: float = 300.0) -> Outcome:
    """``elaswave ARGS`` (a ``run`` with ``--metrics-out`` left to this helper) under the strikes of
    ``seed``; judged against ``reference`` (every step once, losses, parameters and whole state)."""
    began = time.perf_counter()
    plan = strikes(seed, steps, events)
    with Running(args, metrics) as job:
        striker = Striker(job.proc.pid, metrics, plan, min_alive)
        striker.start()
        try:
            res = job.finish(timeout_s)
        except AssertionError as exc:
            return Outcome(seed, "hang", striker.fired, striker.skipped, wall_s=time.perf_counter() - began,
                           detail=str(exc)[-2000:])
        finally:
            striker.stop()
        left = len([p for p in session_members(job.proc.pid) if p != job.proc.pid])
    changes = [r for r in res.records if r["event"] in ("recovery", "join")]
    out = Outcome(seed, "", striker.fired, striker.skipped, sum(r["event"] == "recovery" for r in changes),
                  sum(len(r.get("joined_ranks", [])) for r in changes), left, time.perf_counter() - began)
    if res.returncode != 0:
        out.verdict, out.detail = "failed", res.stderr[-2000:]
        return out
    summary = next((r for r in res.records if r["event"] == "summary"), {})
    differ = _differences(res, summary, reference, steps)
    fell_back = any(r.get("is_fallback") for r in changes) or any(r["event"] == "resume" for r in res.records)
    if differ:
        out.verdict, out.detail = "diverged", "; ".join(differ) + "\n" + res.stderr[-2000:]
    else:
        out.verdict = "fallback_equal" if fell_back else "equal"
    if fell_back and "WARNING" not in res.stderr:
        out.verdict, out.detail = "diverged", "went back to a disk checkpoint without saying so"
    return out
