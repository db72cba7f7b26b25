"""Liveness on etcd: each rank holds a lease, and a lease that expires is a death proven by quorum.

On the embedded TCPStore a rank shows it lives by adding to a counter that two watchers poll
(:mod:`~elaswave.control.heartbeat`). On etcd that would be a Raft-committed write per beat and a
linearizable read per watcher and beat -- measured, the control plane's requests then cost the job
more than its collectives' waits. Here instead a rank's watcher thread grants one lease with a TTL
of ``elastic.heartbeat_timeout_s`` rounded up to whole seconds, plus one (and raised by etcd to its
minimum), puts ``ew/alive/<rank>`` bound to it, and renews it a few times per TTL. A renewal is
answered by the leader alone, no log entry.

Eviction on evidence, within the timeout: a rank's two watchers ask the leader (``timetolive``,
no log entry either) how long its lease has left. etcd answers in whole seconds, rounded down, so
an answer of 0 says: under one second left, no renewal for more than TTL - 1 >= the timeout. Each
watcher that reads 0 names the rank in an alert; both naming it leave it out (as two watchers
seeing a stale heartbeat do on the TCPStore), about when the timeout says -- not when the
leader's expiry check, every 0.5 s, gets to it and a revocation commits. A lease read with two
or more seconds left is read again a second later at the latest (it cannot reach 0 sooner than
that less one second), one with one second left every 0.05 s.

Every rank follows the ``ew/alive/`` prefix on one watch stream. When a rank stops renewing
(killed, SIGSTOPped, its host silent or cut off from the etcd majority) the leader expires its
lease and deletes the key; every follower sees the deletion, asks the cluster whether the lease
really expired (``timetolive`` says -1: not a key someone deleted), and the rank's watchers record
the death (``ew/dead/<rank>``) with the time of its last renewal -- the expiry less the TTL, on the
leader's clock -- from which the recovery times its MTTR. The expiry is the proof where a rank has
one watcher left. A watcher starved for seconds evicts nobody: the leader's answers and its expiry
are the verdict, not the watcher's view.

A rank that ends cleanly (or is left out and exits) puts its key back without the lease first,
so its end is never taken for a death.
"""
from __future__ import annotations

import base64
import json
import math
import queue
import threading
import time

from elaswave.control import sequence
from elaswave.control.etcd import REQUEST_TIMEOUT_S
from elaswave.control.seal import PREFIX, opened, seal, sealed

ALIVE = PREFIX + "alive/"
ALERTS, REQUESTS = PREFIX + "alert/", PREFIX + "join/"
RENEWALS_PER_TTL = 4
"""Renewals per TTL: a rank is suspected only after two or three renewals in a row were missed."""
CLOSE_READ_S = 0.05
"""How often a watcher asks about a lease with under two seconds left."""
LATE_S = 3 * REQUEST_TIMEOUT_S
"""How late a live rank may check in after an alert: its watch stream waits out one request
deadline on a member that went silent before it moves on to the next, its watcher's first request
to that member another, and its check-in a third. An agreement waits this much longer (once, not
per rank) while a member it misses still renews its lease."""


def _numbered(name: str, prefix: str) -> bool:
    return name.startswith(prefix) and name[len(prefix):].isdigit()


def supported(store) -> bool:
    """Whether ``store`` (through its links and seal) is on etcd, which grants leases."""
    try:
        return callable(getattr(store, "grant"))
    except AttributeError:
        return False


