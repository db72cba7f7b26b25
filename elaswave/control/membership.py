"""Membership epochs on torch's TCPStore: alerts, check-ins and one agreed live set per epoch.

The protocol, all through the store (hosted by the launcher, or torchrun's rendezvous store):

1. Anyone who sees trouble in epoch ``e`` posts an *alert* ``ew/alert/<n>`` (n from a counter):
   a rank whose collective failed, a watcher whose neighbour's heartbeat went stale, the launcher
   that reaped a dead worker (it also writes ``ew/dead/<rank>``).
2. Every live rank's watcher thread wakes on the alert at once (``store.wait``) and *checks in* for
   epoch ``e + 1``. A killed or stopped process has no running thread, so it never checks in.
3. :func:`decide` -- a pure function of what the store holds and the time waited -- turns the
   check-ins into the next live set; the first rank to compute it publishes it with
   ``compare_set``, so every rank adopts the same decision.

A member that has not checked in is left out on evidence, not after a fixed wait: its death
reported (``ew/dead/<rank>``: by its launcher, or by a rank whose probe of its liveness port was
refused -- :mod:`elaswave.control.liveness`), or its heartbeat stale (an alert naming it). Only a
member with no evidence either way waits for ``agree_timeout_s``.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Collection, Mapping, Sequence

import torch.distributed as dist

from elaswave.control import partition, sequence
from elaswave.control.link import StoreLost
from elaswave.control.seal import PREFIX, sealed
from elaswave.interrupt import EpochBroken

ALERTS = PREFIX + "alert/"
EPOCH_FLOOR = PREFIX + "epoch_floor"
"""On a store the job moved to: the epoch it moved in (the epochs before were decided elsewhere)."""
LIVES_EVERY_S = 0.25
"""How often an agreement asks again whether a member it misses still lives (on etcd: two requests)."""
RESCAN_EVERY_S = 0.5
"""How often an agreement reads the check-ins again when their count says nothing changed."""
MOVED_PATIENCE = 6
"""On a store the job just moved to, for how many heartbeat timeouts a member not there yet whose
liveness port answers is waited for -- by its watchers, and by the recovery's agreement. A live
member blocked in a collective with the dead comes only once its links give up on the old store
and its watcher wakes it (two timeouts), and a loaded host stretches that: a live rank was left
out at two (issue 58). A port that does not answer earns no patience: a host lost with the store
costs no more time."""
WATCHERS = 2
"""Watchers per rank (:mod:`~elaswave.control.heartbeat`): a suspect both named is left out at
once; one alone only makes the agreement wait for it."""


def decide(prev_members: Sequence[int], checked_in: Collection[int], known_dead: set[int], waited_s: float,
           agree_timeout_s: float, proven_dead: set[int] = frozenset(),
           unreachable: Mapping[int, Sequence[int]] = {},  # noqa: B006 - read only
           alive: Collection[int] = frozenset(), alive_wait_s: float = 0.0) -> tuple[int, ...] | None:
    """The next epoch's members, or None while it is still too early to tell.

    Every previous member must have checked in or be known dead, unless ``agree_timeout_s`` has
    passed: then whoever has not checked in is presumed gone (a hung rank never checks in) --
    except a member shown ``alive`` (on etcd: its lease is renewed), which is waited for
    ``alive_wait_s`` longer: silence is no evidence against a rank the store says lives. A rank
    *proven* dead (reaped by its launcher, or its port refusing) is left out even if it checked in
    before it died: it would never post its state, and the epoch would wait for it. Of the ranks
    left, those cut off from the others by the network (``unreachable``, each rank's check-in
    report; see :mod:`~elaswave.control.partition`) are left out too."""
    live = live_members(prev_members, checked_in, proven_dead)
    missing = [r for r in prev_members if r not in checked_in and r not in known_dead]
    timed_out = waited_s >= agree_timeout_s + (alive_wait_s if any(r in alive for r in missing) else 0.0)
    reported = all(unreachable.get(r, ()) is not None for r in live)
    if (not missing or timed_out) and (reported or waited_s >= agree_timeout_s + partition.REACH_TIMEOUT_S):
        out = partition.cut(live, unreachable)
        return tuple(r for r in live if r not in out)
    return None


def has_majority(side: Collection[int], prev_members: Sequence[int], proven_dead: Collection[int],
                 holds_store: bool) -> bool:
    """Whether ``side`` may decide for the job on several hosts: more than half of the last agreed
    members not proven dead, or exactly half when it holds the store (so of two hosts cut apart, the
    store's side goes on and the other stops). A silent member is not proven dead: a partition
    looks the same from either side, so silence cannot count against the other side."""
    base = [r for r in prev_members if r not in proven_dead]
    have = sum(1 for r in base if r in side)
    return not base or 2 * have > len(base) or (holds_store and 2 * have == len(base))


class NoMajority(StoreLost):
    """This side of a partition holds no majority of the last epoch's members: it must not decide
    (it saves its state and stops; the other side, if it has the majority, goes on)."""


def live_members(prev_members: Sequence[int], checked_in: Collection[int], proven_dead: set[int]) -> tuple[int, ...]:
    """The previous members that checked in and are not proven dead."""
    return tuple(sorted(r for r in prev_members if r in checked_in and r not in proven_dead))


def is_stale(last_change_s: float, now_s: float, timeout_s: float) -> bool:
    """A heartbeat counter that has not moved for ``timeout_s`` (both times on the watcher's clock)."""
    return now_s - last_change_s > timeout_s


@dataclass(frozen=True)
class Alert:
    epoch: int
    by: str
    reason: str
    ranks: tuple[int, ...] = ()
    network: bool = False
    """Raised by a network symptom (a collective failed, a live peer's port went silent): the
    check-ins it causes carry reachability reports (see :mod:`~elaswave.control.partition`)."""
    watchers: int = 1
    """How many watchers the named ranks have, as its author saw the ring: so many must name a
    suspect before it counts as dead (one, for an alert that is not a suspicion)."""


class Membership:
    """Store operations of the protocol for one rank (or for the launcher, with ``rank=-1``)."""

    def __init__(self, store: dist.Store, rank: int, clock: Callable[[], float] = time.monotonic,
                 prober=None, requires_majority: bool = False):
        self.store = sealed(store)
        """Records are sealed and verified when ``store`` is a :class:`~elaswave.control.seal.Sealed` with the
        job's key (a forged one reads as absent); a plain store is used as it is."""
        self.rank, self.clock = rank, clock
        self.prober = prober
        """Tells whether a silent member is gone (:class:`~elaswave.control.liveness.Prober`); None: no probes."""
        self.requires_majority = requires_majority
        """A job on several hosts around one TCPStore: an agreement needs :func:`has_majority`."""
        self._hosts: dict[int, str] = {}
        self._alerts: dict[tuple[int, int], Alert] = {}
        """(the store's generation, n) -> alert n, as read there."""
        self._counted: tuple[int, int, int] = (-1, 0, 0)
        """(the store's generation, alerts counted there, the newest epoch decided there) as last read."""
        self.holds_store = True
        """Whether the store agreed on is the one the last epoch was agreed on (half of the members
        may decide there). False after this side elected a successor from a recovery, until the
        next agreement: a side cut off from the others could have elected its own."""

    # -- alerts -----------------------------------------------------------------------------
    def alert(self, epoch: int, reason: str, ranks: Sequence[int] = (), network: bool = False,
              watchers: int = 1) -> None:
        """Post an alert: the next record of the sealed sequence (:mod:`~elaswave.control.sequence`)."""
        by = "launcher" if self.rank < 0 else f"rank {self.rank}"
        doc = json.dumps({"epoch": epoch, "by": by, "reason": reason, "ranks": list(ranks), "network": network,
                          "watchers": watchers})
        sequence.append(self.store, ALERTS, sequence.unique(doc), self.alert_count())

    def report_dead(self, rank: int, how: str, alert: bool = True) -> None:
        """Record a death; ``alert``: tell the members too (not for a rank that never joined them).
        The first cause recorded stays: a rank whose lease was revoked exits when it finds out, and
        its launcher's "exited with code 3" is not why it was left out."""
        self.store.compare_set(f"{PREFIX}dead/{rank}", "", how)
        if alert:
            self.alert(self.current_epoch(), f"rank {rank} {how}", [rank])

    def _known(self, generation: int) -> tuple[int, int]:
        """(alerts, newest decided epoch) counted on the store of ``generation`` so far (a moved
        store starts afresh)."""
        counted, alerts, epoch = self._counted
        return (alerts, epoch) if counted == generation else (0, 0)

    def alert_count(self) -> int:
        """How many alerts the store holds: the unbroken run of sealed ones (no counter says it)."""
        # The generation read before counting: a move during the count must not file the old
        # store's count under the new one (the next alert would then look past a gap there).
        generation = self.store.generation
        alerts, epoch = self._known(generation)
        alerts = sequence.count(self.store, ALERTS, alerts)
        self._counted = (generation, alerts, epoch)
        return alerts

    def read_alert(self, n: int) -> Alert | None:
        """Alert ``n``; None when it is absent or forged. A genuine alert is never rewritten: read
        once (an agreement rescans the alerts every poll; on etcd each read is a request)."""
        key = (self.store.generation, n)
        if key in self._alerts:
            return self._alerts[key]
        raw = self.store.read(f"{ALERTS}{n}")
        if raw is None:
            return None
        doc = json.loads(sequence.body(raw))
        self._alerts[key] = Alert(doc["epoch"], doc["by"], doc["reason"], tuple(doc["ranks"]),
                                  doc.get("network", False), doc.get("watchers", 1))
        return self._alerts[key]

    def network_in_question(self, epoch: int) -> bool:
        """Whether an alert of ``epoch`` was raised by a network symptom."""
        return any((a := self.read_alert(n)) is not None and a.network and a.epoch == epoch
                   for n in range(self.alert_count(), 0, -1))

    def current_epoch(self) -> int:
        """The newest decided epoch, read from sealed decisions only: from the newest this process
        knows of on this store (or the epoch the job moved here in), forward while the next one is
        decided. No count says it: an outsider's raised count once kept a job from finishing."""
        generation = self.store.generation
        alerts, known = self._known(generation)
        epoch = sequence.extent(lambda e: self.members_of(e) is not None,
                                known or int(self.store.read(EPOCH_FLOOR) or 0))
        self._counted = (generation, alerts, epoch)
        return epoch

    def members_of(self, epoch: int) -> tuple[int, ...] | None:
        """The agreed members of ``epoch``, once decided."""
        raw = self.store.read(f"{PREFIX}ep/{epoch}/members")
        return None if raw is None else tuple(json.loads(raw))

    # -- agreement --------------------------------------------------------------------------
    def check_in(self, epoch: int, unreachable: Sequence[int] | None = (), keep: bool = False) -> None:
        """Say this rank is alive for ``epoch``, with the ranks it could not reach (None: its report
        follows; see :mod:`~elaswave.control.partition`). ``keep``: not over a check-in already
        there (the watcher's, which must not replace the main thread's report)."""
        key, doc = f"{PREFIX}ep/{epoch}/in/{self.rank}", json.dumps(None if unreachable is None else sorted(unreachable))
        if keep:
            self.store.compare_set(key, "", doc)
        else:
            self.store.set(key, doc)
        self.store.add(f"{PREFIX}ep/{epoch}/num_in", 1)

    def check_in_reporting(self, epoch: int, unreachable: Callable[[], list[int]]) -> None:
        """Check in at once with the report pending, then with what ``unreachable()`` found: the
        probe may take a while exactly when it matters, and a late check-in would be left out."""
        self.check_in(epoch, None)
        self.check_in(epoch, unreachable())

    def _checked_in(self, epoch: int, prev: Sequence[int]) -> dict[int, list[int] | None]:
        """The ranks of ``prev`` checked in for ``epoch``, each with the ranks it could not reach
        (None: pending)."""
        return {r: json.loads(v) for r, v in self._per_rank(f"ep/{epoch}/in", prev).items()}

    def _per_rank(self, what: str, ranks: Sequence[int]) -> dict[int, bytes]:
        """``ew/WHAT/<r>`` of each of ``ranks`` that has one, in one multi_get."""
        keys = {f"{PREFIX}{what}/{r}": r for r in ranks}
        return {keys[k]: v for k, v in self.store.genuine(list(keys)).items()}

    def cut_off(self, epoch: int) -> dict[int, list[int]]:
        """The ranks left out of ``epoch`` because the network cut them off, with the ranks each
        could not talk to (empty when nobody was)."""
        raw = self.store.read(f"{PREFIX}ep/{epoch}/cut")
        return {} if raw is None else {int(r): peers for r, peers in json.loads(raw).items()}

    def proven_dead(self, ranks: Sequence[int]) -> set[int]:
        """Those of ``ranks`` whose death is recorded (by their agent, or a refusal on their host)."""
        return set(self._per_rank("dead", ranks))

    def known_dead(self, prev: Sequence[int], since_epoch: int = 0) -> tuple[set[int], set[int]]:
        """(proven dead, known dead): recorded deaths, and those plus the suspects that every
        watcher of theirs named in an alert of ``since_epoch`` or later (two, fewer where the ring
        had fewer: see :mod:`~elaswave.control.heartbeat`; an older alert was answered already).
        A suspect one watcher alone named is waited for until ``agree_timeout_s``: alive, it
        checks in and stays."""
        proven = self.proven_dead(prev)
        named: dict[int, set[str]] = {}
        need: dict[int, int] = {}
        for n in range(1, self.alert_count() + 1):
            alert = self.read_alert(n)
            if alert is not None:
                if alert.epoch < since_epoch:
                    continue
                for r in alert.ranks:
                    named.setdefault(r, set()).add(alert.by)
                    need[r] = min(need.get(r, WATCHERS), max(1, alert.watchers))
        return proven, proven | {r for r, by in named.items() if r in prev and len(by) >= need[r]}

    def announce_host(self, host: str) -> None:
        """Which host this rank runs on (watchers are placed on other hosts than the watched)."""
        self.store.set(f"{PREFIX}host/{self.rank}", host)

    def hosts(self, ranks: Sequence[int]) -> dict[int, str]:
        """The hosts of ``ranks`` that announced theirs, or that this process read before (a store
        that moved has only the survivors': the recovery record names the lost ranks' hosts still)."""
        self._hosts.update({r: v.decode() for r, v in self._per_rank("host", ranks).items()})
        return {r: self._hosts[r] for r in ranks if r in self._hosts}

    def _probe_silent(self, prev: Sequence[int], checked: set[int], dead: set[int]) -> set[int]:
        """Members neither checked in nor known dead whose liveness port refuses us; each is
        recorded dead, with the evidence, for the other ranks and for the recovery record."""
        shown = set()
        for r in prev:
            if r not in checked and r not in dead and self.prober.is_gone(r, self.store):
                self.store.compare_set(f"{PREFIX}dead/{r}", "", f"refused connections (probed by rank {self.rank})")
                shown.add(r)
        return shown

    def death_evidence(self, ranks: Sequence[int], epoch: int | None = None) -> dict[int, str]:
        """What showed each of ``ranks`` dead: its recorded death (the launcher's report, a refused
        probe), else the alert that named it (a stale heartbeat), else nothing but its silence --
        or, for a rank left out of ``epoch`` alive, the partition that cut it off."""
        cut = self.cut_off(epoch) if epoch is not None else {}
        out = {r: partition.describe(r, cut[r]) for r in ranks if r in cut}
        out.update({r: v.decode() for r, v in self._per_rank("dead", [r for r in ranks if r not in out]).items()})
        for n in range(self.alert_count(), 0, -1):
            if len(out) == len(ranks):
                break
            alert = self.read_alert(n)
            if alert is not None:
                out.update({r: f"{alert.reason} ({alert.by})" for r in alert.ranks if r in ranks and r not in out})
        return {r: out.get(r, "did not check in within elastic.agree_timeout_s") for r in ranks}

    def agree(self, prev_members: Sequence[int], epoch: int, agree_timeout_s: float,
              timeout_s: float, poll_s: float = 0.002, probe_every_s: float = 0.02,
              alerts_since: int = 0, lives: Callable[[int], bool | None] | None = None,
              alive_wait_s: float = 0.0) -> tuple[int, ...]:
        """Block until epoch ``epoch``'s members are decided; returns them (maybe without us).
        ``alerts_since``: the epoch whose alerts (and later ones') can name a suspect dead.
        ``lives(rank)``: whether the store shows ``rank`` alive (on etcd, its lease; None: cannot
        tell now); asked about the members still missing once ``agree_timeout_s`` has passed,
        every :data:`LIVES_EVERY_S`: while one is shown alive the decision waits up to
        ``alive_wait_s`` longer (see :func:`decide`), never past ``timeout_s``."""
        key = f"{PREFIX}ep/{epoch}/members"
        start = self.clock()
        seen_in, scanned_at, dead, proven = -1, start, set(), set()
        checked: dict[int, list[int] | None] = {}
        probed_at = None
        alive: set[int] = set()
        asked_at: dict[int, float] = {}
        # Decided before ``timeout_s``: a late member is left out, never the agreement failed.
        alive_wait_s = max(0.0, min(alive_wait_s, timeout_s - agree_timeout_s - 4 * LIVES_EVERY_S))
        while True:
            decided = self.members_of(epoch)
            if decided is not None:
                return decided
            waited = self.clock() - start
            num_in = self.store.add(f"{PREFIX}ep/{epoch}/num_in", 0)
            # Rescan when the count moved -- or anyway, now and then: it is an unsealed counter, and
            # an outsider holding it still must not hide a member's check-in until it is left out.
            if num_in != seen_in or self.clock() - scanned_at >= RESCAN_EVERY_S:
                seen_in, scanned_at = num_in, self.clock()
                checked = self._checked_in(epoch, prev_members)
                proven, dead = self.known_dead(prev_members, alerts_since)
            if self.prober is not None and (probed_at is None or self.clock() - probed_at >= probe_every_s):
                probed_at = self.clock()
                shown = self._probe_silent(prev_members, checked, dead)
                proven, dead = proven | shown, dead | shown
            if lives is not None and alive_wait_s and waited >= agree_timeout_s:
                # A live rank's lease stays renewed while it comes; one that stops is no longer waited for.
                for r in prev_members:
                    if r not in checked and r not in dead and self.clock() - asked_at.get(r, -LIVES_EVERY_S) >= LIVES_EVERY_S:
                        answer = lives(r)
                        if answer is not None:
                            asked_at[r] = self.clock()
                            (alive.add if answer else alive.discard)(r)
            members = decide(prev_members, checked, dead, waited, agree_timeout_s, proven, checked,
                             alive, alive_wait_s)
            if members is not None and self.requires_majority and self.members_of(epoch) is None \
                    and not has_majority(members, prev_members, proven, holds_store=self.holds_store):
                raise NoMajority(f"epoch {epoch} would have ranks {list(members)}: not a majority of epoch "
                                 f"{epoch - 1}'s members {list(prev_members)} not proven dead "
                                 f"({sorted(proven) or 'none'} proven); a minority side does not decide")
            if members is not None:
                live = live_members(prev_members, checked, proven)
                if len(members) < len(live):  # a cut: recorded before the members, so whoever reads them finds why
                    self.store.compare_set(f"{PREFIX}ep/{epoch}/cut", "", json.dumps(partition.cut(live, checked)))
                stored = self.store.compare_set(key, "", json.dumps(list(members)))
                won = json.loads(stored)
                self.holds_store = True
                return tuple(won)
            if waited > timeout_s:
                raise TimeoutError(f"no agreement on epoch {epoch} within {timeout_s}s")
            if waited > 0.05:  # past the usual case, re-check deaths now and then
                proven, dead = self.known_dead(prev_members, alerts_since)
            time.sleep(poll_s)

    # -- state reports (one JSON document per member and epoch) -----------------------------
    def post(self, epoch: int, what: str, doc: dict) -> None:
        self.store.set(f"{PREFIX}ep/{epoch}/{what}/{self.rank}", json.dumps(doc))

    def gather(self, epoch: int, what: str, members: Sequence[int], timeout_s: float,
               broken: Callable[[], bool] | None = None) -> dict[int, dict]:
        """Every member's document; gives up (EpochBroken) as soon as ``broken()`` says the epoch
        is (a member died before posting), else after ``timeout_s``."""
        keys = [f"{PREFIX}ep/{epoch}/{what}/{r}" for r in members]
        if broken is None:
            self.store.wait(keys, timedelta(seconds=timeout_s))
        else:
            start, pause, probed_at = self.clock(), 0.0005, self.clock()
            while not self.store.check(keys):
                if broken():
                    raise EpochBroken(f"epoch {epoch} broke while its members posted their {what}")
                if self.clock() - start > timeout_s:
                    raise TimeoutError(f"not every member of epoch {epoch} posted its {what} within {timeout_s}s")
                if self.prober is not None and self.clock() - probed_at > 0.05:
                    # A member that died after it checked in never posts: prove it, and break the epoch.
                    probed_at = self.clock()
                    silent = [r for r, k in zip(members, keys) if not self.store.check([k])]
                    gone = self._probe_silent(silent, set(), set())
                    if gone:
                        self.alert(epoch, f"ranks {sorted(gone)} died before posting their {what}", sorted(gone))
                        raise EpochBroken(f"epoch {epoch}: ranks {sorted(gone)} died before posting their {what}")
                time.sleep(pause)
                pause = min(2 * pause, 0.01)
        return {r: json.loads(v) for r, v in zip(members, self.store.multi_get(keys))}

    def spares_standing(self, change: int = 0) -> int:
        """Warm spares standing by in the whole job (agents count theirs in and out)."""
        return self.store.add(PREFIX + "spares_standing", change)

    def stamp(self, key: str, value: float | None = None) -> None:
        self.store.set(PREFIX + key, repr(time.time() if value is None else value))

    def read_stamp(self, key: str) -> float | None:
        raw = self.store.read(PREFIX + key)
        return None if raw is None else float(raw)

    def lease_expired(self, epoch: int, rank: int, last_wall: float, ttl_s: int, left_s: float | None = None) -> None:
        """``rank``'s etcd lease ended (:mod:`~elaswave.control.leases`): expired -- a death proven
        by the cluster's quorum -- or, with ``left_s``, revoked that long before it could expire;
        recorded with its last sign of life (wall clock), and said to the members."""
        how = (f"its etcd lease expired: no renewal for {ttl_s} s" if left_s is None else
               f"its etcd lease was revoked with {left_s:.0f} s left, by a client of the etcd cluster (without "
               "auth, anyone who reaches it: see docs/control-plane.md)")
        # The stamp last: each write is a Raft commit, and only the recovery's record reads it.
        self.store.compare_set(f"{PREFIX}dead/{rank}", "", how)
        self.alert(epoch, f"rank {rank}: {how}", [rank])
        self.store.compare_set(f"{PREFIX}renewed/{rank}", "", repr(last_wall))

    def lease_unrenewed(self, epoch: int, rank: int, since_wall: float, for_s: int, watchers: int) -> None:
        """This watcher's evidence against ``rank`` on etcd: the leader says its lease went
        unrenewed for ``for_s`` s (:meth:`~elaswave.control.leases.Lease.unrenewed`), so since
        ``since_wall`` at the earliest. It is left out once all its watchers said so."""
        self.alert(epoch, f"rank {rank} renewed no etcd lease for {for_s} s (the leader, asked by rank "
                          f"{self.rank})", [rank], watchers=watchers)
        self.store.compare_set(f"{PREFIX}renewed/{rank}", "", repr(since_wall))

    def beats(self, rank: int, within_s: float) -> bool | None:
        """Whether ``rank``'s last heartbeat on this store is at most ``within_s`` old (None: the
        store cannot be asked now). An agreement waits longer for a member it misses that still
        beats: its watcher thread, which checks in for it at an alert, was starved (a loaded
        host), and a live rank left out of an epoch splits the job (issue 58: a joiner alone for
        a second decided it was a minority, saved and stopped; the others left a live rank out).
        Compared on wall clocks, as the MTTR is: a skew only shortens or lengthens a bounded wait."""
        try:
            wall = self.last_beat_wall(rank)
        except Exception:  # noqa: BLE001 - no answer now is no evidence either way
            return None
        return wall is not None and time.time() - wall <= within_s

    def last_beat_wall(self, rank: int) -> float | None:
        """When ``rank``'s last heartbeat was sent (wall clock), or None if it never beat here (see
        :mod:`~elaswave.control.heartbeat`: its counter is milliseconds since its watcher started);
        on etcd, its lease's last renewal."""
        renewed = self.read_stamp(f"renewed/{rank}")
        if renewed is not None:
            return renewed
        began = self.read_stamp(f"hb0/{rank}")
        if began is None or not self.store.check([f"{PREFIX}hb/{rank}"]):
            return None
        return began + self.store.add(f"{PREFIX}hb/{rank}", 0) / 1000
