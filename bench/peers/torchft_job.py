"""The job every claim of ``bench/peers/peers.py`` runs, and TorchFT running it: three replicas
(``bench/peers/torchft_replica.py``) through a lighthouse started in this process, or torch's plain
DDP under torchrun (the no-fault-tolerance run). ``bench/elastic/detection.py`` runs the same.

The job: dp=3 (TorchFT: three replica groups of one process), pp=1, the default GPT with dropout
off, 12 micro-batches of 4 per step, 30 steps. The fault: rank (replica) 2 SIGKILLed in step 12's
backward. A failed TorchFT run raises ``RuntimeError`` whose first line names the replicas' error
(e.g. ``TimeoutError: ... Timeout expired``); the replicas' stderr follows.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository: bench.common
os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse runs in this process; its INFO lines are per quorum
from bench.common import median_step_s, set_flags, step_records, torchrun_argv  # noqa: E402

JOB = ["model.arch=gpt", "parallel.dp=3", "parallel.pp=1", "train.num_micro_batches=12", "train.steps=30", "model.dropout=0"]
REPLICAS, KILL_RANK, KILL_STEP = 3, 2, 12
KILL = f"elastic.inject=kill:rank={KILL_RANK},step={KILL_STEP},phase=backward"
TUNED_HEARTBEAT_MS = 1000
REPLICA = HERE / "torchft_replica.py"


def torchft_run(kill: bool, heartbeat_ms: int | None = None, timeout_s: float = 300, sets: list[str] = (),
                heldout: bool = False, quorum_tick_ms: int = 100) -> dict:
    """Three replicas through a lighthouse on loopback; per step the global loss (the committed
    replicas' token losses over their tokens), replica 0's step time, and the kill's MTTR; with
    ``heldout``, replica 0's held-out loss after each committed step (``heldout[s - 1]``: after ``s``
    steps). ``sets``: items added to ``JOB``."""
    from torch.distributed import TCPStore
    from torchft._torchft import LighthouseServer

    tuned = {"heartbeat_timeout_ms": heartbeat_ms} if heartbeat_ms else {}
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=REPLICAS - 1, join_timeout_ms=60000,
                                  quorum_tick_ms=quorum_tick_ms, **tuned)
    meet = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "replica"
        procs = []
        for r in range(REPLICAS):
            cmd = [sys.executable, str(REPLICA), "--replica", str(r), "--replicas", str(REPLICAS),
                   "--lighthouse", lighthouse.address(), "--ready", f"127.0.0.1:{meet.port}", "--out", str(prefix)]
            cmd += set_flags([*JOB, *sets]) + (["--heldout"] if heldout else [])
            if kill and r == KILL_RANK:
                cmd += ["--kill-at-step", str(KILL_STEP)]
            procs.append(subprocess.Popen(cmd, env=_env(), start_new_session=True, stdout=subprocess.DEVNULL,
                                          stderr=open(Path(tmp) / f"err{r}", "w")))
        try:
            deadline = time.monotonic() + timeout_s
            while meet.add("ready", 0) < REPLICAS:  # release them together: one first quorum of all
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError(_failure("TorchFT replicas did not start", tmp))
                time.sleep(0.05)
            meet.set("go", "1")
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(_failure(f"TorchFT did not finish in {timeout_s}s", tmp)) from None
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait()
            lighthouse.shutdown()
        survivors = [r for r in range(REPLICAS) if not (kill and r == KILL_RANK)]
        if any(procs[r].returncode != 0 for r in survivors):
            raise RuntimeError(_failure("a TorchFT replica failed", tmp))
        records = {r: [json.loads(x) for x in Path(f"{prefix}.{r}.jsonl").read_text().splitlines()]
                   for r in range(REPLICAS) if Path(f"{prefix}.{r}.jsonl").exists()}
    by_step: dict[int, list[dict]] = {}
    for recs in records.values():
        for rec in step_records(recs):
            by_step.setdefault(rec["step"], []).append(rec)
    losses = [sum(r["loss_sum"] for r in by_step[s]) / sum(r["tokens"] for r in by_step[s]) for s in sorted(by_step)]
    out = {"losses": losses, "step_s": median_step_s(records[0], 5),
           "participants": [len(by_step[s]) for s in sorted(by_step)]}
    if heldout:
        out["heldout"] = [r["heldout_loss"] for r in step_records(records[0])]
    if kill:
        killed = next(r for r in records[KILL_RANK] if r["event"] == "kill")
        out["mttr_s"] = max(r["wall_time"] for r in by_step[KILL_STEP]) - killed["wall_time"]
    return out


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")


def _failure(what: str, tmp: str) -> str:
    """``what: CAUSE`` (the last line of the replicas' stderr that names an error), then their stderr."""
    text = "\n".join(p.read_text()[-2000:] for p in sorted(Path(tmp).glob("err*")))
    named = [ln.strip() for ln in text.splitlines() if "Error" in ln or "Exception" in ln]
    return f"{what}: {named[-1][:300] if named else 'no error named in their stderr'}\n{text}"


def plain_ddp_step_s() -> float:
    """torch's DDP under torchrun, the same loop without fault tolerance: replica 0's median step."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = torchrun_argv(REPLICAS, str(REPLICA), "--plain", "--out", f"{tmp}/plain") + set_flags(JOB)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, start_new_session=True, env=_env())
        if proc.returncode != 0:
            raise RuntimeError(f"plain DDP failed:\n{proc.stderr[-3000:]}")
        recs = [json.loads(x) for x in Path(f"{tmp}/plain.0.jsonl").read_text().splitlines()]
    return median_step_s(recs, 5)
