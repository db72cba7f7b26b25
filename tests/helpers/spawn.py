"""The one way tests start real ranks: the real CLI in its own session, every wait bounded, and
the whole process group killed afterwards so no worker can outlive its test."""
from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from elaswave.forkserver import SERVER_NAME
from elaswave.runtime.metrics import read_jsonl

# A tiny job: quick on 2 cores, still deep enough for pp=4. Straggler re-plans are off: ranks on
# an oversubscribed 2-core box measure noisy speeds, and tests that count epochs must not see them
# (tests/runtime/test_hard_cases.py turns them on for its straggler).
TINY = ["model.d_model=32", "model.num_heads=2", "model.seq_len=32", "model.num_blocks=4",
        "train.micro_batch_size=2", "data.max_corpus_bytes=200000", "elastic.straggler_gain=0"]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    records: list[dict]
    left_behind: int = 0
    """Processes of the command's session still alive when it exited (the helper kills them)."""

    @property
    def steps(self) -> list[dict]:
        return [r for r in self.records if r["event"] == "step"]

    @property
    def summary(self) -> dict:
        return next(r for r in self.records if r["event"] == "summary")

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.steps]


def kill_session(pid: int) -> None:
    """SIGKILL every process of the session ``pid`` leads (gone already: nothing to do)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class _CliServer:
    """The session's :mod:`tests.helpers.cli_server`: ``elaswave ARGS`` forked from one process
    that imported elaswave once (``ELASWAVE_TEST_FORK_CLI=0``: every command a new process)."""
    proc: subprocess.Popen | None = None
    lock = threading.Lock()

    @classmethod
    def run(cls, args: list[str], timeout_s: float, env: dict) -> tuple[int, str, str, int] | None:
        if os.environ.get("ELASWAVE_TEST_FORK_CLI") == "0":
            return None
        with cls.lock:
            if cls.proc is None or cls.proc.poll() is not None:
                cls.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.cli_server"], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
            # (Not in the test's own folder: tests look at what a command left there.)
            stem = Path(tempfile.gettempdir()) / f"elaswave-test-cli-{os.getpid()}-{time.monotonic_ns()}"
            out_path, err_path = stem.with_suffix(".out"), stem.with_suffix(".err")
            cls.proc.stdin.write(json.dumps({"argv": args, "env": env, "cwd": os.getcwd(), "out": str(out_path),
                                             "err": str(err_path)}) + "\n")
            cls.proc.stdin.flush()
            pid = json.loads(cls.proc.stdout.readline())["pid"]
            replies: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=lambda: replies.put(cls.proc.stdout.readline()), daemon=True).start()
            try:
                code = json.loads(replies.get(timeout=timeout_s))["code"]
            except queue.Empty:
                kill_session(pid)
                replies.get(timeout=30)
                out, err = _read_and_remove(out_path), _read_and_remove(err_path)
                raise AssertionError(f"elaswave {' '.join(args)} did not finish in {timeout_s}s\n{out}\n{err}") from None
            left = len([p for p in session_members(pid) if p != pid])
            kill_session(pid)  # any worker the launcher failed to reap
            return code, _read_and_remove(out_path), _read_and_remove(err_path), left


def _read_and_remove(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    finally:
        path.unlink(missing_ok=True)


def _run(cmd: list[str], timeout_s: float, env: dict | None = None, forkable: bool = False) -> tuple[int, str, str, int]:
    """Run ``cmd`` in its own session; on return (or timeout) kill whatever it left behind.
    ``forkable``: ``cmd`` is ``python -m elaswave.cli ARGS``, which the session's CLI server may
    fork instead of starting a new interpreter."""
    if forkable:
        done = _CliServer.run(cmd[3:], timeout_s, dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
        if done is not None:
            return done
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} did not finish in {timeout_s}s\n{out}\n{err}")
    else:
        left = len([p for p in session_members(proc.pid) if p != proc.pid])
    finally:
        kill_session(proc.pid)  # any worker the launcher failed to reap
    return proc.returncode, out, err, left


def run_group(target: str, size: int, tmp_path: Path, timeout_s: float = 120.0, **args) -> list:
    """``size`` real processes in one gloo group, each running ``target`` (``module:function``, called
    with its :class:`~elaswave.comm.groups.Group` and ``args``); what each returned, in rank order.
    Every process is in its own session and killed afterwards, whatever happened."""
    import json
    import torch
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.helpers.group_rank", target, str(r), str(size), str(port),
                               str(tmp_path / f"rank{r}.pt"), json.dumps(args)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1")) for r in range(size)]
    deadline, failed = time.monotonic() + timeout_s, []
    try:
        for r, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"rank {r} of {target} did not finish in {timeout_s}s") from None
            if proc.returncode:
                failed.append(f"rank {r} exited {proc.returncode}:\n{err[-3000:]}")
    finally:
        for proc in procs:
            kill_session(proc.pid)
    assert not failed, "\n".join(failed)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(size)]


def _next_metrics(tmp_path: Path) -> Path:
    """A new metrics file's name in ``tmp_path`` (``metrics-N.jsonl``)."""
    return tmp_path / f"metrics-{len(list(tmp_path.iterdir()))}.jsonl"


