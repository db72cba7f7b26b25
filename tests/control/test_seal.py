"""Sealed control records over a real TCPStore: what a process that reaches the store without the
job's token can write, and what the job makes of it (nothing)."""
import json
from datetime import timedelta

import pytest
import torch.distributed as dist

from elaswave.control import failover, rank_numbers, sequence
from elaswave.control.liveness import LivenessPort, Prober
from elaswave.control.membership import Membership
from elaswave.control.seal import (Forged, Sealed, TokenMismatch, announce_generation, open_job, opened, seal,
                                   store_generation)
from tests.helpers.threads import at_once

TOKEN = "job-token"


@pytest.fixture
def server():
    return dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=10))


def _raw(server):
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))


def _job(server, token=TOKEN, found=True):
    return open_job(_raw(server), token, found=found)


def test_a_seal_is_bound_to_its_key_its_name_and_its_value():
    key = b"k" * 32
    raw = seal(key, "ew/dead/2", "was killed")
    assert opened(key, "ew/dead/2", raw) == b"was killed"
    assert opened(b"x" * 32, "ew/dead/2", raw) is None  # another job's key
    assert opened(key, "ew/dead/3", raw) is None  # moved to another record
    assert opened(key, "ew/dead/2", raw.replace(b"killed", b"kilted")) is None
    assert opened(key, "ew/dead/2", b"was killed") is None  # no seal at all


def test_every_process_with_the_token_derives_the_jobs_key_and_no_other_does(server):
    first = open_job(server, TOKEN)
    assert _job(server).key == first.key and first.key is not None
    assert open_job(server, TOKEN).key == first.key  # a second founder reads the first one's nonce
    with pytest.raises(TokenMismatch, match="ELASWAVE_TOKEN differs from the job's"):
        _job(server, token="a-guess")
    other = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False)
    assert open_job(other, TOKEN).key != first.key  # the same token, another job: another key
    with pytest.raises(TokenMismatch, match="started without ELASWAVE_TOKEN"):
        _job(dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False))
    assert TOKEN.encode() not in server.get("ew/job")


def test_forged_deaths_alerts_hosts_and_check_ins_do_not_count(server):
    job = open_job(server, TOKEN)
    outsider = _raw(server)
    members = Membership(job, 0)
    for r in (0, 1, 2, 3):
        Membership(_job(server), r).announce_host(f"host{r}")
    outsider.set("ew/dead/1", "was killed by SIGKILL")
    for by in ("rank 0", "rank 3"):  # both of rank 2's watchers, as far as a reader can tell
        n = outsider.add("ew/alert_seq", 1)
        outsider.set(f"ew/alert/{n}", json.dumps({"epoch": 0, "by": by, "reason": "missed heartbeats",
                                                  "ranks": [2], "watchers": 2}))
    outsider.set("ew/host/3", "host0")
    outsider.set("ew/ep/1/in/3", json.dumps([0, 1, 2]))  # rank 3 "cannot reach" the others
    assert members.known_dead([0, 1, 2, 3]) == (set(), set())
    # An overwritten record is lost (a denial of service), never taken for the outsider's value.
    assert members.read_alert(1) is None and members.hosts([2, 3]) == {2: "host2"}
    assert members._checked_in(1, [0, 1, 2, 3]) == {}
    assert members.death_evidence([1]) == {1: "did not check in within elastic.agree_timeout_s"}
    # The same records sealed by a member count.
    Membership(_job(server), -1).report_dead(1, "was killed by SIGKILL", alert=False)
    assert members.known_dead([0, 1, 2, 3])[0] == {1}


def test_a_forged_decision_is_replaced_by_the_real_one_and_a_forged_epoch_count_is_not_the_epoch(server):
    job = open_job(server, TOKEN)
    outsider = _raw(server)
    outsider.set("ew/ep/1/members", json.dumps([0]))  # ranks 1-3 "left out"
    outsider.add("ew/epoch", 5)
    clients = {r: Membership(_job(server), r) for r in range(4)}
    assert clients[0].members_of(1) is None and clients[0].current_epoch() == 0
    def run(r):
        clients[r].check_in(1)
        return clients[r].agree([0, 1, 2, 3], 1, agree_timeout_s=5.0, timeout_s=10.0)

    results = at_once(run, clients)
    assert results == {r: (0, 1, 2, 3) for r in range(4)}
    assert Membership(job, -1).members_of(1) == (0, 1, 2, 3) and clients[1].current_epoch() == 1
    # A record the outsider keeps rewriting is an error, never a decision of its.
    assert job.compare_set("ew/ep/2/cut", "", "{}") == b"{}"
    with pytest.raises(Forged):
        outsider.set("ew/ep/2/members", "[9]")
        job.get("ew/ep/2/members")


