"""A process that reaches the job's store but lacks its token cannot steer the job (issues 35, 58);
from another host it cannot reach the store at all (a one-host job listens on loopback alone).

The outsider writes what would have steered the job before records were sealed: a death, two
watchers' alerts, the next epoch's decision, a check-in cutting ranks off, a standby address (the
store's next move), a join request with its admission, "the training finished" -- and adds to every
counter it can name (a raised epoch count once kept a job from writing its summary). Then a real
rank is SIGKILLed: the job must leave out that rank alone, at the next step, stay bit-identical
and write its summary."""
import json
import subprocess
import time

import torch.distributed as dist

from elaswave.control.link import client
from tests.helpers import netns
from tests.helpers.spawn import Running, assert_same_run, job_args, reference_fixture, session_members

STEPS, DP, MBS = 30, 4, 12
EXTRA = [f"train.num_micro_batches={MBS}", "parallel.timeout_s=60"]
reference = reference_fixture(STEPS, MBS)


def _forge(addr: str, own: dist.TCPStore) -> int:
    """Everything the outsider writes; returns the rank number it asked to join as."""
    host, port = addr.rsplit(":", 1)
    store = _connect(host, int(port))
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


def _connect(host: str, port: int, within_s: float = 60.0) -> dist.Store:
    """A client of the job's store, tried again until ``within_s``: on a loaded box one TCPStore
    connection now and then gets no answer for its whole timeout (twice 10 s, with two busy loops
    beside the suite), where a new one is answered at once."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return client(host, port, 2.0, 10.0)
        except (OSError, RuntimeError):  # TimeoutError, or torch's DistNetworkError
            if time.monotonic() > deadline:
                raise


def _listening(pids: list[int]) -> list[str]:
    """The local addresses the processes ``pids`` listen on (TCP)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=10).stdout.splitlines()
    return [line.split()[3] for line in out if any(f"pid={p}," in line for p in pids)]


def _from_another_host(port: int) -> bool | None:
    """Whether a process in another network namespace connects to this host's address at ``port``
    (None: no namespace can be made here)."""
    if netns.unavailable():
        return None
    with netns.OtherHost() as host:
        probe = f"import socket; socket.create_connection(('{host.here_store_ip}', {port}), timeout=2)"
        done = subprocess.run([*host.prefix(), "python3", "-c", probe], capture_output=True, timeout=30)
    return done.returncode == 0


def test_an_outsider_without_the_token_cannot_evict_redirect_or_join(tmp_path, reference):
    own = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False)
    args = job_args(DP, 1, STEPS, True, [*EXTRA, "elastic.inject=kill:rank=2,step=16,phase=backward"])
    with Running(args, tmp_path / "run.jsonl") as job:
        addr = job.wait_for(r"store at (\S+);", 60).group(1)
        job.wait_for(r"step\s+4/", 120)
        bound = _listening(session_members(job.proc.pid))
        reached = _from_another_host(int(addr.rsplit(":", 1)[1]))
        outsider_rank = _forge(addr, own)
        res = job.finish(240)
    # A one-host job listens on loopback alone: its store, standbys, liveness ports and gloo.
    assert len(bound) >= 1 + 3 * DP and all(a.startswith("127.0.0.1:") for a in bound), bound
    assert reached in (None, False), "the job's store answered from another host"
    assert res.returncode == 0, res.stderr
    assert_same_run(res, reference, STEPS)
    (rec,) = [r for r in res.records if r["event"] == "recovery"]
    assert rec["lost_ranks"] == [2] and rec["epoch"] == 1, rec
    assert res.summary["ranks"] == [0, 1, 3]
    assert not [r for r in res.records if r["event"] in ("join", "grow")]
    assert "is not sealed with the job's token: not answered" in res.stderr
    assert outsider_rank not in res.summary["ranks"]
    assert own.num_keys() <= 1  # nobody moved the job's store to the outsider's (1: its own bookkeeping key)