def run_cli(args: list[str], tmp_path: Path, timeout_s: float = 240.0, metrics: Path | None = None,
            env: dict | None = None) -> Result:
    """Run ``elaswave ARGS`` with ``--metrics-out`` (a new file in ``tmp_path`` unless ``metrics``
    names one); kill everything it started."""
    metrics = metrics or _next_metrics(tmp_path)
    cmd = [sys.executable, "-m", "elaswave.cli", *args]
    if args and args[0] in ("run", "reference"):
        cmd += ["--metrics-out", str(metrics)]
    began = time.monotonic()
    code, out, err, left = _run(cmd, timeout_s, env, forkable=True)
    records = read_jsonl(str(metrics)) if metrics.exists() else []
    if (took := time.monotonic() - began) > SLOW_RUN_S:
        _warn_slow(args, took, out, err, records)
    return Result(code, out, err, records, left)


SLOW_RUN_S = 60.0
"""A tiny job's run takes seconds, the slowest (partitions, a store's move) about 40: a run past
this waited out something (a timeout nobody should reach), even when it then passed."""


class SlowRun(UserWarning):
    pass


def _warn_slow(args: list[str], took: float, out: str, err: str, records: list[dict]) -> None:
    """Leaves a passing but slow run's evidence in the session's warnings summary: its last lines
    and each recovery's phases (the CI log of a green run is all there is to read afterwards)."""
    phases = [{k: r.get(k) for k in ("epoch", "mttr_s", "phases_s")} for r in records if r.get("event") == "recovery"]
    steps = [r for r in records if r.get("event") == "step"]
    slowest = max(steps, key=lambda r: r.get("step_time_s") or 0.0, default={})
    tail = lambda text: " | ".join(text.strip().splitlines()[-8:])  # noqa: E731
    warnings.warn(SlowRun(f"elaswave {' '.join(args)} took {took:.0f} s (> {SLOW_RUN_S:g}); recoveries {phases}; slowest step "
                          f"{ {k: slowest.get(k) for k in ('step', 'step_time_s', 'phases_s')} }; "
                          f"stdout ... {tail(out)}; stderr ... {tail(err)}"), stacklevel=3)


class Running:
    """``elaswave ARGS`` started in the background in its own session, for tests that act on a job
    while it trains; leaving the ``with`` block kills whatever it started."""

    def __init__(self, args: list[str], metrics: Path, env: dict | None = None, prefix: list[str] = ()):
        """``prefix``: what runs the command (e.g. ``ip netns exec NAME``: on another "host")."""
        self.metrics = metrics
        cmd = [*prefix, sys.executable, "-m", "elaswave.cli", *args, "--metrics-out", str(metrics)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True,
                                     env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
        self.lines: queue.SimpleQueue = queue.SimpleQueue()
        self.stdout: list[str] = []
        self._stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        # Drained as it comes: a long run's stderr would fill the pipe and block the job.
        self._stderr_done = threading.Thread(target=lambda: self._stderr.extend(self.proc.stderr), daemon=True)
        self._stderr_done.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        """The first stdout line matching ``pattern`` (AssertionError after ``timeout_s``)."""
        while True:
            try:
                line = self.lines.get(timeout=timeout_s)
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} within {timeout_s}s: {self.stdout}") from None
            self.stdout.append(line)
            found = re.search(pattern, line)
            if found:
                return found

    def finish(self, timeout_s: float) -> Result:
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            # What it was doing: a hang under load is seldom reproduced at will.
            tail = "".join(self._stderr[-60:])
            raise AssertionError(f"the job did not finish in {timeout_s}s; its stderr ended:\n{tail}") from None
        self._stderr_done.join(timeout=10)
        err = "".join(self._stderr)
        while not self.lines.empty():
            self.stdout.append(self.lines.get())
        return Result(code, "".join(self.stdout), err, read_jsonl(str(self.metrics)) if self.metrics.exists() else [])

    def __enter__(self) -> "Running":
        return self

    def __exit__(self, *exc) -> None:
        kill_session(self.proc.pid)
        self.proc.wait()
        # Kept beside the metrics (pytest keeps the last runs' folders): a failure under load is
        # seldom reproduced at will, and its records alone do not say what each process saw.
        self._stderr_done.join(timeout=5)
        (self.metrics.parent / f"{self.metrics.stem}.{self.proc.pid}.stderr").write_text("".join(self._stderr))


