"""Local launcher: hosts torch's TCPStore, spawns one worker process per rank, and watches them.

For several hosts, run the same worker entry point under ``torchrun`` instead (see README).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch.distributed as dist

from elaswave.config import JobConfig


def _stop(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM every live worker, then SIGKILL what is still there after ``grace_s``."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(cfg: JobConfig, metrics_out: str | None = None, host: str = "127.0.0.1",
           timeout_s: float | None = None) -> int:
    """Run the job to completion; returns the exit code (0 when every rank finished cleanly)."""
    world_size = cfg.world_size
    store = dist.TCPStore(host, 0, world_size=None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=cfg.parallel.timeout_s))
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="elaswave-", delete=False) as fh:
        json.dump(cfg.to_dict(), fh)
        cfg_path = fh.name
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(world_size):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(world_size), ELASWAVE_STORE=f"{host}:{store.port}",
                       OMP_NUM_THREADS="1")
            cmd = [sys.executable, "-m", "elaswave.runtime.worker", "--config", cfg_path]
            if metrics_out and rank == 0:
                cmd += ["--metrics-out", metrics_out]
            procs.append(subprocess.Popen(cmd, env=env))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # Not elastic yet: one dead rank ends the job, and nothing is left running.
                rank, code = failed[0]
                print(f"elaswave: rank {rank} exited with code {code}; stopping the job", file=sys.stderr)
                _stop(procs)
                return code if code > 0 else 1
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                print(f"elaswave: job exceeded {timeout_s}s; stopping it", file=sys.stderr)
                _stop(procs)
                return 124
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(procs)
        return 130
    finally:
        _stop(procs)
        os.unlink(cfg_path)
