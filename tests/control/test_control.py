"""Control plane: pure decisions, fault parsing, and the protocol on a real TCPStore."""
import json
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from elaswave.control import faults
from elaswave.control.membership import Membership, NoMajority, decide, has_majority, is_stale


def test_decide_waits_for_every_member_or_the_timeout():
    assert decide([0, 1, 2, 3], {0, 1}, set(), 0.1, 1.0) is None
    assert decide([0, 1, 2, 3], {0, 1, 3}, {2}, 0.1, 1.0) == (0, 1, 3)
    assert decide([0, 1, 2, 3], {0, 1, 3}, set(), 1.5, 1.0) == (0, 1, 3)  # a hung rank never checks in
    # Checked in, then killed before the decision (found by the any-instant chaos runs): a proven
    # death leaves it out, or the epoch would wait for its state forever.
    assert decide([0, 1, 2, 3], {0, 1, 2, 3}, {2}, 0.1, 1.0, proven_dead={2}) == (0, 1, 3)


def test_decide_waits_longer_for_a_late_member_the_store_shows_alive():
    """On etcd a member whose lease is renewed is alive: its late check-in (a starved watcher, a
    watch stream stuck on a silent member) is waited for, not taken as its death."""
    assert decide([0, 1, 2, 3], {0, 3}, {2}, 1.5, 1.0, alive={1}, alive_wait_s=6.0) is None
    assert decide([0, 1, 2, 3], {0, 1, 3}, {2}, 1.5, 1.0, alive={1}, alive_wait_s=6.0) == (0, 1, 3)
    assert decide([0, 1, 2, 3], {0, 3}, {2}, 7.5, 1.0, alive={1}, alive_wait_s=6.0) == (0, 3)  # bounded
    assert decide([0, 1, 2, 3], {0, 3}, set(), 1.5, 1.0, alive={2}, alive_wait_s=6.0) is None
    assert decide([0, 1, 2, 3], {0, 3}, set(), 1.5, 1.0, alive=set(), alive_wait_s=6.0) == (0, 3)  # silent, unrenewed


def test_is_stale():
    assert not is_stale(10.0, 11.0, 2.0)
    assert is_stale(10.0, 12.5, 2.0)


@pytest.mark.parametrize("text,expect", [
    ("kill:rank=2,step=12", faults.Fault("kill", 2, 12, "forward")),
    ("stop:rank=0,step=3,phase=snapshot", faults.Fault("stop", 0, 3, "snapshot")),
    ("join:step=20", faults.Fault("join", -1, 20)),
    ("join:step=5,count=3", faults.Fault("join", -1, 5, count=3)),
    ("slow:rank=1,step=4,factor=2.5", faults.Fault("slow", 1, 4, factor=2.5)),
    ("slow:rank=1,step=4", faults.Fault("slow", 1, 4, factor=3.0)),
    ("corrupt:rank=0,step=6", faults.Fault("corrupt", 0, 6)),
    ("flip:rank=1,step=3,what=moment", faults.Fault("flip", 1, 3, what="moment")),
    ("starve:rank=2,step=6", faults.Fault("starve", 2, 6, seconds=3.0)),
    ("starve:rank=2,step=6,seconds=0.5", faults.Fault("starve", 2, 6, seconds=0.5)),
    ("stop:rank=4,step=0,phase=admission", faults.Fault("stop", 4, 0, "admission")),
])
def test_fault_parsing(text, expect):
    assert faults.parse(text) == expect


@pytest.mark.parametrize("text,needle", [
    ("kil:rank=1,step=1", "must start with one of kill, stop, corrupt, slow, flip, join, starve"),
    ("starve:rank=1,step=2,seconds=0", "0 < seconds <= 600"),
    ("starve:rank=1,step=2,seconds=soon", "factor and seconds numbers"),
    ("starve:rank=1,step=2,phase=reduce", "'phase=reduce' is not one of rank=, step=, seconds="),
    ("slow:rank=1,step=2,factor=0.5", "factor >= 1"),
    ("kill:rank=1", "rank= and step= are required"),
    ("kill:rank=1,step=x", "must be integers"),
    ("kill:rank=1,step=2,phase=lunch", "phase=lunch is not one of"),
    ("kill:rank=4,step=3,phase=admission", "before a joiner knows the job's step: use step=0"),
    ("kill:rank=1,step=2,when=now", "'when=now' is not one of rank=, step=, phase="),
    ("join:rank=1,step=2", "'rank=1' is not one of step=, count="),
    ("join:count=2", "step= is required"),
    ("join:step=2,count=0", "count >= 1"),
    ("flip:rank=1,step=3", "rank= and step= and what= are required"),
    ("flip:rank=1,step=3,what=gradient", "what=gradient is not one of moment, param"),
])
def test_bad_faults_say_what_is_wrong(text, needle):
    with pytest.raises(ValueError, match=needle):
        faults.parse(text)


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    yield server


