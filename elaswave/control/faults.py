"""Real fault injection: a rank delivers SIGKILL (or SIGSTOP, a hang) to itself at a chosen point.

``kill:rank=R,step=S[,phase=P]`` and ``stop:rank=R,step=S[,phase=P]``; phases are the points of a
step at which the signal goes out. ``corrupt:rank=R,step=S`` flips a byte of the snapshot the rank
sends after step S, after its checksum was computed (what a bad link or bad memory would do);
``slow:rank=R,step=S,factor=F`` makes the rank's compute F times as slow from step S on.
``starve:rank=R,step=S[,seconds=X]`` holds the rank's watcher thread back for X s (default 3) as
step S starts, while the rank computes on: a thread a loaded host does not schedule, or one held up
in a slow call. Its view of its neighbours is then X s old, which must not evict any of them.
``flip:rank=R,step=S,what=moment|param|replica`` flips the lowest bit of one value after step S: of the
first Adam moment the rank owns, of its first parameter, or (parallel.tp > 1) of the first value it
holds of a tensor its device's other shards hold too, in its parameters and its master alike (a
shard whose replica drifted); silent data corruption, which only the end-of-run state check can see. ``join:step=S[,count=N]`` is the opposite event, carried out by
the launcher: it starts N new ranks once the job reaches step S. Before the signal the rank stamps the wall time of the fault
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

KINDS = ("kill", "stop", "corrupt", "slow", "flip", "join", "starve")
FLIPPED = ("moment", "param", "replica")
PHASES = ("forward", "backward", "weight", "reduce", "optimizer", "snapshot", "recovery", "eval", "admission",
          "dispatch", "combine")
"""forward/backward: as the step's first forward/backward (its B, under ZB-H1) starts; weight: as
its first W starts (ZB-H1's weight pass, parallel.schedule=zb-h1; never under 1F1B); reduce: as the gradient reduction
starts; optimizer: after this rank's chunks were updated, before the parameters are gathered;
snapshot: just after this rank posted the step's snapshot to its holder; recovery: during a
recovery that resumes at the step, as the chunks are about to move (a failure during a recovery);
eval: in the evaluation due before the step (train.eval_every), as its last batch starts;
admission: a joining rank (numbered past the job's world size), just after it posted its join
request -- before it knows the job's step, so ``step=0`` -- which the leader then admits;
dispatch/combine: as the step's first expert exchange of that kind starts (parallel.ep > 1: the
rows going to their experts' owners, the outputs coming back; expert/exchange.py)."""
USAGE = ("use kill:rank=R,step=S[,phase=P], stop:rank=R,step=S[,phase=P], corrupt:rank=R,step=S, "
         "slow:rank=R,step=S[,factor=F], flip:rank=R,step=S,what=moment|param|replica, starve:rank=R,step=S[,seconds=X] "
         "or join:step=S[,count=N]")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    phase: str = "forward"
    count: int = 1
    """join: how many new ranks the launcher starts once the job reaches ``step`` (rank is -1)."""
    factor: float = 1.0
    """slow: from ``step`` on, the rank's compute takes this many times as long (a straggler)."""
    what: str = ""
    """flip: which value gets a bit flipped (``moment``, ``param`` or ``replica``)."""
    seconds: float = 3.0
    """starve: how long the rank's watcher thread is held back."""


def parse(text: str) -> Fault:
    """``kill:rank=2,step=12,phase=reduce`` or ``join:step=20,count=2`` -> Fault; ValueError naming
    what is wrong."""
    kind, sep, rest = text.strip().partition(":")
    if kind not in KINDS or not sep:
        raise ValueError(f"{text!r}: the fault must start with one of {', '.join(KINDS)}; {USAGE}")
    allowed = {"join": ("step", "count"), "slow": ("rank", "step", "factor"),
               "flip": ("rank", "step", "what"), "starve": ("rank", "step", "seconds")}.get(kind, ("rank", "step", "phase"))
    fields: dict[str, str] = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in allowed:
            raise ValueError(f"{text!r}: {item!r} is not one of {', '.join(k + '=' for k in allowed)}; {USAGE}")
        fields[key.strip()] = value.strip()
    required = ("step",) if kind == "join" else ("rank", "step", "what") if kind == "flip" else ("rank", "step")
    if any(k not in fields for k in required):
        raise ValueError(f"{text!r}: {' and '.join(k + '=' for k in required)} {'are' if len(required) > 1 else 'is'} required; {USAGE}")
    try:
        rank, step, count = int(fields.get("rank", -1)), int(fields["step"]), int(fields.get("count", 1))
        factor = float(fields.get("factor", 3.0 if kind == "slow" else 1.0))
        seconds = float(fields.get("seconds", 3.0))
    except ValueError:
        raise ValueError(f"{text!r}: rank, step and count must be integers, factor and seconds numbers") from None
    if step < 0 or (kind != "join" and rank < 0) or count < 1 or factor < 1 or not 0 < seconds <= 600:
        raise ValueError(f"{text!r}: rank and step must be >= 0, count >= 1, factor >= 1 and 0 < seconds <= 600")
    phase = fields.get("phase", "forward")
    if phase not in PHASES:
        raise ValueError(f"{text!r}: phase={phase} is not one of {', '.join(PHASES)}")
    if phase == "admission" and step != 0:
        raise ValueError(f"{text!r}: phase=admission comes before a joiner knows the job's step: use step=0")
    what = fields.get("what", "")
    if kind == "flip" and what not in FLIPPED:
        raise ValueError(f"{text!r}: what={what} is not one of {', '.join(FLIPPED)}")
    return Fault(kind, rank, step, phase, count, factor, what, seconds)


class FaultInjector:
    def __init__(self, faults: Sequence[Fault], rank: int, membership: "Membership | None"):
        self.mine = [f for f in faults if f.rank == rank]
        self.membership = membership

    def corrupts(self, step: int) -> bool:
        """Whether this rank's snapshot sent after ``step`` is to be damaged in flight (``corrupt``)."""
        hit = any(f.kind == "corrupt" and f.step == step for f in self.mine)
        if hit:
            print(f"elaswave: injecting a corrupted snapshot from rank {self.mine[0].rank} after step {step}",
                  file=sys.stderr, flush=True)
        return hit

    def flips(self, step: int) -> list[str]:
        """What gets a bit flipped on this rank after ``step`` (``flip``)."""
        hit = [f.what for f in self.mine if f.kind == "flip" and f.step == step]
        for what in hit:
            print(f"elaswave: injecting a flipped bit into rank {self.mine[0].rank}'s first {what} after step {step}",
                  file=sys.stderr, flush=True)
        return hit

    def slowdown(self, step: int) -> float:
        """How many times as long this rank's compute takes at ``step`` (``slow``)."""
        return max([f.factor for f in self.mine if f.kind == "slow" and f.step <= step], default=1.0)

    def starves(self, step: int) -> float:
        """How long this rank's watcher thread is held back as ``step`` starts (``starve``; 0: not)."""
        hit = [f.seconds for f in self.mine if f.kind == "starve" and f.step == step]
        if hit:
            print(f"elaswave: injecting a starved watcher into rank {self.mine[0].rank} at step {step} "
                  f"({max(hit):g} s), wall time {time.time():.6f}", file=sys.stderr, flush=True)
        return max(hit, default=0.0)

    def at(self, step: int, phase: str) -> None:
        for f in self.mine:
            if f.kind in ("kill", "stop") and f.step == step and f.phase == phase:
                if self.membership is not None:
                    self.membership.stamp(f"fault/{f.rank}")
                print(f"elaswave: injecting {f.kind} into rank {f.rank} at step {step} ({phase}), "
                      f"wall time {time.time():.6f}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL if f.kind == "kill" else signal.SIGSTOP)
