"""Replays a failure trace against one policy (pure, analytic per step).

Between events the job trains at its plan's steady rate (micro-batches per second from
:func:`~elaswave.sim.model.step_time`); at an event the policy's :class:`~elaswave.sim.policies.Change`
says how long nothing trains and how much finished work is thrown away. Goodput is the useful
micro-batches over what the whole cluster, never failing, would have trained in the same time.
A policy with spares replays the trace as its slots see it (:func:`~elaswave.sim.control.slot_events`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Sequence

from elaswave.sim.model import ClusterModel, step_time
from elaswave.sim.policies import Policy
from elaswave.sim.trace import Event


@dataclass
class PolicyResult:
    policy: str
    throughput_after_over_before: float | None
    """Steady rate after the first change / before it (None: the trace has no change)."""
    throughput_before: float
    """Micro-batches per second on every device, before any change."""
    throughput_after: float | None
    """Micro-batches per second after the first change (None: the trace has no change)."""
    goodput: float
    batch_after_over_before: float | None
    """The global batch trained per step after the first change / before it (drop_replica shrinks it)."""
    mttr_s: float | None
    """Mean over failures of the time from the failure to the end of the step that redoes the
    interrupted work (the runtime's definition)."""
    time_lost_per_failure_s: float | None
    """Mean over failures of the time nothing useful was trained: downtime plus redone work."""
    failures: int
    joins: int
    stalls: int
    """Failures after which the policy could not train at all until a repair (left out of the MTTR)."""
    useful_micro_batches: float
    devices: int = 0
    """Devices in the layout (the failure-free plan)."""
    spares: int = 0
    """Idle devices held beside them."""
    store_losses: int = 0
    """Failures that took the control store's host along."""
    duration_s: float = 0.0
    timeline: list[tuple[float, float]] = field(default_factory=list)
    """(time s, micro-batches per s) at each change of rate."""

    @property
    def ettr(self) -> float:
        """Effective training time ratio, ByteRobust's metric: productive training time / wall time.
        It is the goodput: a second trained at a fraction f of the job's failure-free rate counts as
        f productive seconds, so a job running degraded is not credited as if it trained at full
        speed. For a job that trains at its full rate or not at all (ByteRobust's, which replace
        machines rather than shrink) the two readings are the same number."""
        return self.goodput

    @property
    def ettr_all_devices(self) -> float:
        """ETTR charged for the spares: productive device-time over the wall time of every device
        the job holds, the layout's and the idle spares' (the spares train nothing)."""
        held = self.devices + self.spares
        return self.goodput * self.devices / held if held else self.goodput

    @property
    def productive_lost_per_failure_s(self) -> float | None:
        """Wall time's unproductive share per failure, ``(1 - ETTR) x duration / failures``: unlike
        ``time_lost_per_failure_s`` it also counts degraded running and the joins' pauses."""
        return (1 - self.ettr) * self.duration_s / self.failures if self.failures else None

    def to_doc(self) -> dict:
        return {"throughput_after_over_before": self.throughput_after_over_before,
                "throughput_before": self.throughput_before, "throughput_after": self.throughput_after,
                "goodput": self.goodput, "batch_after_over_before": self.batch_after_over_before, "ettr": self.ettr, "ettr_all_devices": self.ettr_all_devices,
                "mttr_s": self.mttr_s, "time_lost_per_failure_s": self.time_lost_per_failure_s,
                "productive_lost_per_failure_s": self.productive_lost_per_failure_s,
                "failures": self.failures, "joins": self.joins, "stalls": self.stalls,
                "store_losses": self.store_losses, "devices": self.devices, "spares": self.spares}


@lru_cache(maxsize=16)
def priced(plan, model: ClusterModel, schedule: str = "runtime") -> tuple[float, float]:
    """(micro-batches per second, step seconds); no plan: nothing trains. Every plan of every
    policy is priced the same way: 1F1B, or the routed schedule the runtime runs where a plan has
    detours. Not the list schedule's spare micro-batches in flight: the planners choose clocks and
    counts for 1F1B, and pricing one side of a failure (or one policy) with it and the other not
    made a job look faster after losing a device than before (issue 19, and again when only the
    after-plans were priced with it: elaswave 1.004x at 4x8 gpt-175b). Every policy prices the
    same failure-free plan: it is priced once. ``schedule``: how a plan with detours is priced
    (:func:`~elaswave.sim.model.step_time`; the policy's ``schedule``)."""
    if plan is None:
        return 0.0, float("inf")
    est = step_time(plan, model, schedule)
    return est.micro_batches_per_s, est.step_s


def _priced_after(plan, full_plan, full: tuple[float, float], model: ClusterModel, schedule: str) -> tuple[float, float]:
    """A plan after a change. ``lower_bound`` (a baseline whose schedule is not modelled): the
    failure-free rate every policy shares, times the ratio of the two plans' lower bounds -- its
    schedule taken to be as far from the bound after the change as 1F1B is before it, so the
    before stays every policy's. Where the bound does not grow -- the lost stage's micro-batches
    fit in its hosts' bubbles -- the smaller holder group's gradient sum made the step shorter
    than before the loss (1.02x, gpt-1.3b 4x4): the rate is capped at the failure-free one
    (ReCycle's best case, not a gain)."""
    if schedule != "lower_bound" or plan is None:
        return priced(plan, model)
    rate = full[0] * priced(plan, model, schedule)[0] / priced(full_plan, model, schedule)[0]
    rate = min(rate, full[0] * _whole(plan) / _whole(full_plan))
    return rate, _whole(plan) / rate


def _whole(plan) -> float:
    return plan.batch_units / plan.units_per_micro_batch


def _together(events: Sequence[Event]) -> list[list[Event]]:
    """The events in order, failures at the same instant as one batch: a node's TP groups lost
    with it are one recovery (the runtime agrees once on every rank lost), not one per group."""
    out: list[list[Event]] = []
    for e in events:
        if out and e.kind == "fail" and out[-1][0].kind == "fail" and out[-1][0].t_s == e.t_s:
            out[-1].append(e)
        else:
            out.append([e])
    return out


def simulate(events: Sequence[Event], policy: Policy, model: ClusterModel, duration_s: float) -> PolicyResult:
    live = set(policy.initial.ranks)
    plan = full_plan = policy.layout(sorted(live))
    rate, step_s = full = priced(plan, model)
    full_rate = rate
    t, resume_at, useful = 0.0, 0.0, 0.0
    timeline = [(0.0, rate)]
    first_ratio = first_after = first_batch = None
    mttrs, lost = [], []
    failures = joins = stalls = store_losses = 0
    for batch in _together(policy.slot_events(events)):
        e = batch[0]
        if e.t_s >= duration_s:
            break
        useful += rate * max(0.0, e.t_s - max(t, resume_at))
        t = e.t_s
        joined = e.kind != "fail"  # a join, or a spare taking a failed device's place
        for each in batch:
            (live.add if joined else live.discard)(each.device)
        before = rate
        change = policy.respond(plan, sorted(live), e, step_s)
        plan = change.plan
        useful = max(0.0, useful - before * change.lost_work_s)
        # Back on the full layout (a spare's join, a repair): its rate is known.
        rate, step_s = full if plan is full_plan else _priced_after(plan, full_plan, full, model, policy.schedule)
        resume_at = max(resume_at, t + change.downtime_s)
        timeline += [(t, 0.0), (resume_at, rate)]
        if first_ratio is None and before > 0:
            first_ratio, first_after = rate / before, rate
            first_batch = _whole(plan) / _whole(full_plan) if plan is not None else 0.0
        if joined:
            joins += 1
        else:
            failures += 1
            store_losses += change.store_lost
            lost.append(change.downtime_s + change.lost_work_s)
            if plan is None:
                stalls += 1
            else:
                mttrs.append(change.downtime_s + change.lost_work_s + step_s)
    useful += rate * max(0.0, duration_s - max(t, resume_at))
    return PolicyResult(
        policy=policy.name, throughput_after_over_before=first_ratio, throughput_before=full_rate,
        throughput_after=first_after,
        goodput=useful / (full_rate * duration_s) if full_rate > 0 else 0.0, batch_after_over_before=first_batch,
        mttr_s=sum(mttrs) / len(mttrs) if mttrs else None,
        time_lost_per_failure_s=sum(lost) / len(lost) if lost else None,
        failures=failures, joins=joins, stalls=stalls, useful_micro_batches=useful, timeline=timeline,
        devices=policy.devices, spares=policy.spares, store_losses=store_losses, duration_s=duration_s)