def test_agreement_over_a_real_store(store):
    # Ranks 0, 1, 3 check in; the launcher reports rank 2 dead: all three agree on (0, 1, 3).
    clients = {r: Membership(dist.TCPStore("127.0.0.1", store.port, is_master=False,
                                           timeout=timedelta(seconds=10)), r) for r in (0, 1, 3)}
    Membership(store, -1).report_dead(2, "was killed by SIGKILL")
    results = {}

    def run(r):
        clients[r].check_in(1)
        results[r] = clients[r].agree([0, 1, 2, 3], 1, agree_timeout_s=5.0, timeout_s=10.0)

    threads = [threading.Thread(target=run, args=(r,)) for r in clients]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert results == {0: (0, 1, 3), 1: (0, 1, 3), 3: (0, 1, 3)}
    assert time.monotonic() - start < 2.0  # the death notice settles it; no waiting for the timeout
    assert json.loads(store.get("ew/ep/1/members")) == [0, 1, 3]
    assert clients[0].current_epoch() == 1


@pytest.mark.parametrize("lives, late_s, timeout_s, want", [
    (lambda r: True, 1.2, 10.0, (0, 1, 3)),   # alive and late: waited for
    (lambda r: False, 1.2, 10.0, (0, 3)),     # not renewed: left out at the timeout, as before
    (lambda r: None, 1.2, 10.0, (0, 3)),      # the store cannot tell: no evidence either way
    (lambda r: True, 2.5, 1.5, (0, 3)),       # never past parallel.timeout_s: decided, not failed
])
def test_an_agreement_waits_for_a_late_member_while_it_lives(store, lives, late_s, timeout_s, want):
    """Rank 1 checks in ``late_s`` after rank 0 began to agree; rank 2 is reported dead."""
    def member(r):
        return Membership(dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10)), r)
    Membership(store, -1).report_dead(2, "was killed by SIGKILL")
    late = threading.Timer(late_s, lambda: member(1).check_in(1))
    m = member(0)
    m.check_in(1)
    member(3).check_in(1)
    began = time.monotonic()
    late.start()
    try:
        got = m.agree([0, 1, 2, 3], 1, agree_timeout_s=0.3, timeout_s=timeout_s, lives=lives, alive_wait_s=6.0)
    finally:
        late.cancel()
        late.join()
    assert got == want and time.monotonic() - began < timeout_s, (got, time.monotonic() - began)


@pytest.mark.parametrize("port", ["answers", "closed"])
def test_on_a_moved_store_the_agreement_waits_for_a_member_whose_port_answers(store, port):
    """What a recovery passes to the agreement on a store that just moved (no etcd lease there):
    ``lives`` is the member's liveness port (``Prober.answers``). Rank 1 checks in 1.2 s late,
    past the agreement's own timeout: waited for while its port answers, left out when it is closed."""
    from elaswave.control.liveness import LivenessPort, Prober

    def member(r):
        return Membership(dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10)), r)
    liveness = LivenessPort("127.0.0.1")
    liveness.register(store, 1)
    if port == "closed":
        liveness.close()
    prober = Prober()
    late = threading.Timer(1.2, lambda: member(1).check_in(1))
    m = member(0)
    m.check_in(1)
    late.start()
    try:
        got = m.agree([0, 1], 1, agree_timeout_s=0.3, timeout_s=10.0, lives=lambda r: prober.answers(r, store),
                      alive_wait_s=6.0)
    finally:
        late.cancel()
        late.join()
        liveness.close()
    assert got == ((0, 1) if port == "answers" else (0,)), got