class Lease:
    """This rank's lease, and the deaths of others seen on the ``ew/alive/`` stream."""

    def __init__(self, store, rank: int, timeout_s: float):
        """``store``: the watcher's (sealed) link to the etcd store."""
        self.store, self.rank = store, rank
        # One second over the timeout: etcd's answers are whole seconds, and "0 left" must mean
        # "not renewed for the timeout" (see the module's doc).
        self.ttl_s = max(1, math.ceil(timeout_s)) + 1
        self._watched: dict[int, tuple[int | None, float, float]] = {}
        """rank -> (its lease, when to ask about it next (monotonic), when it last had a second left (wall))."""
        self._left_at: dict[int, tuple[float, int]] = {}
        """rank -> (when its lease was last asked about (wall), the whole seconds it had left then)."""
        self.id: int | None = None
        self.expired_own = False
        """This rank's lease expired before it renewed it: the job holds it dead (it will be left out)."""
        self.renewed_at = 0.0
        self.alert_seen = 0
        """The highest alert number whose (sealed) record the stream has seen put."""
        self.requests_seen: int | None = None
        """The highest join request number whose sealed record the stream has seen put (None: not
        yet known): the leader's check for join requests in every step reads this, not the store."""
        self._deletions: queue.SimpleQueue = queue.SimpleQueue()
        self._changed = threading.Condition()
        self._halt = threading.Event()
        self._follower: threading.Thread | None = None
        self.follow()

    # -- this rank's lease ----------------------------------------------------------------------
    def follow(self) -> None:
        """Start following the job's records (before the watcher reads how many alerts there are:
        every alert numbered after that is then seen put)."""
        self._follower = self.store.clone().follow(PREFIX, self._on_event, self._halt)
        # The requests put before the stream began (they only grow).
        counted = sequence.count(sealed(self.store), REQUESTS, 0)
        self.requests_seen = max(self.requests_seen or 0, counted)

    def beat(self) -> None:
        """Grant the lease and start renewing it (on the first call)."""
        if self.id is not None:
            return
        self.id, self.ttl_s = self.store.grant(self.ttl_s)
        self._put(json.dumps({"lease": self.id, "ttl_s": self.ttl_s}), self.id)
        self.renewed_at = time.monotonic()
        # A thread and a link of its own: a renewal must never wait behind the watcher's other
        # requests, nor behind a member that stopped answering (each member gets 1/8 TTL). Through
        # a link sharing the process's verdict: renewals that fail past the grace declare the
        # store lost -- in a steady job on etcd they may be the only requests a rank makes.
        try:
            renewer = self.store.separate()
        except AttributeError:  # a bare store (no link): a connection of its own
            renewer = self.store.clone()
        threading.Thread(target=self._renew, args=(renewer,), name=f"elaswave-lease-{self.rank}",
                         daemon=True).start()

    def _renew(self, store) -> None:
        every_s = self.ttl_s / RENEWALS_PER_TTL
        while not self._halt.wait(max(0.0, self.renewed_at + every_s - time.monotonic())):
            try:
                left = store.keep_alive(self.id, timeout_s=self.ttl_s / 8)
            except Exception:  # noqa: BLE001 - no member answered: again at the next period
                self.renewed_at = time.monotonic()
                continue
            if left <= 0:
                # Renewed too late (this process was stopped or starved past the TTL): dead to the job.
                self.expired_own = True
                return
            self.renewed_at = time.monotonic()

    def close(self) -> None:
        """A clean end: the key stays (unbound), so the lease's end is no death; then stop following."""
        self._halt.set()
        if self.id is not None and not self.expired_own:
            try:
                self._put("ended", None)
                self.store.revoke(self.id)
            except Exception:  # noqa: BLE001 - the store is gone: the lease expires by itself
                pass

    def _put(self, value: str, lease: int | None) -> None:
        name = f"{ALIVE}{self.rank}"
        key = getattr(self.store, "key", None)
        self.store.put_leased(name, seal(key, name, value) if key is not None else value, lease)

    # -- the others ---------------------------------------------------------------------------------
    def _on_event(self, kind: str, name: str, value: bytes | None, prev: dict | None) -> None:
        if kind == "DELETE" and name.startswith(ALIVE) and name[len(ALIVE):].isdigit() and prev and "lease" in prev:
            self._deletions.put((int(name[len(ALIVE):]), int(prev["lease"]), prev.get("value"), time.time()))
            with self._changed:  # the watcher waiting for an alert looks at once, not at its next beat
                self._changed.notify_all()
        elif kind == "PUT" and _numbered(name, REQUESTS) and self._sealed_here(name, value):
            self.requests_seen = max(self.requests_seen or 0, int(name[len(REQUESTS):]))
        elif kind == "PUT" and _numbered(name, ALERTS) and self._sealed_here(name, value):
            with self._changed:
                self.alert_seen = max(self.alert_seen, int(name[len(ALERTS):]))
                self._changed.notify_all()

    def _sealed_here(self, name: str, value: bytes | None) -> bool:
        """Whether a record put is the job's: a forged one numbered far ahead must not count."""
        key = getattr(self.store, "key", None)
        return value is not None and (key is None or opened(key, name, value) is not None)

    def expired(self) -> list[tuple[int, float, int, float | None]]:
        """The ranks whose lease ended since the last call: (rank, wall time of its last renewal,
        TTL, the seconds it still had when it ended -- None when it ran out: expired; a number when
        it was *revoked*, by someone with access to the cluster, before it could expire)."""
        out = []
        while True:
            try:
                rank, lease, raw, seen_wall = self._deletions.get_nowait()
            except queue.Empty:
                return out
            if not self._genuine(rank, raw) or self.store.lease_left(lease) >= 0:
                continue  # not the job's record, or deleted by someone while its lease lives: no death
            asked_wall, left = self._left_at.get(rank, (None, 0))
            if asked_wall is not None and seen_wall < asked_wall + left - 1:  # (whole seconds, rounded down)
                out.append((rank, seen_wall, self.ttl_s, asked_wall + left - seen_wall))
            else:
                out.append((rank, seen_wall - self.ttl_s, self.ttl_s, None))

    def _genuine(self, rank: int, raw_b64: str | None) -> bool:
        key = getattr(self.store, "key", None)
        if key is None:
            return True
        return raw_b64 is not None and opened(key, f"{ALIVE}{rank}", base64.b64decode(raw_b64)) is not None

    def renewing(self, rank: int) -> bool:
        """Whether ``rank`` still renews its lease (at least TTL - 1 left, in whole seconds, which
        a lease unrenewed for the timeout no longer has): then a port of its that stays silent is
        a network between us, not its death. A lease that runs out
        instead will soon prove the death, which says more than this rank's silence (and spares
        the check-ins' reachability probes). One request, on a silent port only."""
        lease = self._lease_of(rank)
        return lease is not None and self.store.lease_left(lease) >= self.ttl_s - 1

    def lives(self, rank: int, store=None) -> bool | None:
        """Whether ``rank``'s lease is renewed: it has a second or more left, which a lease
        unrenewed for the timeout no longer has. None when the store cannot be asked now.
        ``store``: the caller's own link (default: the watcher's), so that a main thread asking
        neither waits behind the watcher's requests nor holds them up."""
        store = store or self.store
        try:
            lease = self._lease_of(rank, store)
            return lease is not None and store.lease_left(lease) >= 1
        except Exception:  # noqa: BLE001 - the store does not answer: no evidence either way
            return None

    def _lease_of(self, rank: int, store=None) -> int | None:
        """``rank``'s lease, from its record; None before it granted one, or once it expired or ended."""
        raw = sealed(store or self.store).read(f"{ALIVE}{rank}")
        return int(json.loads(raw)["lease"]) if raw is not None and raw.startswith(b"{") else None

    def unrenewed(self, rank: int) -> float | None:
        """When asked (see the module's doc): whether ``rank``'s lease went unrenewed for the
        timeout -- the leader says it has under a second left. Then the earliest its last renewal
        can have been (wall clock: a second left when last read, less the TTL); else None."""
        lease, due, second_left = self._watched.get(rank, (None, 0.0, 0.0))
        now = time.monotonic()
        if now < due:
            return None
        lease = lease if lease is not None else self._lease_of(rank)
        if lease is None:
            self._watched[rank] = (None, now + 0.5, second_left)
            return None
        asked_wall, left = time.time(), self.store.lease_left(lease)
        self._left_at[rank] = (asked_wall, left)
        if left < 0:  # expired (the deletion proves it) or revoked: its next lease, if any, afresh
            self._watched[rank] = (None, now + 0.5, second_left)
            return None
        if left >= 1:
            self._watched[rank] = (lease, now + (min(1.0, left - 1) if left >= 2 else CLOSE_READ_S), asked_wall)
            return None
        self._watched[rank] = (lease, now + 1.0, second_left)
        return (second_left or asked_wall - 1) - (self.ttl_s - 1)

    def next_read_in(self) -> float:
        """Seconds until a lease is due to be asked about again (the watcher waits no longer)."""
        now = time.monotonic()
        return max(0.0, min((due - now for _, due, _ in self._watched.values()), default=1.0))

    def alert_posted(self, n: int, within_s: float) -> bool:
        """Whether alert ``n`` (or a later one) was put, waiting up to ``within_s`` for it, or less
        when a lease's key is deleted meanwhile (:meth:`expired` has news)."""
        with self._changed:
            self._changed.wait_for(lambda: self.alert_seen >= n or not self._deletions.empty(), within_s)
            return self.alert_seen >= n