def fault_mid_run(agents: list["Running"], at_step: int, fault, timeout_s: float = 240) -> tuple[float, list[Result]]:
    """Once the first agent has written step ``at_step``: ``fault()``, then every agent's result (in
    order); each is killed afterwards whatever happened. Returns the fault's wall time too."""
    try:
        agents[0].wait_for(rf"step\s+{at_step}/", timeout_s)
        wall = time.time()
        fault()
        return wall, [a.finish(timeout_s) for a in agents]
    finally:
        for a in agents:
            a.__exit__()


def run_torchrun(torchrun_args: list[str], sets: list[str], metrics: Path, timeout_s: float = 300.0) -> Result:
    """The worker under real torchrun (``python -m torch.distributed.run TORCHRUN_ARGS -m
    elaswave.runtime.worker --set ...``); kill everything it started."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args, "-m", "elaswave.runtime.worker",
           "--metrics-out", str(metrics)] + [x for s in sets for x in ("--set", s)]
    code, out, err, left = _run(cmd, timeout_s)
    return Result(code, out, err, read_jsonl(str(metrics)) if metrics.exists() else [], left)


class TorchrunNode:
    """One host of a multi-host job: a real torchrun agent (c10d rendezvous on loopback) with its
    workers. :meth:`kill` is the host's loss: the agent and its workers -- torchrun starts each in
    a session of its own -- SIGKILLed together. Leaving the ``with`` block kills what is left."""

    def __init__(self, nnodes: int, nproc: int, endpoint: str, is_host: bool, sets: list[str], metrics: Path,
                 log: Path):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=elaswave-test",
               f"--rdzv-conf=is_host={str(is_host).lower()}", "--max-restarts=0",
               "-m", "elaswave.runtime.worker", "--metrics-out", str(metrics)] + [x for s in sets for x in ("--set", s)]
        self.log = log
        with open(log, "w") as fh:
            self.proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=dict(os.environ, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR"))

    def workers(self) -> list[int]:
        return children(self.proc.pid)

    def kill(self) -> None:
        for pid in [self.proc.pid, *self.workers()]:
            kill_session(pid)  # each is its session's leader
        self.proc.wait()

    def __enter__(self) -> "TorchrunNode":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


def job_args(dp: int, pp: int, steps: int, deterministic: bool, extra: list[str] = ()) -> list[str]:
    """``run`` and its options for a tiny job (``extra``: more --set items)."""
    sets = [*TINY, f"parallel.dp={dp}", f"parallel.pp={pp}", f"train.steps={steps}",
            f"train.num_micro_batches={max(4, dp)}", *extra]
    return ["run"] + [x for s in sets for x in ("--set", s)] + (["--deterministic"] if deterministic else [])


def run_job(tmp_path: Path, dp: int, pp: int, steps: int, deterministic: bool, extra: list[str] = (),
            cli: list[str] = (), env: dict | None = None) -> Result:
    """``cli``: more command-line options (e.g. --respawn-after 1)."""
    res = run_cli(job_args(dp, pp, steps, deterministic, extra) + list(cli), tmp_path, env=env)
    assert res.returncode == 0, f"dp={dp} pp={pp} failed:\n{res.stdout}\n{res.stderr}"
    return res


def slowed(ranks: int, factor: float = 3) -> str:
    """``elastic.inject`` faults that make ranks 0..ranks-1 compute ``factor`` times as long (a
    sleep: the same bits). A job that must outlast a pause or a start-up lasts as long in fewer
    steps, and the reference it is compared with, which is not slowed, trains only those."""
    return ";".join(f"slow:rank={r},step=0,factor={factor:g}" for r in range(ranks))


_REFERENCES: dict[tuple, tuple[Result, Path]] = {}
"""The session's references by their arguments, with their metrics files: several tests compare
with the same failure-free job (a 220-step reference is ~10 s of one core here), and it is
deterministic."""


def run_reference(tmp_path: Path, steps: int, deterministic: bool, num_micro_batches: int = 4,
                  extra: list[str] = ()) -> Result:
    """The single-process reference run of the TINY job, its metrics file in ``tmp_path`` as
    :func:`run_cli` names it; trained once per session for each set of arguments (a path in
    ``extra`` makes its own key)."""
    key = (steps, deterministic, num_micro_batches, tuple(extra))
    metrics = _next_metrics(tmp_path)
    if key in _REFERENCES and _REFERENCES[key][1].exists():
        res, trained = _REFERENCES[key]
        shutil.copyfile(trained, metrics)
        return res
    sets = [*TINY, f"train.steps={steps}", f"train.num_micro_batches={num_micro_batches}", *extra]
    args = ["reference"] + [x for s in sets for x in ("--set", s)] + (["--deterministic"] if deterministic else [])
    res = run_cli(args, tmp_path, metrics=metrics)
    assert res.returncode == 0, f"reference failed:\n{res.stdout}\n{res.stderr}"
    _REFERENCES[key] = res, metrics
    return res


def procs_where(field: int, value: int) -> list[int]:
    """Live PIDs whose /proc stat field ``field`` (after the name) equals ``value`` (Linux only)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[field]) == value and fields[0] != "Z":
                out.append(int(entry))
    return out


