"""Admission over a real TCPStore: the token's proof, the leader's verdicts, and what a joiner sees;
and the chaos schedules (pure)."""
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from elaswave.control.admission import Admission, Refused
from elaswave.control.chaos import schedule
from elaswave.control.membership import Membership


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=10))


def _client(store, rank):
    return Admission(dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10)), rank)


def test_only_a_request_made_with_the_jobs_token_is_genuine(store):
    leader = Admission(store, 0)
    _client(store, 4).request("the-secret", started_wall=1.0)
    _client(store, 5).request("a-guess", started_wall=1.0)
    _client(store, 6).request(None, started_wall=1.0)
    pending = leader.pending(members=(0, 1, 2, 3))
    assert [r.rank for r in pending] == [4, 5, 6]
    assert [leader.is_genuine(r, "the-secret") for r in pending] == [True, False, False]
    assert not leader.is_genuine(pending[0], None)  # a job without a token admits nobody
    assert "the-secret" not in str(store.get("ew/join/1"))  # the token never enters the store


def test_verdicts_reach_the_joiner_and_answered_requests_are_not_pending(store):
    leader = Admission(store, 0)
    joiner, stranger = _client(store, 4), _client(store, 5)
    joiner.request("s", started_wall=1.0)
    stranger.request("x", started_wall=1.0)
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
    _client(store, 6).request("s", started_wall=1.0)
    Membership(store, -1).report_dead(6, "exited with code 1", alert=False)
    assert leader.pending(members=(0, 1, 4)) == []
    with pytest.raises(TimeoutError, match="no answer to the join request"):
        joiner.wait_verdict(2, timeout_s=0.2)


def test_a_joiner_waiting_for_its_verdict_sees_the_end_of_the_job_at_once(store):
    # It waits on the job's events: the end of the job ends its wait within one poll, not after
    # parallel.timeout_s (under load a late joiner used to outlive the job by that timeout).
    joiner = _client(store, 4)
    joiner.request("s", started_wall=1.0)
    timer = threading.Timer(0.3, lambda: store.set("ew/done", "1"))
    timer.start()
    began = time.monotonic()
    assert joiner.wait_verdict(1, timeout_s=60) is None
    assert 0.2 < time.monotonic() - began < 5
    assert _client(store, 5).stand_by(poll_s=0.1) is None


def test_a_verdict_that_never_comes_is_a_timeout_naming_the_rank(store):
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
