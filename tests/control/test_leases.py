"""Liveness on etcd (:mod:`elaswave.control.leases`) over a real 3-member cluster, the lease held by
a real process: its SIGKILL and its SIGSTOP are deaths seen through the watch stream within the
TTL and dated by its last renewal; a key deleted while its lease lives, a clean end and a watcher
starved for 3 s are not deaths; a lease renewed too late is known to its holder as expired."""
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from elaswave.control import leases
from elaswave.control.etcd import EtcdStore, parse_endpoints
from elaswave.control.seal import PREFIX, Sealed
from tests.helpers.etcd import EtcdCluster

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def etcd():
    with EtcdCluster(3) as cluster:
        yield cluster


def _store(etcd, prefix: str) -> EtcdStore:
    return EtcdStore(parse_endpoints(etcd.endpoints), prefix, 10.0)


class Holder:
    """A process holding rank ``rank``'s lease, renewing it as a watcher does (every 0.05 s)."""

    def __init__(self, etcd, prefix: str, rank: int):
        code = (f"import sys, time; sys.path.insert(0, {str(REPO)!r})\n"
                "from elaswave.control.etcd import EtcdStore, parse_endpoints\n"
                "from elaswave.control.leases import Lease\n"
                f"lease = Lease(EtcdStore(parse_endpoints({etcd.endpoints!r}), {prefix!r}, 10.0), {rank}, {TIMEOUT_S})\n"
                "lease.beat(); print('ready', flush=True)\n"
                "while True:\n"
                "    lease.beat()\n"
                "    if lease.expired_own: print('expired', flush=True); break\n"
                "    time.sleep(0.05)\n")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass
        self.proc.wait(10)


def _deaths_within(lease: leases.Lease, within_s: float) -> list[tuple[int, float, int, float | None]]:
    deadline, out = time.monotonic() + within_s, []
    while time.monotonic() < deadline and not out:
        out = lease.expired()
        time.sleep(0.05)
    return out


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_a_holder_killed_or_frozen_is_a_death_dated_by_its_last_renewal(etcd, sig):
    prefix = f"/t/lease-{sig.name}/"
    watcher = leases.Lease(_store(etcd, prefix), 0, TIMEOUT_S)
    with Holder(etcd, prefix, 5) as holder:
        time.sleep(0.5)
        assert watcher.expired() == []  # renewed: alive
        struck = time.time()
        os.kill(holder.proc.pid, sig)
        deaths = _deaths_within(watcher, TIMEOUT_S + 2.0)
        seen = time.time()
        assert [d[0] for d in deaths] == [5]
        (_, last_wall, ttl_s, left_s) = deaths[0]
        assert ttl_s == TIMEOUT_S + 1 == watcher.ttl_s and left_s is None  # whole seconds, one over the timeout; ran out
        # Expired a TTL after the last renewal (at most TTL/4 before the signal), seen within the
        # leader's expiry check (every 0.5 s) after that.
        assert ttl_s * 3 / 4 - 0.1 <= seen - struck <= ttl_s + 1.2, seen - struck
        assert struck - ttl_s / 4 - 0.2 <= last_wall <= struck + 0.7, last_wall - struck
        if sig == signal.SIGSTOP:  # continued: its next renewal finds the lease gone, and it knows it
            os.kill(holder.proc.pid, signal.SIGCONT)
            assert holder.proc.stdout.readline().strip() == "expired"
    watcher.close()


@pytest.mark.parametrize("starved_s", [0.0, pytest.param(3.0, marks=pytest.mark.slow)])  # a starved watcher: test_starved_watcher.py
def test_the_leader_says_when_a_lease_went_unrenewed_for_the_timeout(etcd, starved_s):
    """A watcher asking about a renewing holder (also after it was starved for 3 s: asked nothing)
    gets no evidence; once the holder is frozen, the answer "under a second left" -- no renewal
    for the timeout -- comes within 0.3 s of the timeout after its last renewal, before the
    lease expires, dated no later than that renewal."""
    prefix = f"/t/lease-unrenewed-{starved_s:g}/"
    watcher = leases.Lease(_store(etcd, prefix), 0, TIMEOUT_S)
    with Holder(etcd, prefix, 5) as holder:
        time.sleep(starved_s)
        until = time.monotonic() + 3.0
        while time.monotonic() < until:
            assert watcher.unrenewed(5) is None
            time.sleep(max(0.0, min(0.2, watcher.next_read_in())))
        struck = time.time()
        os.kill(holder.proc.pid, signal.SIGSTOP)
        since = None
        while time.time() - struck < TIMEOUT_S + 2:
            since = watcher.unrenewed(5)
            if since is not None:
                break
            time.sleep(watcher.next_read_in())
        seen = time.time()
        assert since is not None, "no evidence within the lease's TTL"
        renewal_every = watcher.ttl_s / leases.RENEWALS_PER_TTL
        # The last renewal came at most one renewal period before the stop.
        assert TIMEOUT_S - renewal_every - 0.1 <= seen - struck <= TIMEOUT_S + 0.3, seen - struck
        assert struck - renewal_every - 0.3 <= since <= struck, since - struck
        assert watcher.store.lease_left(int(__import__("json").loads(
            Sealed(watcher.store, None).read(f"{leases.ALIVE}5"))["lease"])) == 0  # not expired yet
    watcher.close()


