"""The control plane's options, priced (pure): warm spares, and the loss of the store's host.

**Spares.** A pool of ``spares`` devices stands by outside the job's layout (counted in no plan,
training nothing). When a device fails and the pool is not empty, a spare takes its place in the
layout ``join_s`` after the failure; the failed device goes to repair and, once repaired, back into
the pool. With the pool empty a failure leaves a hole as it does without spares, and the next
device back from repair fills a hole before it refills the pool. This is a rewrite of the trace
from devices to the job's *slots* (its places in the plan): a spare's arrival is an event of kind
``spare`` for the slot, and a repair that only refills the pool is no event for the job at all.
Each policy prices a spare's arrival as it does a join (elaswave as the runtime does it: the
survivors recover first, the promoted spare joins at a step boundary); a restart takes it into
the restart already under way.

Two things are left out. Idle spares' own failures: they would cost the job nothing but a
smaller pool. And the trace keeps a slot "down" until its failed device is repaired, even after a
spare filled it, so that slot cannot fail again meanwhile: with a few of 16,384 slots in repair
at a time, that drops about one failure in 10,000.

**The store's host.** With ``store`` ``floor`` or ``failover`` the control store lives on the
first training host (node rank 0; ranks are numbered node-major, ``devices_per_node`` a host, as
elaswave's agents place it today), and stays there, so that both options meet the same losses on
a trace (only elaswave's policies model a store). Every failure of a device on that host is
counted as losing the store with it: an upper bound -- a GPU fault that leaves the host and its
agent up would not take the store along. ``dedicated`` puts the store on a host of its own, with no training devices,
whose failures the trace does not hold: no loss is priced (the simulator before stores were
modelled). The two answers to a loss:

- ``floor``: every worker sees the store gone within the heartbeat timeout, writes the last
  committed step from memory to disk, exits, and the job restarts from that checkpoint: no
  committed step is lost (the interrupted step is redone, as after any failure).
- ``failover``: the store moves to a survivor; then the failure is recovered as any other. Its
  detection still waits out the heartbeat timeout: the fast paths (the agent's report, the
  liveness probes' verdict) are posted through the store that is gone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from elaswave.sim.trace import Event

STORE_MODES = ("dedicated", "floor", "failover")


@dataclass(frozen=True)
class ControlCosts:
    """Seconds the control plane's options take. Measured ones cite their bench; the others are
    assumptions, named as such: set them for the cluster you model."""

    warm_join_s: float = 0.314
    """A warm spare, from the SIGKILL to its first productive step: median of 5, 0.268-0.347
    (``bench/results/join.md``, dp=2 x pp=2, 2-core box; the spare had paid start-up already)."""
    cold_join_s: float = 3.429
    """A cold replacement (a process started on the failure), same bench: median 3.429 s,
    2.760-3.907, 3.2 s of it Python and torch start-up."""
    store_detect_s: float = 2.0
    """How long workers take to see the store gone: ``elastic.heartbeat_timeout_s``'s default
    (``elaswave/control/config.py``); measured 2.037 s (2.018-2.043) from the SIGKILL of the store's
    process, median of 5 (``bench/results/store_loss.md``)."""
    checkpoint_write_s: float = 10.0
    """Assumption, not measured at this scale (the tiny job's ranks took 0.20 s,
    ``bench/results/store_loss.md``): every rank writes its shard of the last committed step to
    shared storage in parallel (~50 MB a rank: a 70B model's fp32 masters and two Adam moments,
    12 bytes a parameter, over 16,384 ranks); the figure is the storage system's, not elaswave's."""
    store_move_s: float = 1.0
    """Assumption at this scale: a new store on a survivor and every rank reconnected to it,
    membership keys re-posted. Measured on the tiny job (4 ranks, ``bench/results/store_loss.md``):
    3-9 ms for the move itself, beyond the links' grace (``store_detect_s``); with 16,384 ranks
    connecting to one survivor's store the figure is kept at 1 s until measured at scale."""


@dataclass(frozen=True)
class Control:
    """The control-plane options of one policy: ``spares`` idle devices, warm (``warm``) or cold,
    and what the job does when the store's host fails (``store``, one of :data:`STORE_MODES`)."""

    spares: int = 0
    warm: bool = True
    store: str = "dedicated"
    costs: ControlCosts = field(default_factory=ControlCosts)

    def __post_init__(self):
        if isinstance(self.spares, bool) or not isinstance(self.spares, int) or self.spares < 0:
            raise ValueError(f"spares={self.spares!r} is invalid: a count of idle devices, an integer >= 0")
        if self.store not in STORE_MODES:
            raise ValueError(f"store={self.store!r} is invalid: choose from {', '.join(STORE_MODES)}")
        for name, value in vars(self.costs).items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"costs.{name}={value!r} is invalid: seconds, finite and >= 0")

    @property
    def join_s(self) -> float:
        """From a failure to its spare's first step."""
        return self.costs.warm_join_s if self.warm else self.costs.cold_join_s

    def loses_store(self, device: int, devices_per_node: int) -> bool:
        """Whether a failure of ``device`` takes the store's host (the first, node rank 0) along."""
        return self.store != "dedicated" and device < devices_per_node


def slot_events(events: Sequence[Event], spares: int, join_s: float) -> list[Event]:
    """The trace as the job's slots see it with a pool of ``spares`` (see the module doc):
    failures stay; a failure met by a spare adds the spare's arrival in the slot (kind ``spare``)
    ``join_s`` later; a device back from repair fills the oldest hole (its own slot if that is one)
    or returns to the pool. Without spares the trace is unchanged."""
    pool = spares
    holes: list[int] = []
    slots: list[Event] = []
    for e in sorted(events):
        if e.kind == "fail":
            slots.append(e)
            if pool:
                pool -= 1
                slots.append(Event(e.t_s + join_s, "spare", e.device))
            else:
                holes.append(e.device)
        elif holes:
            slot = e.device if e.device in holes else holes[0]
            holes.remove(slot)
            slots.append(Event(e.t_s, "join", slot))
        else:
            pool += 1
    return sorted(slots)

