"""A process that reaches the job's store but lacks its token cannot steer the job (issues 35, 58);
from another host it cannot reach the store at all (a one-host job listens on loopback alone).

The outsider writes what would have steered the job before records were sealed: a death, two
watchers' alerts, the next epoch's decision, a check-in cutting ranks off, a standby address (the
store's next move), a join request with its admission, "the training finished" -- and adds to every
counter it can name (a raised epoch count once kept a job from writing its summary). Then a real
rank is SIGKILLed: the job must leave out that rank alone, at the next step, stay bit-identical
and write its summary."""
import contextlib
import json
import subprocess
from datetime import timedelta

import torch.distributed as dist

from tests.helpers import netns
from tests.helpers.spawn import Running, assert_same_run, job_args, reference_fixture, session_members, steps_written

STEPS, DP, MBS = 30, 4, 12
EXTRA = [f"train.num_micro_batches={MBS}", "parallel.timeout_s=60"]
reference = reference_fixture(STEPS, MBS)


def _forge(addr: str, own: dist.TCPStore) -> int:
    """Everything the outsider writes; returns the rank number it asked to join as."""
    host, port = addr.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
    store.set("ew/dead/1", "was killed by SIGKILL")
    for n, by in ((1, "rank 0"), (2, "rank 1")):  # rank 3's two watchers, as a reader would count them
        store.set(f"ew/alert/{n}", json.dumps({"epoch": 0, "by": by, "reason": "rank 3 missed heartbeats",
                                               "ranks": [3], "network": False, "watchers": 2}))
    store.set("ew/ep/1/members", json.dumps([0]))
    store.set("ew/ep/1/in/1", json.dumps([0, 3]))
    store.set("ew/standby/0", f"127.0.0.1:{own.port}")
    # Every counter it can name, up and down (a raised epoch count once kept the job from writing
    # its summary): none of them is read as a decision.
    for name in ("ew/epoch", "ew/alert_seq", "ew/join_seq", "ew/next_rank", "ew/spares_standing",
                 "ew/agents/finished", "ew/ep/1/num_in"):
        store.add(name, 1000)
    store.add("ew/next_rank", -2000)
    store.set("ew/done", "1")  # "the training finished": the agents would stop the workers
    store.set("ew/alert/3", json.dumps({"epoch": 0, "by": "rank 0", "reason": "junk ahead", "ranks": [1]}))
    rank = 99
    store.set("ew/join/1", json.dumps({"rank": rank, "started_wall": 0.0, "requested_wall": 0.0}))
    store.set("ew/ep/1/joining", json.dumps([rank]))
    return rank


def _listening(pids: list[int]) -> list[str]:
    """The local addresses the processes ``pids`` listen on (TCP)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=10).stdout.splitlines()
    return [line.split()[3] for line in out if any(f"pid={p}," in line for p in pids)]


@contextlib.contextmanager
def _other_host():
    """Another host (a network namespace), or None where none can be made here. Made before the
    job starts: on a loaded box making one took longer than the job's whole run."""
    if netns.unavailable():
        yield None
        return
    with netns.OtherHost() as host:
        yield host


def _reaches(host, port: int) -> bool | None:
    """Whether a process on ``host`` connects to this host's address at ``port`` (None: no host)."""
    if host is None:
        return None
    probe = [*host.prefix(), "timeout", "2", "bash", "-c", f"</dev/tcp/{host.here_store_ip}/{port}"]
    return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0


def test_an_outsider_without_the_token_cannot_evict_redirect_or_join(tmp_path, reference):
    own = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False)
    args = job_args(DP, 1, STEPS, True, [*EXTRA, "elastic.inject=kill:rank=2,step=16,phase=backward"])
    with _other_host() as host, Running(args, tmp_path / "run.jsonl") as job:
        addr = job.wait_for(r"store at (\S+);", 60).group(1)
        job.wait_for(r"step\s+4/", 120)
        outsider_rank = _forge(addr, own)
        bound = _listening(session_members(job.proc.pid))
        reached = _reaches(host, int(addr.rsplit(":", 1)[1]))
        control = _reaches(host, own.port)  # torch's own server listens on every interface: reached
        # Each look above was at a running job (a loaded box once saw it end first: its store gone,
        # nothing forged, every look proving nothing)
        assert job.proc.poll() is None and steps_written(tmp_path / "run.jsonl") < STEPS, \
            "the job ended before the outsider's looks; give it more steps"
        res = job.finish(240)
    # A one-host job listens on loopback alone: its store, standbys, liveness ports and gloo.
    assert len(bound) >= 1 + 3 * DP and all(a.startswith("127.0.0.1:") for a in bound), bound
    assert reached in (None, False), "the job's store answered from another host"
    assert control in (None, True), "the probe from another host reaches nothing: it proves nothing"
    assert res.returncode == 0, res.stderr
    assert_same_run(res, reference, STEPS)
    (rec,) = [r for r in res.records if r["event"] == "recovery"]
    assert rec["lost_ranks"] == [2] and rec["epoch"] == 1, rec
    assert res.summary["ranks"] == [0, 1, 3], res.summary["ranks"]
    assert not [r for r in res.records if r["event"] in ("join", "grow")], res.records
    assert "is not sealed with the job's token: not answered" in res.stderr, res.stderr[-4000:]
    assert outsider_rank not in res.summary["ranks"], res.summary["ranks"]
    assert own.num_keys() <= 1, own.num_keys()  # nobody moved the job's store to the outsider's (1: its own bookkeeping key)