def test_a_holder_renewing_is_told_from_one_whose_lease_runs_out(etcd):
    """What a watcher asks before it calls a silent port a network problem: a holder that renews
    is (its port's silence is the network's); one frozen for 3/4 of the TTL is not (its expiry
    will prove its death)."""
    prefix = "/t/lease-renewing/"
    watcher = leases.Lease(_store(etcd, prefix), 0, TIMEOUT_S)
    with Holder(etcd, prefix, 4) as holder:
        assert all(watcher.renewing(4) and watcher.lives(4) for _ in range(4) if not time.sleep(0.25))
        os.kill(holder.proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        time.sleep(TIMEOUT_S * 3 / 4)
        assert not watcher.renewing(4)
        # What an agreement asks of a member late to check in: alive until unrenewed for the timeout.
        assert watcher.lives(4) or time.monotonic() - stopped > TIMEOUT_S
        time.sleep(max(0.0, stopped + TIMEOUT_S + 0.1 - time.monotonic()))
        assert not watcher.lives(4)
    assert not watcher.renewing(9) and not watcher.lives(9)  # never held one
    watcher.close()


def test_a_deleted_key_a_clean_end_and_a_starved_watcher_are_no_deaths(etcd):
    prefix = "/t/lease-none/"
    store = _store(etcd, prefix)
    watcher = leases.Lease(store, 0, TIMEOUT_S)
    with Holder(etcd, prefix, 6):
        time.sleep(0.3)
        assert store.delete_key(f"{leases.ALIVE}6")  # someone deletes the key: its lease lives on
        time.sleep(TIMEOUT_S + 1.0)  # and the watcher is starved meanwhile (reads nothing for 3 s)
        assert watcher.expired() == []
    ended = leases.Lease(_store(etcd, prefix), 7, TIMEOUT_S)
    ended.beat()
    ended.close()  # a clean end: the key stays, unbound, and the lease is revoked
    assert _deaths_within(watcher, TIMEOUT_S + 1.5) == []
    watcher.close()


def test_a_key_deleted_in_its_leases_last_second_is_no_death_and_wakes_the_watcher(etcd):
    """A live lease with under a second left reads 0 (etcd's gateway leaves the field out), not -1
    (expired): a key deleted then is no death. The deletion wakes a watcher waiting for alerts."""
    prefix = "/t/lease-last-second/"
    store = _store(etcd, prefix)
    watcher = leases.Lease(store, 0, TIMEOUT_S)
    lease, ttl = store.grant(2)
    store.put_leased(f"{leases.ALIVE}8", "held", lease)
    time.sleep(ttl - 0.8)
    assert store.lease_left(lease) == 0
    began = time.monotonic()
    woken = []
    waiting = threading.Thread(target=lambda: woken.append((watcher.alert_posted(10 ** 6, 5.0), time.monotonic())))
    waiting.start()
    time.sleep(0.1)
    assert store.delete_key(f"{leases.ALIVE}8")
    waiting.join(6)
    assert woken and woken[0][0] is False and woken[0][1] - began < 1.0, woken
    assert watcher.expired() == []  # its lease still lived: someone deleted the key
    # Past its TTL it still reads 0 until the leader's expiry check (every 0.5 s) revokes it.
    deadline = time.monotonic() + 3.0
    while store.lease_left(lease) != -1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.lease_left(lease) == -1
    watcher.close()


def test_a_forged_record_is_no_death_and_the_stream_counts_alerts_and_join_requests(etcd):
    prefix = "/t/lease-sealed/"
    key = b"k" * 32
    watcher = leases.Lease(Sealed(_store(etcd, prefix), key), 0, TIMEOUT_S)
    outsider = _store(etcd, prefix)
    lease, _ = outsider.grant(2)
    outsider.put_leased(f"{leases.ALIVE}3", "not sealed", lease)  # expires in 2 s, but was never the job's
    job = Sealed(_store(etcd, prefix), key)
    outsider.set(PREFIX + "alert/9", "{}")  # a forged alert numbered ahead: not counted
    outsider.set(PREFIX + "join/9", "{}")
    job.set(PREFIX + "join/1", "{}")
    job.set(PREFIX + "join/2", "{}")
    job.set(PREFIX + "alert/1", "{}")
    assert watcher.alert_posted(1, 5.0)
    deadline = time.monotonic() + 5
    while watcher.requests_seen != 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert watcher.requests_seen == 2 and watcher.alert_seen == 1
    assert _deaths_within(watcher, 4.0) == []
    watcher.close()


def test_on_a_tcpstore_nothing_is_leased():
    import torch.distributed as dist
    from datetime import timedelta
    tcp = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
                        timeout=timedelta(seconds=5))
    assert not leases.supported(Sealed(tcp, None))


def test_a_lease_revoked_before_it_could_expire_is_told_from_one_that_ran_out(etcd):
    """Without auth any client of the cluster can revoke a rank's lease; the death it causes is
    recorded as a revocation (the lease still had seconds left), not as an expiry."""
    prefix = "/t/lease-revoked/"
    watcher = leases.Lease(_store(etcd, prefix), 0, TIMEOUT_S)
    with Holder(etcd, prefix, 5):
        time.sleep(0.5)
        assert watcher.unrenewed(5) is None  # asked: seconds left
        lease = int(__import__("json").loads(Sealed(watcher.store, None).read(f"{leases.ALIVE}5"))["lease"])
        revoked = time.time()
        _store(etcd, prefix).revoke(lease)  # an outsider
        deaths = _deaths_within(watcher, 3.0)
    assert [d[0] for d in deaths] == [5]
    (_, since, _, left_s) = deaths[0]
    assert left_s is not None and left_s >= 1 and abs(since - revoked) < 1.0, deaths
    watcher.close()
