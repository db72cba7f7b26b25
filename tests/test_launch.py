"""With elasticity off, a rank that dies ends the job: promptly, non-zero, nothing left running;
and however the launcher itself ends, its workers end with it."""
import os
import signal
import subprocess
import sys
import time

from tests.helpers.spawn import TINY, alive, children


def _start_long_job(extra=()):
    sets = [*TINY, "train.steps=100000", "parallel.timeout_s=20", *extra]
    cmd = [sys.executable, "-m", "elaswave.cli", "run"] + [x for s in sets for x in ("--set", s)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    line = ""
    while "step" not in line and time.monotonic() < deadline:  # training is under way
        line = proc.stdout.readline()
    return proc


def test_without_elasticity_a_sigkill_ends_the_job_cleanly():
    proc = _start_long_job(["elastic.enabled=false"])
    try:
        workers = children(proc.pid)
        assert len(workers) == 4, workers
        os.kill(workers[2], signal.SIGKILL)
        code = proc.wait(timeout=60)
        assert code != 0
        assert "rank" in proc.stderr.read()
        time.sleep(0.5)
        assert not [w for w in workers if alive(w)], "workers outlived the job"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_workers_end_with_the_launcher_however_it_ends():
    for sig in (signal.SIGTERM, signal.SIGKILL):
        proc = _start_long_job()
        try:
            workers = children(proc.pid)
            assert len(workers) == 4, workers
            os.kill(proc.pid, sig)
            proc.wait(timeout=30)
            deadline = time.monotonic() + 10
            while [w for w in workers if alive(w)] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not [w for w in workers if alive(w)], f"workers outlived a launcher ended by {sig.name}"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
