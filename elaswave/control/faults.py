"""Real fault injection: a rank delivers SIGKILL (or SIGSTOP, a hang) to itself at a chosen point.

``kill:rank=R,step=S[,phase=P]`` and ``stop:rank=R,step=S[,phase=P]``; phases are the points of a
step at which the signal goes out. Before the signal the rank stamps the wall time of the fault
in the store, which is where every MTTR is measured from, and prints it (one line on stderr) for
runs whose store does not outlive the fault: a job that torchrun restarts gets a new store.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # keeps this module free of torch: config validation imports it
    from elaswave.control.membership import Membership

KINDS = ("kill", "stop")
PHASES = ("forward", "backward", "reduce", "optimizer", "snapshot")
"""forward/backward: as the step's first forward/backward starts; reduce: as the gradient reduction
starts; optimizer: after this rank's chunks were updated, before the parameters are gathered;
snapshot: just after this rank posted the step's snapshot to its holder."""


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    phase: str = "forward"


def parse(text: str) -> Fault:
    """``kill:rank=2,step=12,phase=reduce`` -> Fault; ValueError naming what is wrong."""
    usage = "use kill:rank=R,step=S[,phase=P] or stop:rank=R,step=S[,phase=P]"
    kind, sep, rest = text.strip().partition(":")
    if kind not in KINDS or not sep:
        raise ValueError(f"{text!r}: the fault must start with one of {', '.join(KINDS)}; {usage}")
    fields: dict[str, str] = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in ("rank", "step", "phase"):
            raise ValueError(f"{text!r}: {item!r} is not rank=, step= or phase=; {usage}")
        fields[key.strip()] = value.strip()
    if "rank" not in fields or "step" not in fields:
        raise ValueError(f"{text!r}: rank= and step= are required; {usage}")
    try:
        rank, step = int(fields["rank"]), int(fields["step"])
    except ValueError:
        raise ValueError(f"{text!r}: rank and step must be integers") from None
    if rank < 0 or step < 0:
        raise ValueError(f"{text!r}: rank and step must be >= 0")
    phase = fields.get("phase", "forward")
    if phase not in PHASES:
        raise ValueError(f"{text!r}: phase={phase} is not one of {', '.join(PHASES)}")
    return Fault(kind, rank, step, phase)


class FaultInjector:
    def __init__(self, faults: Sequence[Fault], rank: int, membership: "Membership | None"):
        self.mine = [f for f in faults if f.rank == rank]
        self.membership = membership

    def at(self, step: int, phase: str) -> None:
        for f in self.mine:
            if f.step == step and f.phase == phase:
                if self.membership is not None:
                    self.membership.stamp(f"fault/{f.rank}")
                print(f"elaswave: injecting {f.kind} into rank {f.rank} at step {step} ({phase}), "
                      f"wall time {time.time():.6f}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL if f.kind == "kill" else signal.SIGSTOP)
