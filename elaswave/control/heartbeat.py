"""Each rank's watcher thread: heartbeats, a neighbour watch, and instant reaction to alerts.

It runs beside the training loop on its own store connection, so it keeps beating and checking in
while the main thread computes or waits in a collective. Each rank is watched by two others (of
other hosts where the job has several: :func:`watchers_of`), not by everyone, which keeps the
store traffic O(members) per interval. A missed heartbeat is a suspicion, not a death: it makes
every live rank check in, and a suspect is left out without waiting for it only once both its
watchers named it (:meth:`~elaswave.control.membership.Membership.known_dead`) -- one watcher
starved or cut off must not evict a healthy neighbour; a suspect that is alive checks in.

A heartbeat adds the milliseconds since the watcher started (at least 1) to the rank's counter: a
watcher only needs it to move, and the counter over ``hb0/<rank>`` (the watcher's start, wall
clock) says when the rank last showed a sign of life, which a recovery of a fault nobody injected
counts its MTTR from (:func:`~elaswave.control.membership.Membership.last_beat_wall`).
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from elaswave.control import leases
from elaswave.control.link import StoreLost
from elaswave.control.membership import ALERTS, MOVED_PATIENCE, PREFIX, WATCHERS, Membership, is_stale
from elaswave.interrupt import Interrupt


class Watcher(threading.Thread):
    def __init__(self, store: dist.Store, rank: int, view: Callable[[], tuple[int, tuple[int, ...]]],
                 interrupt: Interrupt, interval_s: float, timeout_s: float, prober=None,
                 agreed: Callable[[], int] = lambda: -1):
        super().__init__(name=f"elaswave-watcher-{rank}", daemon=True)
        self.membership = Membership(store, rank)
        self.prober = prober
        """The rank's :class:`~elaswave.control.liveness.Prober`: learns the next members' ports."""
        self.store, self.rank, self.view = store, rank, view
        self.agreed = agreed
        """The newest epoch this rank agreed on: during a recovery, the one it is building (its
        waits belong to that epoch, not to ``view``'s)."""
        self.interrupt, self.interval_s, self.timeout_s = interrupt, interval_s, timeout_s
        self._halt = threading.Event()
        self.lease = leases.Lease(store, rank, timeout_s) if leases.supported(store) else None
        """On etcd: this rank's lease, and the deaths its expiry proves (:mod:`~elaswave.control.leases`)."""
        self.seen_alerts = self.membership.alert_count()
        self._starve_s = 0.0
        """A fault (``starve``): how long the thread is held back at its next turn."""
        self.noticed_at: dict[int, float] = {}
        """epoch -> wall time (time.time()) at which this watcher learnt the epoch was broken."""

    def starve(self, seconds: float) -> None:
        """Hold this thread back for ``seconds`` at its next turn (``starve``: elaswave.control.faults)."""
        self._starve_s = seconds

    def stop(self) -> None:
        self._halt.set()
        if self.lease is not None:
            self.lease.close()

    def run(self) -> None:
        watched: tuple[int, ...] | None = None
        seen: dict[int, tuple[int | None, float]] = {}
        """target -> (its counter when it last moved, when that was seen)"""
        suspected_in: set[tuple[int, int]] = set()
        lost_at = silent_since = None
        ring_of, targets, hosts = None, (), {}
        moved = False
        """Whether this watcher watches on a store the job moved to."""
        beaten: set[int] = set()
        """The targets whose counter has moved on this store since this watcher came to it."""
        generation = getattr(self.store, "generation", 0)
        began, began_wall, sent_ms = time.monotonic(), time.time(), 0
        while not self._halt.is_set():
            if self._starve_s:
                starved, self._starve_s = self._starve_s, 0.0
                time.sleep(starved)
            if getattr(self.store, "generation", 0) != generation:
                # The store moved (elaswave.control.failover): a new store, with no alerts yet.
                generation, self.seen_alerts = self.store.generation, 0
                watched, lost_at, sent_ms = None, None, 0
                suspected_in.clear()
                seen, beaten, moved = {}, set(), True
            try:
                if self.lease is not None:
                    self.lease.beat()
                else:
                    if sent_ms == 0:
                        self.membership.stamp(f"hb0/{self.rank}", began_wall)
                    beat_ms = max(sent_ms + 1, int(1000 * (time.monotonic() - began)))
                    self.store.add(f"{PREFIX}hb/{self.rank}", beat_ms - sent_ms)
                    sent_ms = beat_ms
                epoch, members = self.view()
                if members != ring_of:  # who watches whom changes with the members alone
                    hosts.update(self.membership.hosts([r for r in members if r not in hosts]))
                    ring_of, targets = members, watch_targets(members, self.rank, hosts)
                if targets != watched:
                    watched, silent_since = targets, None
                    seen = {r: seen.get(r, (None, time.monotonic())) for r in targets}
                if self.prober is not None:  # so that their refusal proves their death later (once reached, no more probes)
                    self.prober.learn(_following(members, self.rank, 2), self.store)
                if self.lease is not None:
                    for target, last_wall, ttl_s, left_s in self.lease.expired():
                        if target in targets:  # its watchers speak for it
                            self.membership.lease_expired(epoch, target, last_wall, ttl_s, left_s)
                    for target in targets:
                        since = self.lease.unrenewed(target)
                        if since is not None and (epoch, target) not in suspected_in:
                            suspected_in.add((epoch, target))
                            self.membership.lease_unrenewed(epoch, target, since, self.lease.ttl_s - 1,
                                                            watchers=len(watchers_of(members, target, hosts)))
                for target in targets if self.lease is None else ():
                    # The clock is read before the counter: a watcher starved between the two (a GC
                    # pause, a loaded host) must not count its own absence as the neighbour's.
                    now = time.monotonic()
                    count = self.store.add(f"{PREFIX}hb/{target}", 0)
                    last, changed_at = seen[target]
                    if count != last:
                        if last is not None and count:  # (a moved store's counters start at 0)
                            beaten.add(target)
                        seen[target] = (count, time.monotonic())
                    elif (is_stale(changed_at, now, self.timeout_s) and (epoch, target) not in suspected_in
                          and not (moved and target not in beaten and self._on_its_way(target, now - changed_at))):
                        suspected_in.add((epoch, target))
                        self.membership.alert(epoch, f"rank {target} missed heartbeats for "
                                                     f"{now - changed_at:.2f}s", [target],
                                              watchers=len(watchers_of(members, target, hosts)))
                if targets:
                    silent_since = self._watch_reach(epoch, targets[0], silent_since, suspected_in)
                self._wait_for_alert(epoch)
            except StoreLost:
                if self._halt.is_set():
                    return
                # The ranks move the store or stop at the end of the step, which carries the news
                # to all of them. A main thread waiting on a peer that stopped first, or that died
                # with the store, is woken after the timeout (its recovery moves the store).
                lost_at = lost_at or time.monotonic()
                if time.monotonic() - lost_at > self.timeout_s:
                    # The epoch a recovery builds too: a survivor blocked in its migration, whose
                    # peers left it to move the store, waited out the group's timeout and was left
                    # out of the moved store's agreement (issue 58). Not once the store has moved:
                    # the epochs after the last trained one are agreed anew there.
                    lost_in = generation
                    self.interrupt.trip(max(self.view()[0], self.agreed()),
                                        unless=lambda: getattr(self.store, "generation", 0) != lost_in)
                time.sleep(self.interval_s)
            except Exception:  # the job is over (its store closed): nothing left to watch
                if self._halt.is_set():
                    return
                time.sleep(self.interval_s)

    def _on_its_way(self, target: int, silent_s: float) -> bool:
        """Whether a target that has not beaten on the store the job moved to yet is still given
        time: its liveness port answers, and it has been silent here for less than
        :data:`~elaswave.control.membership.MOVED_PATIENCE` heartbeat timeouts, as long as the
        recovery's agreement waits for it (its silence here must not prove its death sooner: it
        did, a live rank left out, issue 58). A port that does not answer (its host gone or cut
        off) gets no more than the timeout, as before."""
        if silent_s > MOVED_PATIENCE * self.timeout_s:
            return False
        return self.prober is None or self.prober.answers(target, self.store)

    def _watch_reach(self, epoch: int, neighbour: int, silent_since: float | None,
                     suspected_in: set[tuple[int, int]]) -> float | None:
        """The neighbour's liveness port, probed each beat over the network the collectives use: one
        that stays silent for the timeout while its heartbeat (through the store) goes on is cut off
        from this rank, and every collective with it would wait out ``parallel.timeout_s``. The
        alert names nobody: the check-ins' reachability reports decide who is left out."""
        if self.prober is None or not self.prober.is_silent(neighbour, self.store):
            return None
        now = time.monotonic()
        silent_since = silent_since or now
        if now - silent_since > self.timeout_s and (epoch, neighbour) not in suspected_in:
            if self.lease is not None and not self.lease.renewing(neighbour):
                return silent_since  # its lease runs out: the expiry will prove its death
            suspected_in.add((epoch, neighbour))
            self.membership.alert(epoch, f"rank {self.rank} cannot reach rank {neighbour}: its port has not "
                                         f"answered for {now - silent_since:.2f}s", network=True)
        return silent_since

    def _wait_for_alert(self, epoch: int) -> None:
        key = f"{ALERTS}{self.seen_alerts + 1}"
        if self.lease is not None:  # on etcd the watch stream says when (no request per interval)
            if not self.lease.alert_posted(self.seen_alerts + 1, min(self.interval_s, self.lease.next_read_in())):
                return
        else:
            try:
                self.store.wait([key], timedelta(seconds=self.interval_s))
            except Exception:  # timed out: no alert this interval
                return
        alert = self.membership.read_alert(self.seen_alerts + 1)
        if alert is None:
            # Forged (elaswave.control.seal): the next real alert replaces it in this slot. Not a
            # busy wait on a key that is there: this turn ends, the beats go on.
            time.sleep(self.interval_s if self.lease is None else 0.0)
            return
        self.seen_alerts += 1
        broken = self._broken_by(alert) if alert.epoch >= epoch else None
        if broken is not None:
            # Check in first: the others may be waiting for us to decide the next epoch.
            # Its report pending if the network is in question: the main thread probes and reports.
            self.membership.check_in(broken + 1, None if alert.network else (), keep=True)
            self.noticed_at.setdefault(alert.epoch, time.time())
            self.interrupt.trip(broken)

    def _broken_by(self, alert) -> int | None:
        """The epoch an alert breaks: its own, or -- when it names a member of an epoch agreed since
        (a death during a recovery) -- the newest such, which a recovery may be building right now.
        Agreed means its members are published: the epoch counter may not have moved yet. None: it
        names only ranks its own epoch had already left out (a launcher's report that came after
        the survivors proved the death and agreed without the rank) -- nothing breaks."""
        broken, e = alert.epoch, alert.epoch + 1
        while alert.ranks:
            members = self.membership.members_of(e)
            if members is None:
                break
            if set(alert.ranks) & set(members):
                broken = e
            e += 1
        if alert.ranks and broken == alert.epoch:
            own = self.membership.members_of(alert.epoch) if alert.epoch else None
            if own is not None and not set(alert.ranks) & set(own):
                return None
        return broken


def _following(members: tuple[int, ...], me: int, k: int) -> list[int]:
    """Up to ``k`` members after ``me`` in ring order."""
    if me not in members:
        return []
    i = members.index(me)
    return [members[(i + j) % len(members)] for j in range(1, min(k, len(members) - 1) + 1)]


def watchers_of(members: tuple[int, ...], rank: int, hosts: dict[int, str], k: int = WATCHERS) -> list[int]:
    """The members that watch ``rank``: the next ``k`` after it in ring order on other hosts than
    its own, then (too few hosts) on its own. A watcher on the watched rank's host shares its fate
    (a host paused, cut off, overloaded) and its view of the network."""
    i, n, mine = members.index(rank), len(members), hosts.get(rank)
    ring = (members[(i + j) % n] for j in range(1, n))
    other, same = [], []
    for r in ring:
        (other if mine is None or hosts.get(r) != mine else same).append(r)
        if len(other) == k:
            break
    return (other + same)[:k]


def watch_targets(members: tuple[int, ...], me: int, hosts: dict[int, str]) -> tuple[int, ...]:
    """The members ``me`` watches: those it is a watcher of."""
    if me not in members:
        return ()
    return tuple(r for r in members if r != me and me in watchers_of(members, r, hosts))
