"""Fencing: a rank the job went on without comes back and writes nothing.

A whole host paused (its agent and workers SIGSTOPped: a frozen VM, a live migration) past the
heartbeat timeout is left out; the job trains on. Continued, its ranks still believe in the old
epoch, and their links may have given up on the store meanwhile (the rescue path, which saves). Each
must find that the job went on without it -- the store's epoch has no place for it, or the
checkpoint directory holds a newer fence -- and stop without writing a byte to the job's files.
"""
import contextlib
import os
import signal
import time

import pytest

from elaswave.checkpoint import disk
from elaswave.runtime.worker import EXIT_EXCLUDED
from tests.helpers.etcd import EtcdCluster
from tests.helpers.spawn import TINY, Running, assert_same_run, free_port, run_reference, slowed

PAUSE_S = 12.0  # past the heartbeat timeout (2 s) and past link.SILENT_S (8 s): the links give up too


def _agent(sets, node_rank, rdzv, metrics):
    args = ["run", *[x for s in sets for x in ("--set", s)], "--nnodes", "2", "--node-rank", str(node_rank), *rdzv]
    return Running(args, metrics, env={"ELASWAVE_TOKEN": "fence-test", "TORCH_CPP_LOG_LEVEL": "ERROR"})


def _files(root):
    return {p: p.stat().st_mtime for p in root.rglob("*") if p.is_file()}


# etcd: 140 s on the 2-core CI box (c10d: 80 s), so behind the slow marker (pytest -m slow).
@pytest.mark.parametrize("backend", ["c10d", pytest.param("etcd", marks=pytest.mark.slow)])
def test_a_paused_host_continued_after_the_job_went_on_writes_nothing_and_stops(tmp_path, backend):
    """On etcd the paused ranks' leases go unrenewed (their watchers name them) and then expire."""
    # The job must outlast the pause by many seconds (the paused ranks' links give up first): slowed,
    # 120 steps last longer than 400 did at full speed, and the reference trains 120 (6 s, not 20).
    # After the pause begins (step 12) ranks 0 and 1 train on alone and faster: slowed more from step
    # 13 (an unloaded run's remaining 108 steps took 10.8 s at factor 5, ending before the 12 s pause).
    steps = 120
    ckpt = tmp_path / "ckpt"  # one directory for both hosts: a shared file system
    sets = [*TINY, "parallel.dp=2", "parallel.pp=2", f"train.steps={steps}", "train.num_micro_batches=4",
            "train.deterministic=true", "parallel.timeout_s=30", "elastic.respawn_after_s=-1",
            f"checkpoint.dir={ckpt}", "checkpoint.every_steps=5",
            f"elastic.inject={slowed(4, 5)};slow:rank=0,step=13,factor=12;slow:rank=1,step=13,factor=12"]
    metrics, metrics1 = tmp_path / "run.jsonl", tmp_path / "m1.jsonl"
    with (EtcdCluster(3) if backend == "etcd" else contextlib.nullcontext()) as etcd:
        rdzv = (["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints] if etcd is not None else
                ["--rdzv-endpoint", f"127.0.0.1:{free_port()}"])
        with _agent(sets, 0, rdzv, metrics) as host0, _agent(sets, 1, rdzv, metrics1) as host1:
            host0.wait_for(r"step\s+12/", 180)
            os.killpg(host1.proc.pid, signal.SIGSTOP)
            paused = time.time()
            time.sleep(PAUSE_S)
            before = _files(ckpt)
            continued = time.time()
            os.killpg(host1.proc.pid, signal.SIGCONT)
            res1 = host1.finish(60)
            gone = time.time()
            res0 = host0.finish(240)
    changes = [(r['event'], r.get('epoch'), r.get('lost_ranks'), r.get('resume_step')) for r in res0.records
               if r['event'] in ('recovery', 'join')]
    assert res0.returncode == 0, res0.stderr
    assert res0.steps[-1]["wall_time"] > gone, "the job ended before the paused host found it was left out"
    assert res1.returncode == EXIT_EXCLUDED, f"{changes}\n{res1.stderr}"
    assert gone - continued < 15, gone - continued  # by itself, not at the job's end
    assert res1.stderr.count("It writes nothing and stops") + res1.stderr.count("left out of epoch") == 2, res1.stderr
    # Nothing of ranks 2 and 3 after the pause began: no part, no manifest naming them.
    theirs = [p for p, t in _files(ckpt).items() if t >= paused and any(f"rank_{r}" in p.parts for r in (2, 3))]
    assert not theirs, theirs
    written_while_out = [p for p, t in _files(ckpt).items() if before.get(p) != t and t >= continued
                         and any(f"rank_{r}" in p.parts for r in (2, 3))]
    assert not written_while_out
    assert not metrics1.exists() or metrics1.read_text() == ""
    newest = disk.latest(ckpt)
    assert newest.fence.epoch >= 1 and {r for row in newest.owners for r in row} == {0, 1}, newest
    worlds = [r["world_size"] for r in res0.steps]
    assert worlds[0] == 4 and worlds[-1] == 2, sorted(set(worlds))
    assert res0.summary["epoch"] >= 1
    assert_same_run(res0, run_reference(tmp_path, steps, deterministic=True), steps)