def test_a_forged_standby_or_liveness_address_is_not_followed(server):
    job = open_job(server, TOKEN)
    outsider = _raw(server)
    standby = failover.Standby("127.0.0.1", 10)
    standby.register(_job(server), 0)
    outsider.set("ew/standby/1", "203.0.113.9:29400")  # redirect the store's next move there
    learner = failover.Standby("127.0.0.1", 10)
    learner.learn(job, [0, 1])
    assert learner.known == {0: standby.addr}
    directory = failover.Directory(every_s=0)
    rank_numbers.set_floor(job, 2)  # as node 0's launcher does: ranks 0 and 1 are the founding ones
    outsider.add("ew/next_rank", 10**9)  # no count says how many ranks there are (nor makes a reader scan them)
    directory.refresh(job)
    assert directory.known == {0: standby.addr}
    outsider.set("ew/standby/0", "203.0.113.9:29400")  # over a real one: lost, never followed
    learner = failover.Standby("127.0.0.1", 10)
    learner.learn(job, [0, 1])
    assert learner.known == {}
    port = LivenessPort("127.0.0.1")
    port.register(_job(server), 2)
    watcher = Prober()
    watcher.learn([2], job)  # reached: a refusal from it would now prove rank 2 dead
    outsider.set("ew/live/2", "127.0.0.1:1")  # a port that refuses, as "proof" that rank 2 is dead
    assert not Prober().is_gone(2, job) and Prober()._address(2, job) is None
    assert Prober()._address(2, Sealed(_raw(server), None)) == "127.0.0.1:1"  # what an unsealed job would use
    assert not watcher.is_gone(2, job)
    port.close()
    assert watcher.is_gone(2, job)


def test_a_seal_binds_the_stores_generation_so_nothing_is_replayed_across_a_move(server):
    key = b"k" * 32
    assert opened(key, "ew/alert/1", seal(key, "ew/alert/1", "x", 1), 1) == b"x"
    assert opened(key, "ew/alert/1", seal(key, "ew/alert/1", "x", 0), 1) is None  # alert 1 of the old store
    job = open_job(server, TOKEN)
    Membership(job, 0).alert(0, "before the move", [3])
    before = _raw(server).get("ew/alert/1")
    # The store moved (here: this store becomes generation 1, as a standby does when seeded).
    announce_generation(job, 1)
    assert store_generation(job) == 1
    outsider = _raw(server)
    outsider.set("ew/store/generation", _raw(server).get("ew/store/generation").replace(b"1\n", b"7\n"))
    assert store_generation(job) == 0  # a forged generation opens nothing
    assert opened(job.key, "ew/alert/1", before, 1) is None and opened(job.key, "ew/alert/1", before, 0) is not None


def test_no_count_steers_alerts_epochs_or_rank_numbers(server):
    """An outsider adds to every counter it can name and puts junk where the next records go:
    alerts and rank numbers are claimed in sealed slots (the junk is replaced, no gap is left),
    the epoch is the newest sealed decision."""
    job = open_job(server, TOKEN)
    outsider = _raw(server)
    for name in ("ew/epoch", "ew/alert_seq", "ew/join_seq", "ew/next_rank"):
        outsider.add(name, 1000)
    outsider.set("ew/alert/1", json.dumps({"epoch": 0, "by": "rank 0", "reason": "x", "ranks": [2]}))
    outsider.set("ew/rank/4", "mine")
    rank_numbers.set_floor(job, 4)
    member = Membership(job, 0)
    assert member.current_epoch() == 0 and member.alert_count() == 0
    member.alert(0, "rank 2 missed heartbeats", [2])
    assert member.alert_count() == 1 and member.read_alert(1).reason == "rank 2 missed heartbeats"
    assert [rank_numbers.claim(job)[0] for _ in range(3)] == [4, 5, 6]
    assert rank_numbers.count(job) == 7
    outsider.add("ew/next_rank", -10**6)
    rank, claim = rank_numbers.claim(job)
    assert rank == 7 and rank_numbers.reclaim(job, 7, claim) and not rank_numbers.reclaim(job, 5, claim)
    # A record replaced under a writer's feet: the writer takes the next slot, the reader the run.
    assert sequence.append(job, "ew/seq/", "a") == 1 and sequence.append(job, "ew/seq/", "b") == 2
    assert sequence.count(job, "ew/seq/") == 2


def test_a_sequence_is_measured_in_logarithmic_reads_from_where_it_is_known():
    """A process that starts late in a long job (a joiner, a look after a move) reads O(log n)
    slots, not one per record since the start: on etcd each read is a request, inside a bounded wait."""
    for end in [0, 1, 2, 3, 7, 8, 9, 100, 1000]:
        for known in sorted({0, end // 2, end}):
            reads = []

            def filled(n: int) -> bool:
                reads.append(n)
                return n <= end
            assert sequence.extent(filled, known) == end
            assert len(reads) <= 2 * max(1, end - known).bit_length() + 1, (end, known, reads)
