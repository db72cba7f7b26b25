"""How a one-host launcher ends, and with the exit code docs/cluster.md gives: with elasticity off a
rank that dies ends the job (1), promptly, nothing left running; however the launcher itself ends
(143 on SIGTERM), its workers end with it; past --timeout-s it stops (124)."""
import contextlib
import os
import signal
import subprocess
import sys
import time

from tests.helpers.spawn import TINY, alive, children, run_cli


@contextlib.contextmanager
def _long_job(extra=()):
    """A one-host job under way (its first step printed): (the launcher, its 4 workers); the
    launcher's process group is killed on the way out, whatever the test did."""
    sets = [*TINY, "train.steps=100000", "parallel.timeout_s=20", *extra]
    cmd = [sys.executable, "-m", "elaswave.cli", "run"] + [x for s in sets for x in ("--set", s)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "step" not in line and time.monotonic() < deadline:  # training is under way
            line = proc.stdout.readline()
        workers = children(proc.pid)
        assert len(workers) == 4, workers
        yield proc, workers
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_without_elasticity_a_sigkill_ends_the_job_cleanly():
    with _long_job(["elastic.enabled=false"]) as (proc, workers):
        os.kill(proc.pid, signal.SIGUSR1)  # the launcher shows its threads' stacks and goes on
        time.sleep(1.0)
        assert proc.poll() is None, "SIGUSR1 ended the launcher"
        os.kill(workers[2], signal.SIGKILL)
        code = proc.wait(timeout=60)
        assert code == 1, code  # docs/cluster.md: a failure the job could not absorb
        err = proc.stderr.read()
        assert "rank" in err
        assert "most recent call first" in err, err[-2000:]
        time.sleep(0.5)
        assert not [w for w in workers if alive(w)], "workers outlived the job"


def test_workers_end_with_the_launcher_however_it_ends(tmp_path):
    # SIGKILL takes the store with it: without a failover the workers save their state
    # (tests/runtime/test_rescue.py) and exit within the heartbeat timeout.
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with _long_job([f"checkpoint.dir={tmp_path / sig.name}", "elastic.store_failover=false"]) as (proc, workers):
            os.kill(proc.pid, sig)
            code = proc.wait(timeout=30)
            assert code == (128 + sig if sig == signal.SIGTERM else -sig), code  # docs/cluster.md: 143 on SIGTERM
            deadline = time.monotonic() + 10
            while [w for w in workers if alive(w)] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not [w for w in workers if alive(w)], f"workers outlived a launcher ended by {sig.name}"


def test_a_job_past_its_timeout_stops_with_the_documented_code(tmp_path):
    res = run_cli(["run", *[x for s in [*TINY, "train.steps=100000"] for x in ("--set", s)], "--timeout-s", "6"],
                  tmp_path, timeout_s=60)
    assert res.returncode == 124 and "exceeded 6.0s; stopping it" in res.stderr, (res.returncode, res.stderr[-2000:])
