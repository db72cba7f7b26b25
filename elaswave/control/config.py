"""The elastic section of a job's config: detection, agreement, snapshots, policy, spares, faults.

Its own file, beside the control plane that reads most of it, as the model and data sections
live beside theirs.
"""
from __future__ import annotations

from dataclasses import dataclass

from elaswave.errors import fail as _fail

from elaswave.control import faults


POLICIES = ("elaswave", "drop_replica", "reroute")


@dataclass
class ElasticConfig:
    enabled: bool = True
    """Survive rank failures; off: one dead rank ends the job (the launcher stops every worker)."""
    heartbeat_interval_s: float = 0.2
    heartbeat_timeout_s: float = 2.0
    """A rank whose heartbeat has not moved for this long is declared gone (a hang, e.g. SIGSTOP)."""
    agree_timeout_s: float = 1.0
    """After an alert, a member that has not checked in within this long is left out of the next
    epoch. Only a member with no evidence either way waits for it: a dead process is shown dead
    sooner (its launcher reports it, or its liveness port refuses a probe), a hung one by its heartbeat."""
    launcher_reports_deaths: bool = True
    """The launcher tells the control plane the moment it reaps a dead worker; off: deaths are
    found as on a host nobody reports for (collective errors, probes, heartbeats) -- to measure that path."""
    store_failover: bool = True
    """When the process holding the control store dies and every member lives, the store moves to
    a member's standby and training goes on (:mod:`elaswave.control.failover`); off: every rank
    saves its state and stops, and a rerun resumes (:mod:`elaswave.runtime.rescue`)."""
    snapshots: bool = True
    """Copy every rank's ZeRO chunks into a peer's memory after each step (needed to recover them)."""
    snapshot_copies: int = 1
    """Peers that keep each rank's snapshot (on other hosts first): a rank lost together with up to
    this many minus one of its holders is still recovered from memory, not from a disk checkpoint.
    Each copy costs one more send per step and the memory of one more peer's snapshot per rank."""
    detours: bool = True
    """elaswave's planner may leave a broken pipeline's survivors in place and send its micro-batches
    (with model chunks, each lost chunk) through the other pipelines' same stage, when it predicts
    that faster than re-partitioning or standing the survivors by."""
    overlap_migration: bool = True
    """On a recovery, chunk parameters move first (the next forward needs them) and Adam moments
    travel while the next step computes; off: both before the step starts (the blocking baseline)."""
    standby_groups: bool = True
    """Pre-build the communicator for the loss of each member (gloo), so recovery does not wait for it."""
    policy: str = "elaswave"
    """elaswave: the dead rank's micro-batches move to survivors (global batch kept);
    drop_replica: a baseline that skips them and averages over the live replicas, as TorchFT does (a
    pipeline that lost a stage stands idle);
    reroute: a baseline for pipelines, as ReCycle does: the layout stays, and the broken pipeline's
    micro-batches pass through the same stage of the other pipelines in place of the lost one."""
    reshape: bool = False
    """elastic.policy=elaswave: after a change, deal the global batch's sequences, not whole
    micro-batches (plan/microbatches.py), so a pipeline may run micro-batches of fewer sequences and
    the pipelines finish a step together to within a sequence's time. The global batch and the
    gradient scale stay exact. Deterministic mode computes each sequence alone (its forward,
    backward and fixed-point gradient), so a run is bit-identical to the reference with
    train.micro_batch_size=1 and train.num_micro_batches x micro_batch_size, however the sequences
    are dealt; fast mode computes each micro-batch as one batch."""
    inject: tuple = ()
    """Faults to inject, e.g. "kill:rank=2,step=12,phase=reduce" or "stop:rank=1,step=5", and joins:
    "join:step=20,count=2" (the launcher starts two new ranks when the job reaches step 20)."""
    straggler_gain: float = 0.3
    """Re-plan the same ranks by their measured speeds (a slow rank gets fewer layers and fewer
    micro-batches) when that is predicted to save at least this fraction of a step; 0: never."""
    respawn_after_s: float = -1.0
    """The launcher starts a replacement (a new rank, which joins) this long after a rank dies;
    negative: never."""
    spares: int = 0
    """Warm spares per host: processes started up front that have imported torch, built what does
    not depend on their place, opened the data and connected, and stand by. A death on the host is
    filled by one at the next step boundary, and a new spare starts in the background."""

    def validate(self) -> None:
        for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "agree_timeout_s"):
            if getattr(self, name) <= 0:
                _fail(f"elastic.{name}", getattr(self, name), "must be > 0")
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            _fail("elastic.heartbeat_timeout_s", self.heartbeat_timeout_s,
                  f"must be >= 2 x elastic.heartbeat_interval_s={self.heartbeat_interval_s}")
        if self.spares < 0:
            _fail("elastic.spares", self.spares, "must be >= 0 (warm spare processes per host)")
        if self.snapshot_copies < 1:
            _fail("elastic.snapshot_copies", self.snapshot_copies, "must be >= 1 (elastic.snapshots=false turns "
                  "snapshots off)")
        if not 0.0 <= self.straggler_gain < 1.0:
            _fail("elastic.straggler_gain", self.straggler_gain, "must be in [0, 1) (0: never re-plan for stragglers)")
        if self.policy not in POLICIES:
            _fail("elastic.policy", self.policy, f"must be one of {', '.join(POLICIES)}")
        if self.reshape and self.policy != "elaswave":
            _fail("elastic.reshape", self.reshape, f"is only for elastic.policy=elaswave (got {self.policy}): the "
                  "baselines keep their micro-batches whole")
        for text in self.inject:
            try:
                faults.parse(text)
            except ValueError as exc:
                _fail("elastic.inject", text, str(exc))

    @property
    def faults(self) -> list[faults.Fault]:
        return [faults.parse(text) for text in self.inject]
