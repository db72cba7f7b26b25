"""A watcher starved across hosts evicts nobody healthy (issue 35, item 4).

Two hosts (host 1 a network namespace), dp=2 x pp=2: rank 2, on host 1, watches ranks 0 and 1 on
host 0. Its watcher thread is held back for 3 s (``starve``) while the rank computes on; when it
runs again its last view of its neighbours is 3 s old, past the 2 s heartbeat timeout. Neither
neighbour may be left out, and the run stays bit-identical to the reference.

- On etcd a rank's lease is renewed on a thread of its own: the starved rank stays alive to the
  job too, so nothing changes at all -- every step at world 4, no recovery.
- On the embedded TCPStore the watcher thread is also what beats for its rank: the rank's two
  watchers on host 0 see it silent for the timeout, name it, and it is left out (exit 3 when it
  wakes, writing nothing). That is the only change: ranks 0, 1 and 3 train on.
"""
import contextlib

import pytest

from elaswave.control.link import EXIT_EXCLUDED
from tests.helpers import netns
from tests.helpers.etcd import EtcdCluster
from tests.helpers.spawn import Running, assert_same_run, job_args, free_port, reference_fixture, slowed

STEPS, MBS, STARVED_AT = 120, 4, 6
EXTRA = [f"train.num_micro_batches={MBS}", "parallel.timeout_s=60", "elastic.heartbeat_timeout_s=2",
         "elastic.respawn_after_s=-1", f"elastic.inject=starve:rank=2,step={STARVED_AT},seconds=3;{slowed(4, 2)};"
         + ";".join(f"slow:rank={r},step={STARVED_AT + 1},factor=8" for r in range(4))]
# Slowed (a sleep: the same bits) so that the job goes on for seconds after the watcher runs again:
# at full speed it once ended 4.7 s after the starvation began, and slowed only twice, unloaded,
# 4.9 s after (the three left train faster): from the step after it, eight times.
reference = reference_fixture(STEPS, MBS)


@pytest.mark.parametrize("backend", [pytest.param("etcd", marks=pytest.mark.slow), "c10d"])
def test_a_watcher_starved_for_3_s_evicts_no_healthy_neighbour(tmp_path, reference, backend):
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    with netns.OtherHost() as host, \
            (EtcdCluster(3, hosts=[host.here_store_ip] * 3) if backend == "etcd" else contextlib.nullcontext()) as etcd:
        rdzv = (["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints] if backend == "etcd" else
                ["--rdzv-endpoint", f"{host.here_store_ip}:{free_port()}"])

        def agent(k, bind, prefix=()):
            args = job_args(2, 2, STEPS, True, [*EXTRA, f"parallel.bind_address={bind}"])
            return Running(args + ["--nnodes", "2", "--node-rank", str(k), *rdzv], tmp_path / f"m{k}.jsonl",
                           env={"ELASWAVE_TOKEN": "starved", "TORCH_CPP_LOG_LEVEL": "ERROR"}, prefix=list(prefix))
        with agent(0, host.here_peer_ip) as host0, agent(1, host.peer_ip, host.prefix()) as host1:
            res = host0.finish(240)
            res1 = host1.finish(60)
    assert res.returncode == 0, res.stderr
    assert "injecting a starved watcher into rank 2" in res1.stderr, res1.stderr[-2000:]
    assert_same_run(res, reference, STEPS)
    starved = min(r["wall_time"] for r in res.steps if r["step"] == STARVED_AT)
    assert res.steps[-1]["wall_time"] - starved > 5.0, "the job ended before the watcher ran again: nothing was tested"
    recoveries = [r for r in res.records if r["event"] == "recovery"]
    worlds = [r["world_size"] for r in res.steps]
    if backend == "etcd":
        assert recoveries == [] and set(worlds) == {4}, (recoveries, sorted(set(worlds)))
    else:
        assert [r["lost_ranks"] for r in recoveries] == [[2]], recoveries
        assert "heartbeat" in recoveries[0]["evidence"]["2"], recoveries[0]["evidence"]
        assert worlds[0] == 4 and worlds[-1] == 3, sorted(set(worlds))
        assert f"exited with code {EXIT_EXCLUDED}" in res1.stderr or "left out of epoch" in res1.stderr, res1.stderr[-2000:]

