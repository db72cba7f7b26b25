"""Admission of joining ranks, through the store: a request proving the job's token, and a verdict.

A joining process (a replacement the launcher respawns, or extra capacity started with
``elaswave join``) posts a *request* ``ew/join/<n>``, sealed like every control record
(:mod:`elaswave.control.seal`): an HMAC of the request and its number ``n`` under the job's key,
which only a holder of the job's token (``ELASWAVE_TOKEN``, never in the store) can derive from
the job's nonce. The number is the challenge: the request is the next record of a sealed sequence
(:mod:`elaswave.control.sequence`; no counter says how many there are), and a seal for one number,
one store generation or one job proves nothing for another, so a request read off the store
cannot be replayed. A request that is not sealed is not the job's and is not answered. The epoch's leader (its
lowest rank) reads new requests once per step, before the step's loss exchange, and either
*refuses* one (wrong token, or no plan can take it: a clear verdict the joiner prints) or *admits*
it into the next epoch: it writes the joining ranks and the plan they join, and counts them into
the exchange, so every member learns of the join in the same step and grows at its end. A
joiner that a failure kept out of that epoch is admitted again at a later step.
"""
from __future__ import annotations

import json
import os
import secrets
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from elaswave.control import sequence
from elaswave.control.seal import PREFIX, sealed

TOKEN_ENV = "ELASWAVE_TOKEN"
JOIN_ENV = "ELASWAVE_JOIN"
"""Set (to 1) in a process that joins a running job instead of starting one."""
STARTED_ENV = "ELASWAVE_STARTED"
"""Wall time at which the launcher started a joining process (its start-up is part of a join's time)."""
SPARE_ENV = "ELASWAVE_SPARE"
"""Set (to 1) in a warm spare: a joiner that stands by, started up, until its agent promotes it."""
SPARE_HOST_ENV = "ELASWAVE_SPARE_HOST"
"""Set (to 1) in a joiner of a spare host (``elaswave run --spare-nodes``): it asks in at once, and
the leader admits it only while the job is below its founding size."""
REQUESTS = PREFIX + "join/"


def promote(store: dist.Store, rank: int) -> None:
    """The agent's side of a warm spare: tell the standing-by ``rank`` to ask in now."""
    store.set(f"{PREFIX}spare/{rank}", repr(time.time()))


def job_token() -> str | None:
    return os.environ.get(TOKEN_ENV) or None


def new_token() -> str:
    return secrets.token_hex(16)


class Refused(RuntimeError):
    """The job would not take this rank; the message says why."""


@dataclass(frozen=True)
class Request:
    rank: int
    started_wall: float
    requested_wall: float
    spare: bool = False
    """A spare host's: admitted only into room a lost rank left (never to grow the job)."""


@dataclass(frozen=True)
class Verdict:
    epoch: int
    joining: tuple[int, ...]
    prev_plan: dict
    admitted_wall: float
    run: int = 0
    """The run of the checkpoint directory the job is (its writes' fence)."""
    devices: tuple = ()
    """With tensor parallelism: the ranks of each of the job's devices at ``prev_plan``
    (:class:`elaswave.tensor.layout.Devices`); the joiners make new ones, ``tp`` at a time."""


