"""Local launcher: hosts torch's TCPStore, spawns one worker process per rank, and watches them.

Elastic jobs: a worker that dies is reported to the control plane at once (``ew/dead/<rank>`` and
an alert), which is how the survivors learn of a SIGKILL in milliseconds instead of waiting for a
collective to time out; the survivors go on. The job is over when every worker has exited, or
when the job has stamped ``done`` and the rest are hung or left out (they are then killed).
Non-elastic jobs stop every worker when one fails. For several hosts, run the same worker entry
point under ``torchrun`` instead (see README).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from elaswave.config import JobConfig
from elaswave.control.membership import PREFIX, Membership


def _stop(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM every live worker, then SIGKILL what is still there after ``grace_s``."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            p.send_signal(signal.SIGCONT)  # a stopped process only acts on SIGTERM once continued
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class _Terminated(Exception):
    """The launcher was asked to stop (SIGTERM/SIGHUP): its workers are stopped with it."""


def _on_terminate(signum, frame) -> None:
    raise _Terminated(signum)


def _die_with_parent() -> None:
    """In the worker, before exec: SIGKILL it when the launcher dies, however the launcher dies
    (Linux prctl PR_SET_PDEATHSIG; elsewhere the worker notices when the store goes away)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def launch(cfg: JobConfig, metrics_out: str | None = None, host: str = "127.0.0.1",
           timeout_s: float | None = None, done_grace_s: float = 10.0) -> int:
    """Run the job to completion; returns the exit code (0 when the training finished)."""
    world_size = cfg.world_size
    store = dist.TCPStore(host, 0, world_size=None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=cfg.parallel.timeout_s))
    membership = Membership(store, -1)
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="elaswave-", delete=False) as fh:
        json.dump(cfg.to_dict(), fh)
        cfg_path = fh.name
    procs: list[subprocess.Popen] = []
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {sig: signal.signal(sig, _on_terminate) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        for rank in range(world_size):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(world_size), ELASWAVE_STORE=f"{host}:{store.port}",
                       OMP_NUM_THREADS="1")
            # The watchers' store waits time out every heartbeat interval by design; keep c10d quiet.
            env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
            cmd = [sys.executable, "-m", "elaswave.runtime.worker", "--config", cfg_path]
            if metrics_out:  # any rank may become the writer when rank 0 is gone
                cmd += ["--metrics-out", metrics_out]
            procs.append(subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent))
        return _watch(cfg, procs, store, membership, timeout_s, done_grace_s)
    except KeyboardInterrupt:
        _stop(procs)
        return 130
    except _Terminated as exc:
        _stop(procs)
        return 128 + exc.args[0]
    finally:
        _stop(procs)
        for sig, old in handlers.items():
            signal.signal(sig, old)
        os.unlink(cfg_path)


def _watch(cfg: JobConfig, procs: list[subprocess.Popen], store: dist.TCPStore, membership: Membership,
           timeout_s: float | None, done_grace_s: float) -> int:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    reported: set[int] = set()
    done_at = None
    while True:
        codes = [p.poll() for p in procs]
        for rank, code in enumerate(codes):
            if code in (None, 0) or rank in reported:
                continue
            reported.add(rank)
            print(f"elaswave: rank {rank} {_describe(code)}", file=sys.stderr, flush=True)
            if not cfg.elastic.enabled:
                _stop(procs)  # not elastic: one dead rank ends the job
                return code if code > 0 else 1
            membership.report_dead(rank, _describe(code))
        if done_at is None and store.check([PREFIX + "done"]):
            done_at = time.monotonic()
        if all(c is not None for c in codes):
            if done_at is not None or all(c == 0 for c in codes):
                return 0
            first = next(c for c in codes if c not in (None, 0))
            return first if first > 0 else 1
        members = _final_members(store, membership, len(procs)) if done_at is not None else ()
        members_exited = done_at is not None and all(codes[r] is not None for r in members)
        if done_at is not None and (members_exited or time.monotonic() - done_at > done_grace_s):
            hung = [r for r, c in enumerate(codes) if c is None]
            print(f"elaswave: training finished; stopping ranks {hung}, which were left out of it",
                  file=sys.stderr, flush=True)
            _stop(procs, grace_s=1.0)
            return 0
        if deadline is not None and time.monotonic() > deadline:
            print(f"elaswave: job exceeded {timeout_s}s; stopping it", file=sys.stderr, flush=True)
            _stop(procs)
            return 124
        time.sleep(0.005)


def _final_members(store: dist.TCPStore, membership: Membership, world_size: int) -> tuple[int, ...]:
    epoch = membership.current_epoch()
    key = f"{PREFIX}ep/{epoch}/members"
    if epoch == 0 or not store.check([key]):
        return tuple(range(world_size))
    return tuple(json.loads(store.get(key)))
