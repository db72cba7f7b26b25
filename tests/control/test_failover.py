"""The control store moves to a survivor: the pieces on real TCPStores, then the process holding
the job's store SIGKILLed mid-training -- the job trains on, bit-identical to the failure-free run."""
import re
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from elaswave.control import failover, rank_numbers
from elaswave.control.link import StoreLink, StoreLost
from elaswave.control.membership import PREFIX, Membership
from elaswave.control.seal import GENERATION, sealed, store_generation
from tests.helpers.spawn import Running, assert_same_run, job_args, reference_fixture, sigkill_launcher, wait_gone

STEPS, MBS = 40, 4
reference = reference_fixture(STEPS, MBS)


def _server() -> tuple[dist.TCPStore, str]:
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=15))
    return store, f"127.0.0.1:{store.port}"


def _link(addr: str) -> StoreLink:
    # A generous timeout: now and then a TCPStore connection stalls exactly 5 s (../shared/FACTS.md).
    host, port = addr.rsplit(":", 1)
    return StoreLink(dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=15)), addr, 15.0, 0.6)


def test_the_successor_is_the_first_member_with_a_known_standby():
    known = {0: "a:1", 2: "b:2", 3: "c:3"}
    assert failover.successor((3, 2, 0), known) == (0, "a:1")
    assert failover.successor((1, 3, 2), known) == (2, "b:2")  # rank 1's standby was never read
    with pytest.raises(StoreLost, match=r"no standby store of members \[1\] is known"):
        failover.successor((1,), known)


def test_a_moved_link_and_every_link_of_its_process_go_to_the_new_store():
    old, old_addr = _server()
    new, new_addr = _server()
    link = _link(old_addr)
    other = link.separate()
    link.set("k", "old")
    link.move(new_addr)
    assert link.addr == new_addr and link.generation == 1 and other.generation == 1
    other.set("k", "new")  # the other link follows at its next call
    assert new.get("k") == b"new" and old.get("k") == b"old"
    assert link.get("k") == b"new"


def test_a_move_clears_the_loss_for_the_whole_process():
    new, new_addr = _server()
    old, old_addr = _server()
    link = _link(old_addr)
    other = link.separate()
    del old  # the store's process is gone: the links give up after their grace
    with pytest.raises(StoreLost):
        link.add("x", 1)
    with pytest.raises(StoreLost):
        other.add("x", 1)
    link.move(new_addr)
    assert not link.lost.is_set()
    assert other.add("x", 1) == 1 and new.add("x", 0) == 1


def test_the_successor_seeds_what_the_protocol_reads_and_counters_only_grow():
    job, job_addr = _server()
    link = _link(job_addr)
    standbys = {r: failover.Standby("127.0.0.1", 15.0) for r in (0, 1, 5)}
    for rank, standby in standbys.items():
        standby.register(link, rank)
    for standby in standbys.values():
        standby.learn(link, [0, 1, 5])
    assert standbys[1].known == {r: s.addr for r, s in standbys.items()}
    links = {r: _link(job_addr) for r in (1, 5)}
    for rank in (5, 1):  # the follower first: it connects to a standby that is already listening
        leader, addr = failover.move(links[rank], standbys[rank], rank, 3, (1, 5), {"model": {"d": 8}})
        assert (leader, addr) == (1, standbys[1].addr)
    failover.announce(links[1])
    seeded = standbys[1].server
    assert seeded.get(PREFIX + "ep/3/members") == b"[1, 5]" and Membership(seeded, -1).current_epoch() == 3
    assert rank_numbers.count(seeded) == 6  # past every rank whose standby was known
    assert seeded.get(failover.STANDBY + "5") == standbys[5].addr.encode()
    assert store_generation(sealed(seeded)) == 1 and links[5].generation == 1
    rank_numbers.set_floor(seeded, 4)  # written once: a later (or forged) floor never lowers it
    assert rank_numbers.claim(seeded)[0] == 6


@pytest.mark.parametrize("first", ["the_agent", "a_join"])
def test_a_rank_number_is_never_handed_out_twice_across_a_move(first):
    """A joiner numbered on the old store after the members last looked (its agent claimed rank 2;
    the process is still starting) and an `elaswave join` numbered on the new one: whichever asks
    the new store first has the number, and the other learns it has not -- a process holding the
    old claim stops (it checks with :func:`rank_numbers.reclaim`), or the join gets the next number.
    (Before: the new store's count began where the members had looked, and both held rank 2.)"""
    job, job_addr = _server()
    link = _link(job_addr)
    rank_numbers.set_floor(link, 2)
    standbys = {r: failover.Standby("127.0.0.1", 15.0) for r in (0, 1)}
    for rank, standby in standbys.items():
        standby.register(link, rank)
    for standby in standbys.values():
        standby.learn(link, [0, 1])
    joiner, joiner_claim = rank_numbers.claim(link)  # on the old store, unseen by the members
    assert joiner == 2
    links = {r: _link(job_addr) for r in (0, 1)}
    for rank in (1, 0):
        leader, _ = failover.move(links[rank], standbys[rank], rank, 0, (0, 1), {"model": {"d": 8}})
    failover.announce(links[leader])
    new = standbys[leader].server
    if first == "the_agent":
        assert rank_numbers.reclaim(new, joiner, joiner_claim)
        assert rank_numbers.claim(new)[0] == 3
    else:
        assert rank_numbers.claim(new)[0] == 2
        assert not rank_numbers.reclaim(new, joiner, joiner_claim)  # its agent stops it
    assert rank_numbers.count(new) == (4 if first == "the_agent" else 3)