@pytest.mark.parametrize("watcher", ["beating", "stopped"])
def test_on_the_tcpstore_the_agreement_waits_for_a_member_that_still_beats(store, watcher):
    """What a recovery passes to the agreement on the embedded store: ``lives`` is the member's
    heartbeat (``Membership.beats``). Both ranks' real watchers beat; rank 1 checks in 2 s late,
    past the agreement's own timeout and its heartbeat timeout (a watcher starved on a loaded
    host). Waited for while it beats; with its watcher stopped, left out once its beat is stale."""
    from elaswave.control.heartbeat import Watcher
    from elaswave.interrupt import Interrupt

    def link():
        return dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
    watchers = [Watcher(link(), r, lambda: (0, (0, 1)), Interrupt(), interval_s=0.1, timeout_s=1.0) for r in (0, 1)]
    for w in watchers:
        w.start()
    time.sleep(0.5)
    if watcher == "stopped":
        watchers[1].stop()
    late = threading.Timer(2.0, lambda: Membership(link(), 1).check_in(1))
    m = Membership(link(), 0)
    m.check_in(1)
    began = time.monotonic()
    late.start()
    try:
        got = m.agree([0, 1], 1, agree_timeout_s=0.3, timeout_s=10.0, lives=lambda r: m.beats(r, 1.0),
                      alive_wait_s=6.0)
        took = time.monotonic() - began
    finally:
        late.cancel()
        late.join()
        for w in watchers:
            w.stop()
        for w in watchers:
            w.join(5)  # each wakes within its interval: none is left waiting on the store when it closes
    if watcher == "beating":
        assert got == (0, 1) and took >= 1.9, (got, took)
        assert m.alert_count() == 0  # no suspicion: it was waited for as alive, not as a suspect
    else:
        assert got == (0,) and took < 1.9, (got, took)


def test_concurrent_alerts_take_a_slot_each_with_no_gap_and_epochs_are_read_from_decisions(store):
    # Alerts are a sealed sequence, not a counter: eight writers at once, five alerts each, get forty
    # slots, one each, with no gap (a reader counts the unbroken run).
    clients = [Membership(dist.TCPStore("127.0.0.1", store.port, is_master=False,
                                        timeout=timedelta(seconds=10)), r) for r in range(8)]
    barrier = threading.Barrier(len(clients))

    def post(m):
        barrier.wait(5)
        for k in range(5):
            m.alert(0, f"alert {k} of rank {m.rank}")

    threads = [threading.Thread(target=post, args=(m,)) for m in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    reader = Membership(store, -1)
    assert reader.alert_count() == 40
    assert sorted(reader.read_alert(n).reason for n in range(1, 41)) == sorted(
        f"alert {k} of rank {r}" for r in range(8) for k in range(5))
    # The epoch is the newest decision, found by walking them: published members, not a count.
    for epoch in range(1, 4):
        store.set(f"ew/ep/{epoch}/members", "[0, 1]")
        assert reader.current_epoch() == epoch
    assert Membership(store, -1).current_epoch() == 3


def test_an_alert_breaks_the_epochs_that_hold_the_rank_it_names(store):
    from elaswave.control.heartbeat import Watcher
    from elaswave.control.membership import Alert
    from elaswave.interrupt import Interrupt

    store.set("ew/ep/1/members", json.dumps([0, 1, 3]))
    watcher = Watcher(store, 0, lambda: (0, (0, 1, 2, 3)), Interrupt(), 0.1, 1.0)
    # A death during the change to epoch 1: the epoch being built breaks, before the counter moves.
    assert watcher._broken_by(Alert(0, "launcher", "rank 3 was killed by SIGKILL", (3,))) == 1
    # The launcher's report of rank 2 came after the survivors proved its death and agreed on
    # epoch 1 without it: it names no member of epoch 1, so nothing breaks (a needless epoch 2
    # before, seen once in ~70 runs of the drop-replica test).
    assert watcher._broken_by(Alert(1, "launcher", "rank 2 was killed by SIGKILL", (2,))) is None
    assert watcher._broken_by(Alert(0, "launcher", "rank 2 was killed by SIGKILL", (2,))) == 0
    assert watcher._broken_by(Alert(1, "rank 0", "collective failed", ())) == 1


@pytest.mark.parametrize("side, proven, holds_store, ok", [
    ((0, 1), (), True, True),      # two hosts cut apart: the store's half goes on ...
    ((2, 3), (), False, False),    # ... the other half does not
    ((2, 3), (), True, True),      # (the same half, were the store on its side)
    ((0,), (), True, False),       # a quarter, even with the store
    ((0, 1, 2), (), False, True),  # three of four
    ((0,), (1, 2, 3), False, True),  # the others proven dead (refused, reaped): the survivor decides
    ((0, 1), (3,), False, True),   # two of the three not proven dead
])
def test_a_side_decides_only_with_a_majority_of_the_members_not_proven_dead(side, proven, holds_store, ok):
    assert has_majority(side, [0, 1, 2, 3], proven, holds_store) is ok


def test_a_minority_that_reaches_the_store_does_not_agree(store):
    # Several hosts around one store: ranks 0 and 1 vanish silently (no report, no refusal); the one
    # rank left reaches the store but is a quarter of the members: it must not decide alone.
    m = Membership(dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10)), 3,
                   requires_majority=True)
    Membership(store, -1).report_dead(2, "was killed by SIGKILL")  # proven: the base is ranks 0, 1, 3
    m.check_in(1)
    with pytest.raises(NoMajority, match=r"epoch 1 would have ranks \[3\]: not a majority"):
        m.agree([0, 1, 2, 3], 1, agree_timeout_s=0.3, timeout_s=10.0)
    assert not store.check(["ew/ep/1/members"])  # nothing was decided


