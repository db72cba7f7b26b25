"""Admission over a real TCPStore: sealed requests, the leader's verdicts, and what a joiner sees;
and the chaos schedules (pure)."""
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from elaswave.control.admission import Admission, Refused
from elaswave.control.chaos import schedule
from elaswave.control.membership import Membership
from elaswave.control.seal import TokenMismatch, open_job, seal

TOKEN = "the-secret"


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=10))


def _raw(store):
    return dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))


def _client(store, rank, token=TOKEN):
    return Admission(open_job(_raw(store), token, found=True), rank)


def _leader(store, token=TOKEN):
    return Admission(open_job(store, token), 0)


def test_only_a_request_sealed_with_the_jobs_key_is_read(store):
    leader = _leader(store)
    _client(store, 4).request(started_wall=1.0)
    with pytest.raises(TokenMismatch, match="ELASWAVE_TOKEN differs from the job's"):
        _client(store, 5, token="a-guess")  # a joiner with another token stops before it asks
    Admission(_raw(store), 6).request(started_wall=1.0)  # no seal: an outsider, or a job without a token
    # Sealed with the same token for another job (its own nonce), or for another request number:
    # a request read off a store proves nothing anywhere else.
    other = open_job(dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False), TOKEN)
    doc = '{"rank": 7, "started_wall": 1.0, "requested_wall": 1.0}'
    store.add("ew/join_seq", 10)  # (no count says how many requests there are)
    store.set("ew/join/3", seal(other.key, "ew/join/3", doc))
    store.set("ew/join/4", seal(leader.store.key, "ew/join/2", doc))
    assert [r.rank for r in leader.pending(members=(0, 1, 2, 3))] == [4]
    # The next real request takes the first slot that holds none (the unsealed one's), and is read.
    _client(store, 8).request(started_wall=1.0)
    assert [r.rank for r in leader.pending(members=(0, 1, 2, 3))] == [4, 8]
    assert leader.proves_tokens and not Admission(_raw(store), 0).proves_tokens  # no token: admits nobody
    assert TOKEN not in str(store.get("ew/join/1"))  # the token never enters the store


def test_verdicts_reach_the_joiner_and_answered_requests_are_not_pending(store):
    leader = _leader(store)
    joiner, stranger = _client(store, 4), _client(store, 5)
    joiner.request(started_wall=1.0)
    stranger.request(started_wall=1.0)
    leader.pending(members=(0, 1))
    leader.refuse(5, "its request did not prove the job's token")
    leader.admit([4], epoch=3, prev_plan={"epoch": 2})
    with pytest.raises(Refused, match="rank 5 was refused by the job: its request did not prove"):
        stranger.wait_verdict(1, timeout_s=5)
    verdict = joiner.wait_verdict(1, timeout_s=5)
    assert verdict.epoch == 3 and verdict.joining == (4,) and verdict.prev_plan == {"epoch": 2}
    assert leader.joining(3) == (4,) and leader.joining(4) == ()
    assert [r.rank for r in leader.pending(members=(0, 1, 4))] == []
    assert set(leader.walls([4])) == {"started", "requested", "admitted"}
    # A joiner whose process died is not pending either.
    _client(store, 6).request(started_wall=1.0)
    Membership(leader.store, -1).report_dead(6, "exited with code 1", alert=False)
    assert leader.pending(members=(0, 1, 4)) == []
    with pytest.raises(TimeoutError, match="no answer to the join request"):
        joiner.wait_verdict(2, timeout_s=0.2)


def test_a_joiner_waiting_for_its_verdict_sees_the_end_of_the_job_at_once(store):
    # It waits on the job's events: the end of the job ends its wait within one poll, not after
    # parallel.timeout_s (under load a late joiner used to outlive the job by that timeout).
    leader = _leader(store)
    joiner = _client(store, 4)
    joiner.request(started_wall=1.0)
    store.set("ew/done", "1")  # an outsider's "done" (unsealed) ends no wait
    timer = threading.Timer(0.3, lambda: Membership(leader.store, -1).stamp("done"))
    timer.start()
    began = time.monotonic()
    assert joiner.wait_verdict(1, timeout_s=60) is None
    assert 0.2 < time.monotonic() - began < 5
    assert _client(store, 5).stand_by(poll_s=0.1) is None


def test_a_verdict_that_never_comes_is_a_timeout_naming_the_rank(store):
    _leader(store)
    with pytest.raises(TimeoutError, match="rank 4: no answer to the join request within 0.3s"):
        _client(store, 4).wait_verdict(1, timeout_s=0.3)


def test_chaos_schedules_are_seeded_and_keep_enough_founders():
    assert schedule(3, 6, 120) == schedule(3, 6, 120)
    assert any(schedule(s, 6, 120) != schedule(3, 6, 120) for s in range(4, 8))
    for seed in range(40):
        faults = schedule(seed, 6, 120, events=6)
        victims = {int(f.split("rank=")[1].split(",")[0]) for f in faults if not f.startswith("join")}
        assert victims <= set(range(6)) and len(victims) <= 4
        assert all(int(f.split("step=")[1].split(",")[0]) <= 72 for f in faults if f.startswith("join"))
    with pytest.raises(ValueError, match="too short"):
        schedule(0, 6, 10)