def test_an_agent_follows_the_standby_that_became_the_store_and_gives_up_on_none():
    job, job_addr = _server()
    link = _link(job_addr)
    idle, ready = failover.Standby("127.0.0.1", 15.0), failover.Standby("127.0.0.1", 15.0)
    idle.register(link, 0)
    ready.register(link, 1)
    rank_numbers.set_floor(link, 2)
    directory = failover.Directory(every_s=0)
    directory.refresh(link)
    assert directory.known == {0: idle.addr, 1: ready.addr} and directory.ranks == 2
    began = time.monotonic()
    assert directory.follow(link, 0.5, 15.0) is None  # neither is the job's store yet
    assert time.monotonic() - began < 2.0
    ready.server.set(GENERATION, "1")
    assert directory.follow(link, 15.0, 15.0) == ready.addr
    assert link.addr == ready.addr and directory.generation == 1 and link.generation == 1


@pytest.mark.parametrize("port", ["answers", "closed"])
def test_on_a_moved_store_a_live_member_not_there_yet_gets_the_agreements_grace(port):
    """The store died during a recovery and moved; a live member blocked in a collective with the
    dead comes to the new store only when its links give up and its watcher wakes it (twice the
    heartbeat timeout). While its liveness port answers, its silence there does not make it a
    suspect within one timeout, nor within the agreement's grace (a live rank left out, issue 58)
    -- after MOVED_PATIENCE timeouts it does. A member whose port is gone is suspected after one,
    as before the move."""
    from elaswave.control.heartbeat import Watcher
    from elaswave.control.membership import MOVED_PATIENCE
    from elaswave.control.liveness import LivenessPort, Prober
    from elaswave.interrupt import Interrupt

    old, old_addr = _server()
    new, new_addr = _server()
    link = _link(old_addr)
    timeout_s = 0.5
    liveness = LivenessPort("127.0.0.1")
    liveness.register(link, 1)
    prober = Prober()
    prober.learn([1], link)
    watcher = Watcher(link.separate(), 0, lambda: (0, (0, 1)), Interrupt(), 0.05, timeout_s, prober)
    watcher.start()
    try:
        for _ in range(10):  # rank 1 beats on the job's first store
            old.add(f"{PREFIX}hb/1", 1)
            time.sleep(0.05)
        if port == "closed":
            liveness.close()
        link.move(new_addr)  # the move; rank 1 is not there yet
        deadline = time.monotonic() + MOVED_PATIENCE * timeout_s + 10.0
        while watcher.membership.alert_count() == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        alert = watcher.membership.read_alert(1)
        assert alert is not None and alert.ranks == (1,), alert
        # How long rank 1 had been silent on the new store when it became a suspect (the watcher's
        # own connection to the new store may take a while on a loaded box: not counted)
        silent_s = float(re.search(r"missed heartbeats for ([0-9.]+)s", alert.reason).group(1))
        if port == "answers":
            assert silent_s >= MOVED_PATIENCE * timeout_s, alert
        else:
            assert silent_s < 3 * timeout_s, alert
    finally:
        watcher.stop()
        liveness.close()


def test_the_store_holder_sigkilled_the_job_trains_on_bit_identical(tmp_path, reference):
    """`elaswave run` hosts the store; SIGKILL it at step 8 or later. Its workers (no parent-death
    signal) notice within the heartbeat timeout, move the store to rank 0's standby at the end of
    one step, and train every remaining step: no step lost or repeated, the same losses and final
    state as the failure-free reference."""
    metrics = tmp_path / "run.jsonl"
    args = job_args(2, 2, STEPS, True, ["parallel.timeout_s=20"])
    with Running(args, metrics) as job:
        workers, killed_at, killed_after = sigkill_launcher(job, 8)
        assert not wait_gone(workers, 120), "the workers did not finish within 120 s of the store's loss"
        res = job.finish(10)
    assert "moved to rank 0's standby" in res.stderr, res.stderr
    [moved] = [r for r in res.records if r["event"] == "store_moved"]
    assert moved["to_rank"] == 0 and moved["step"] >= killed_after, moved
    assert moved["noticed_wall"] - killed_at < 2.0 + 1.5  # the heartbeat timeout (2 s), and slack
    assert not [r for r in res.records if r["event"] in ("recovery", "store_lost")]
    assert_same_run(res, reference, STEPS)
