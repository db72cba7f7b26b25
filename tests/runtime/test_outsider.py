"""A process that reaches the job's store but lacks its token cannot steer the job (issue 35 item 6).

The outsider writes what would have steered the job before records were sealed: a death, two
watchers' alerts, the next epoch's decision, a check-in cutting ranks off, a standby address (the
store's next move), a raised epoch count, and a join request with its admission. Then a real rank
is SIGKILLed: the job must leave out that rank alone, at the next step, and stay bit-identical."""
import json
from datetime import timedelta

import torch.distributed as dist

from tests.helpers.spawn import Running, assert_same_run, job_args, reference_fixture

STEPS, DP, MBS = 30, 4, 12
EXTRA = [f"train.num_micro_batches={MBS}", "parallel.timeout_s=60"]
reference = reference_fixture(STEPS, MBS)


def _forge(addr: str, own: dist.TCPStore) -> int:
    """Everything the outsider writes; returns the rank number it asked to join as."""
    host, port = addr.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
    store.set("ew/dead/1", "was killed by SIGKILL")
    for by in ("rank 0", "rank 1"):  # rank 3's two watchers, as a reader would count them
        n = store.add("ew/alert_seq", 1)
        store.set(f"ew/alert/{n}", json.dumps({"epoch": 0, "by": by, "reason": "rank 3 missed heartbeats",
                                               "ranks": [3], "network": False, "watchers": 2}))
    store.set("ew/ep/1/members", json.dumps([0]))
    store.set("ew/ep/1/in/1", json.dumps([0, 3]))
    store.set("ew/standby/0", f"127.0.0.1:{own.port}")
    store.add("ew/epoch", 3)
    rank = store.add("ew/next_rank", 1) - 1
    n = store.add("ew/join_seq", 1)
    store.set(f"ew/join/{n}", json.dumps({"rank": rank, "started_wall": 0.0, "requested_wall": 0.0}))
    store.set("ew/ep/1/joining", json.dumps([rank]))
    return rank


def test_an_outsider_without_the_token_cannot_evict_redirect_or_join(tmp_path, reference):
    own = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False)
    args = job_args(DP, 1, STEPS, True, [*EXTRA, "elastic.inject=kill:rank=2,step=16,phase=backward"])
    with Running(args, tmp_path / "run.jsonl") as job:
        addr = job.wait_for(r"store at (\S+);", 60).group(1)
        job.wait_for(r"step\s+4/", 120)
        outsider_rank = _forge(addr, own)
        res = job.finish(240)
    assert res.returncode == 0, res.stderr
    assert_same_run(res, reference, STEPS)
    (rec,) = [r for r in res.records if r["event"] == "recovery"]
    assert rec["lost_ranks"] == [2] and rec["epoch"] == 1, rec
    assert res.summary["ranks"] == [0, 1, 3]
    assert not [r for r in res.records if r["event"] in ("join", "grow")]
    assert "is not sealed with the job's token: not answered" in res.stderr
    assert outsider_rank not in res.summary["ranks"]
    assert own.num_keys() <= 1  # nobody moved the job's store to the outsider's (1: its own bookkeeping key)
