"""The launcher's workers are forked from its fork server: real processes, its own children, named
by rank, signalled and reaped as before -- and the same bits as workers started as new processes."""
import os
import signal

from elaswave.forkserver import DISABLE_ENV, SERVER_NAME
from tests.helpers.spawn import Running, comm, job_args, procs_where, rank_of, run_cli


def test_workers_are_the_launchers_children_named_by_rank_and_a_sigkill_is_reported(tmp_path):
    with Running(job_args(2, 1, 100, False), tmp_path / "run.jsonl") as job:
        job.wait_for(r"step\s+2/", 120)
        kids = procs_where(1, job.proc.pid)  # the fork server too
        assert sorted(comm(p) for p in kids) == [SERVER_NAME, "ew-rank-0", "ew-rank-1"], kids
        victim = next(p for p in kids if rank_of(p) == 1)
        os.kill(victim, signal.SIGKILL)
        res = job.finish(120)
    assert res.returncode == 0, res.stderr
    assert "rank 1 was killed by SIGKILL" in res.stderr, res.stderr  # its exit status, read by the launcher
    assert res.summary["ranks"] == [0]


def test_forked_workers_train_the_same_bits_as_new_processes(tmp_path):
    args = job_args(2, 2, 6, True)
    forked = run_cli(args, tmp_path)
    started = run_cli(args, tmp_path, env={DISABLE_ENV: "0"})
    assert forked.returncode == 0 and started.returncode == 0, started.stderr
    assert forked.losses == started.losses
    assert forked.summary["params_sha256"] == started.summary["params_sha256"]
    assert forked.summary["state_sha256"] == started.summary["state_sha256"]
