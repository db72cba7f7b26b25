"""The one way tests start real ranks: the real CLI in its own session, every wait bounded, and
the whole process group killed afterwards so no worker can outlive its test."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from elaswave.runtime.metrics import read_jsonl

# A tiny job: quick on 2 cores, still deep enough for pp=4.
TINY = ["model.d_model=32", "model.num_heads=2", "model.seq_len=32", "model.num_blocks=4",
        "train.micro_batch_size=2", "data.max_corpus_bytes=200000"]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    records: list[dict]

    @property
    def steps(self) -> list[dict]:
        return [r for r in self.records if r["event"] == "step"]

    @property
    def summary(self) -> dict:
        return next(r for r in self.records if r["event"] == "summary")

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.steps]


def _run(cmd: list[str], timeout_s: float) -> tuple[int, str, str]:
    """Run ``cmd`` in its own session; on return (or timeout) kill whatever it left behind."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} did not finish in {timeout_s}s\n{out}\n{err}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # any worker the launcher failed to reap
        except ProcessLookupError:
            pass
    return proc.returncode, out, err


def run_cli(args: list[str], tmp_path: Path, timeout_s: float = 240.0, metrics: Path | None = None) -> Result:
    """Run ``elaswave ARGS`` with ``--metrics-out`` (a new file in ``tmp_path`` unless ``metrics``
    names one); kill everything it started."""
    metrics = metrics or tmp_path / f"metrics-{len(list(tmp_path.iterdir()))}.jsonl"
    cmd = [sys.executable, "-m", "elaswave.cli", *args]
    if args and args[0] in ("run", "reference"):
        cmd += ["--metrics-out", str(metrics)]
    code, out, err = _run(cmd, timeout_s)
    records = read_jsonl(str(metrics)) if metrics.exists() else []
    return Result(code, out, err, records)


def run_torchrun(torchrun_args: list[str], sets: list[str], metrics: Path, timeout_s: float = 300.0) -> Result:
    """The worker under real torchrun (``python -m torch.distributed.run TORCHRUN_ARGS -m
    elaswave.runtime.worker --set ...``); kill everything it started."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args, "-m", "elaswave.runtime.worker",
           "--metrics-out", str(metrics)] + [x for s in sets for x in ("--set", s)]
    code, out, err = _run(cmd, timeout_s)
    return Result(code, out, err, read_jsonl(str(metrics)) if metrics.exists() else [])


def run_job(tmp_path: Path, dp: int, pp: int, steps: int, deterministic: bool, extra: list[str] = ()) -> Result:
    sets = [*TINY, f"parallel.dp={dp}", f"parallel.pp={pp}", f"train.steps={steps}",
            f"train.num_micro_batches={max(4, dp)}", *extra]
    args = ["run"] + [x for s in sets for x in ("--set", s)] + (["--deterministic"] if deterministic else [])
    res = run_cli(args, tmp_path)
    assert res.returncode == 0, f"dp={dp} pp={pp} failed:\n{res.stdout}\n{res.stderr}"
    return res


def run_reference(tmp_path: Path, steps: int, deterministic: bool, num_micro_batches: int = 4,
                  extra: list[str] = ()) -> Result:
    sets = [*TINY, f"train.steps={steps}", f"train.num_micro_batches={num_micro_batches}", *extra]
    args = ["reference"] + [x for s in sets for x in ("--set", s)] + (["--deterministic"] if deterministic else [])
    res = run_cli(args, tmp_path)
    assert res.returncode == 0, f"reference failed:\n{res.stdout}\n{res.stderr}"
    return res


def children(pid: int) -> list[int]:
    """PIDs whose parent is ``pid`` (from /proc; Linux only)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