def reference_fixture(steps: int, num_micro_batches: int):
    """A module-scoped ``reference`` fixture: the deterministic failure-free run of the module's job,
    trained once for all its tests (``reference = reference_fixture(STEPS, MBS)``)."""
    @pytest.fixture(scope="module")
    def reference(tmp_path_factory):
        return run_reference(tmp_path_factory.mktemp("ref"), steps, deterministic=True,
                             num_micro_batches=num_micro_batches)
    return reference


def assert_same_run(res: Result, reference: Result, steps: int) -> None:
    """Every step written once, and the losses, final parameters and optimizer state (masters, both
    Adam moments, the step counter) of the failure-free reference."""
    assert [r["step"] for r in res.steps] == list(range(steps)), "a step was lost or counted twice"
    assert res.losses == reference.losses
    assert res.summary["params_sha256"] == reference.summary["params_sha256"]
    assert res.summary["state_sha256"] == reference.summary["state_sha256"], "the optimizer state differs"


def free_port() -> int:
    """A TCP port nobody listens on now (for a store endpoint a test hands out)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_of(pid: int) -> int | None:
    """The RANK of a live, running worker process; None if it has none, is dead, or is stopped.
    A worker forked by the launcher's fork server is named ``ew-rank-N`` (its environ file is
    the server's); one started as a new process (torchrun's) has RANK in its environment."""
    try:
        with open(f"/proc/{pid}/comm") as fh:
            named = re.fullmatch(r"ew-rank-(\d+)", fh.read().strip())
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = dict(item.split(b"=", 1) for item in fh.read().split(b"\0") if b"=" in item)
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
    if state in ("Z", "T", "t"):  # dead already, or stopped (by a test's SIGSTOP)
        return None
    if named:
        return int(named.group(1))
    return int(env[b"RANK"]) if b"RANK" in env else None


def steps_written(metrics: Path) -> int:
    """Step records in a run's metrics file so far."""
    try:
        return metrics.read_text().count('"event": "step"')
    except OSError:
        return 0


def children(pid: int) -> list[int]:
    """PIDs whose parent is ``pid`` (a launcher's fork server aside: it is none of its workers)."""
    return [p for p in procs_where(1, pid) if comm(p) != SERVER_NAME]


def comm(pid: int) -> str:
    """A process's name (``/proc/PID/comm``); empty once it is gone."""
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def session_members(sid: int) -> list[int]:
    """PIDs in session ``sid`` (a command started with ``start_new_session`` has sid = its pid)."""
    return procs_where(3, sid)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def sigkill_launcher(job: Running, after_steps: int, workers: int = 4) -> tuple[list[int], float, int]:
    """Once ``after_steps`` steps are written, SIGKILL the `elaswave run` of ``job`` (it hosts the
    store; its ``workers`` outlive it). Returns the workers' PIDs, the kill's wall time and the
    steps written by then."""
    deadline = time.monotonic() + 180
    while steps_written(job.metrics) < after_steps and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = children(job.proc.pid)
    assert len(pids) == workers and steps_written(job.metrics) >= after_steps, (pids, job.stdout)
    os.kill(job.proc.pid, signal.SIGKILL)
    return pids, time.time(), steps_written(job.metrics)


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Waits (bounded) for ``pids`` to exit; returns those still alive."""
    deadline = time.monotonic() + timeout_s
    while [p for p in pids if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def freeze_rank(job: "Running", rank: int) -> float:
    """SIGSTOP ``rank``'s worker of ``job`` from outside (nothing stamps it); returns the wall time."""
    victim = next(p for p in children(job.proc.pid) if rank_of(p) == rank)
    stopped = time.time()
    os.kill(victim, signal.SIGSTOP)
    return stopped