def test_each_rank_is_watched_by_two_ranks_of_other_hosts_where_there_are_some():
    from elaswave.control.heartbeat import watch_targets, watchers_of

    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    members = (0, 1, 2, 3)
    assert watchers_of(members, 0, hosts) == [2, 3] and watchers_of(members, 2, hosts) == [0, 1]
    # Every rank watched twice, and every watcher watches: the load stays even.
    assert sorted(len(watch_targets(members, r, hosts)) for r in members) == [2, 2, 2, 2]
    one_host = {r: "a" for r in members}
    assert watchers_of(members, 3, one_host) == [0, 1]  # the ring, as before
    # Three hosts, one rank each on the last: the lone rank is still watched from elsewhere.
    hosts3 = {0: "a", 1: "a", 2: "b", 3: "b", 4: "c"}
    assert all(hosts3[w] != hosts3[r] for r in hosts3 for w in watchers_of(tuple(hosts3), r, hosts3))
    assert watch_targets((0, 5), 0, {}) == (5,) and watch_targets((0, 5), 7, {}) == ()


def test_a_suspect_one_watcher_named_is_not_dead_until_a_second_watcher_names_it(store):
    m = Membership(store, 0)
    prev = [0, 1, 2, 3]
    Membership(store, 1).alert(1, "rank 2 missed heartbeats for 2.10s", [2], watchers=2)
    assert m.known_dead(prev) == (set(), set())  # one view: the agreement waits for rank 2
    Membership(store, 1).alert(1, "rank 2 missed heartbeats for 2.30s", [2], watchers=2)
    assert m.known_dead(prev) == (set(), set())  # the same watcher again is still one witness
    Membership(store, 3).alert(1, "rank 2 missed heartbeats for 2.05s", [2], watchers=2)
    assert m.known_dead(prev) == (set(), {2})
    assert m.known_dead(prev, since_epoch=2) == (set(), set())  # older alerts were answered already
    # A proven death needs no witness; where the ring had one watcher for it, one names it.
    m.report_dead(1, "was killed by SIGKILL")
    assert m.known_dead(prev) == ({1}, {1, 2})
    Membership(store, 5).alert(1, "rank 4 missed heartbeats for 2.2s", [4], watchers=1)
    assert m.known_dead([4, 5, 6]) == (set(), {4})


def test_a_starved_watcher_does_not_suspect_a_neighbour_that_beat_meanwhile(store):
    """A real watcher thread whose read of its neighbour's counter comes back 3 s late (starved:
    a GC pause, a loaded host) while the neighbour beats on: no alert. The clock it judges by is
    read before the counter, so its own absence is not counted as the neighbour's silence."""
    from elaswave.control.heartbeat import Watcher
    from elaswave.interrupt import Interrupt

    class Starved:
        """The watcher's connection: once a read of the neighbour's counter shows no beat since the
        last read (the neighbour beats every 0.5 s, the watcher reads every 0.2 s), the answer is
        held 3 s -- the neighbour beats on meanwhile."""
        def __init__(self, inner):
            self.inner, self.last, self.starved = inner, None, False

        def add(self, key, n):
            value = self.inner.add(key, n)
            if key == "ew/hb/1" and n == 0:
                if value == self.last and not self.starved:
                    self.starved = True
                    time.sleep(3.0)
                self.last = value
            return value

        def __getattr__(self, name):
            return getattr(self.inner, name)

    beating = threading.Event()

    def neighbour():  # rank 1 beats every 0.5 s: between two of the watcher's reads, sometimes not
        while not beating.is_set():
            store.add("ew/hb/1", 1)
            beating.wait(0.5)
    threading.Thread(target=neighbour, daemon=True).start()
    conn = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
    starved = Starved(conn)
    watcher = Watcher(starved, 0, lambda: (0, (0, 1)), Interrupt(), 0.2, 2.0)
    watcher.start()
    try:
        time.sleep(5.0)
    finally:
        watcher.stop()
        beating.set()
    assert starved.starved, "the watcher was never starved: the test tested nothing"
    assert watcher.membership.alert_count() == 0, watcher.membership.read_alert(1)