class Admission:
    """Both sides of the protocol for one process (the joiner's, or the leader's)."""

    def __init__(self, store: dist.Store, rank: int):
        self.store, self.rank = sealed(store), rank
        self.seen = 0
        self.requests: dict[int, Request] = {}
        self.refused: set[int] = set()
        self._told: set[int] = set()
        self.admitted_at: dict[int, float] = {}
        self.counted: Callable[[], int | None] | None = None
        """The number of join requests as a watch stream last saw it (on etcd,
        :class:`~elaswave.control.leases.Lease`), so that the leader's check in every step reads
        the store only when there is something new; None: look for the next one in the store."""

    # -- the joiner's side -------------------------------------------------------------------
    def stand_by(self, poll_s: float = 0.5) -> float | None:
        """A warm spare waits here, everything that does not depend on its future place already
        built, until promoted (returns the wall time of the promotion) or the job is done (None)."""
        key = f"{PREFIX}spare/{self.rank}"
        while self._wait_unless_done(key, None, poll_s):
            promoted = self.store.read(key)  # sealed: a forged promotion is no promotion
            if promoted is not None:
                return float(promoted)
            time.sleep(poll_s)  # (the leader's genuine one replaces it)
        return None

    def job_done(self) -> bool:
        return self.store.read(PREFIX + "done") is not None  # sealed: a forged "done" stops no joiner

    def _wait_unless_done(self, key: str, timeout_s: float | None, poll_s: float = 0.5) -> bool:
        """Wait for ``key``: True once it is set, False as soon as the job is done (each wait is one
        ``poll_s`` slice, so the end of the job is seen within it, not after a fixed margin);
        TimeoutError after ``timeout_s`` (None: no limit)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            slice_s = poll_s if deadline is None else max(0.01, min(poll_s, deadline - time.monotonic()))
            try:
                self.store.wait([key], timedelta(seconds=slice_s))
                return True
            except Exception:  # c10d's timeout error: not there yet
                if self.job_done():
                    return False
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(key) from None

    def request(self, started_wall: float, spare: bool = False) -> None:
        doc = {"rank": self.rank, "started_wall": started_wall, "requested_wall": time.time(), "spare": spare}
        sequence.append(self.store, REQUESTS, json.dumps(doc))  # (a rank's request is unlike any other's)

    def wait_verdict(self, attempt: int, timeout_s: float | None) -> Verdict | None:
        """The leader's answer to this rank's request (``attempt`` 1, or later ones after a failure
        kept it out), or None if the job finished first; raises :class:`Refused` or TimeoutError
        (``timeout_s`` None: a spare host's joiner, which waits as long as the job runs)."""
        key = f"{PREFIX}join/{self.rank}/verdict/{attempt}"
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                if not self._wait_unless_done(key, None if deadline is None else max(0.0, deadline - time.monotonic())):
                    return None
            except TimeoutError:
                raise TimeoutError(f"rank {self.rank}: no answer to the join request within {timeout_s}s "
                                   "(is the job still running?)") from None
            raw = self.store.read(key)
            if raw is not None:
                break
            time.sleep(0.1)  # forged: the leader's verdict replaces it
        doc = json.loads(sequence.body(raw))
        if not doc["admitted"]:
            raise Refused(f"rank {self.rank} was refused by the job: {doc['why']}")
        return Verdict(doc["epoch"], tuple(doc["joining"]), doc["prev_plan"], doc["admitted_wall"], doc.get("run", 0),
                       tuple(tuple(g) for g in doc.get("devices", ())))

    # -- the leader's side -------------------------------------------------------------------
    def pending(self, members: tuple[int, ...]) -> list[Request]:
        """Requests not yet answered for good: not refused, and not members already."""
        count = self.counted() if self.counted is not None else None
        while count is None or self.seen < count:
            n = self.seen + 1
            raw = self.store.read(f"{REQUESTS}{n}")
            if raw is None:
                if self.store.key is not None and self.store.raw.check([f"{REQUESTS}{n}"]) and n not in self._told:
                    self._told.add(n)  # the next real request replaces it
                    print(f"elaswave: join request {n} is not sealed with the job's token: not answered",
                          file=sys.stderr, flush=True)
                break
            self.seen = n
            doc = json.loads(raw)
            self.requests[doc["rank"]] = Request(doc["rank"], doc["started_wall"], doc["requested_wall"],
                                                 bool(doc.get("spare")))
        return [r for k, r in sorted(self.requests.items()) if k not in members and k not in self.refused
                and self.store.read(f"{PREFIX}dead/{k}") is None]

    @property
    def proves_tokens(self) -> bool:
        """Whether a request here proves the job's token (its seal): a job without one admits none."""
        return self.store.key is not None

    def refuse(self, rank: int, why: str) -> None:
        self.refused.add(rank)
        self._answer(rank, {"admitted": False, "why": why})

    def admit(self, ranks: list[int], epoch: int, prev_plan: dict, run: int = 0, devices: list | None = None) -> None:
        """``ranks`` in the order that makes devices of them (tensor parallelism: ``tp`` at a time)."""
        self.store.set(f"{PREFIX}ep/{epoch}/joining", json.dumps(ranks))
        for rank in ranks:
            self.admitted_at[rank] = time.time()
            self._answer(rank, {"admitted": True, "epoch": epoch, "joining": ranks, "prev_plan": prev_plan,
                                "admitted_wall": self.admitted_at[rank], "run": run, "devices": devices or []})

    def walls(self, ranks) -> dict[str, float]:
        """When the joiners started, first asked and were admitted, as this leader saw it; empty on
        a rank that did not admit them."""
        if not all(r in self.requests and r in self.admitted_at for r in ranks):
            return {}
        admitted = max(self.admitted_at[r] for r in ranks)
        if all(self.requests[r].spare for r in ranks):  # warm and waiting for room: their join starts now
            return {"started": admitted, "requested": admitted, "admitted": admitted}
        return {"started": min(self.requests[r].started_wall for r in ranks),
                "requested": min(self.requests[r].requested_wall for r in ranks), "admitted": admitted}

    def joining(self, epoch: int) -> tuple[int, ...]:
        """The ranks admitted into ``epoch``, in the order :meth:`admit` was given them."""
        raw = self.store.read(f"{PREFIX}ep/{epoch}/joining")
        return () if raw is None else tuple(json.loads(raw))

    def _answer(self, rank: int, doc: dict) -> None:
        """The rank's next verdict (its attempts are a sealed sequence: no count an outsider raised
        can make the leader answer where the joiner does not look)."""
        sequence.append(self.store, f"{PREFIX}join/{rank}/verdict/", sequence.unique(json.dumps(doc)))
