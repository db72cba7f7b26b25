"""Stragglers: a rank that is slow but alive gets less work instead of being dropped.

Every step's loss exchange carries every rank's speed (micro-batches per second of its own
compute), so every rank holds the same window of recent speeds and takes the same decision
without another message: when re-planning the same ranks by their median speeds is predicted
to save at least ``elastic.straggler_gain`` of a step (:func:`~elaswave.plan.rebalance.rebalance_gain`),
the job re-plans at the end of the step. The window restarts with every epoch, so one slow step
(or the first steps of a new layout) cannot trigger it.
"""
from __future__ import annotations

import statistics

from elaswave.plan.plan import Plan
from elaswave.plan.rebalance import rebalance_gain

WINDOW = 5
"""Steps of an epoch whose median speeds a decision rests on."""

REBALANCE = "rebalance"
"""The cause of a re-plan of the same ranks at a step boundary."""


class SpeedWindow:
    def __init__(self) -> None:
        self.epoch = -1
        self.steps: list[dict[int, float]] = []

    def add(self, epoch: int, speeds: dict[int, float]) -> None:
        if epoch != self.epoch:
            self.epoch, self.steps = epoch, []
        self.steps = (self.steps + [speeds])[-WINDOW:]

    def median(self, rank: int) -> float:
        """``rank``'s median speed over the window (0 when it ran nothing)."""
        seen = [s[rank] for s in self.steps if s.get(rank, 0) > 0]
        return statistics.median(seen) if seen else 0.0

    def straggles(self, plan: Plan, num_micro_batches: int, min_gain: float) -> float:
        """The predicted gain of re-planning now, when it reaches ``min_gain`` (else 0)."""
        if min_gain <= 0 or len(self.steps) < WINDOW or self.epoch != plan.epoch:
            return 0.0
        gain, _ = rebalance_gain(plan, {r: self.median(r) for r in plan.ranks}, num_micro_batches, min_gain)
        return gain if gain >= min_gain else 0.0
