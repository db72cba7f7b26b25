"""The process holding the control store SIGKILLed: time lost, steps lost, bit-identity.

The README's default job (``elaswave run``: the tiny Llama, dp=2 x pp=2), deterministic, with a
disk checkpoint directory and no periodic checkpoints. At step ``--kill-at`` the ``elaswave run``
process -- which hosts the store -- is SIGKILLed. Its workers notice within the heartbeat timeout,
save the state after the last step they trained and exit; then the same command is run again and
resumes there. Per run:

- *detect*: SIGKILL -> the ranks' links gave up (the ``store_lost`` record's ``noticed_wall``);
- *save*: -> the state was on disk (the record's time); *exit*: -> the last worker was gone;
- *restart*: the new command's start -> the end of its first step (process start, torch import,
  checkpoint load, groups): the cost of any whole-job restart, measured here as the baseline;
- *time lost*: SIGKILL -> the end of the first step after the restart, less that step's own time,
  over the restart alone: how much the floor adds to the restart a job without it would need anyway
  (which would also redo the steps since its last checkpoint);
- *steps lost*: steps recorded before the kill, less the step the rerun resumed at (goal 0);
- *identical*: the final ``params_sha256`` and ``state_sha256`` equal a failure-free run's.

    python bench/store_loss.py --runs 5
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from elaswave.runtime.metrics import read_jsonl  # noqa: E402
from jobs import run_job  # noqa: E402
from tests.helpers.spawn import alive, children, steps_written  # noqa: E402

HERE = Path(__file__).resolve().parent
STEPS = 60
JOB = [f"train.steps={STEPS}", "train.deterministic=true", "parallel.timeout_s=60"]


def _cmd(sets: list[str], metrics: Path) -> list[str]:
    return [sys.executable, "-m", "elaswave.cli", "run", "--metrics-out", str(metrics)] + \
        [x for s in sets for x in ("--set", s)]


def one_run(tmp: Path, kill_at: int) -> dict:
    sets, metrics = JOB + [f"checkpoint.dir={tmp / 'ckpt'}"], tmp / "run.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(_cmd(sets, metrics), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + 300
        while steps_written(metrics) < kill_at and time.monotonic() < deadline:
            time.sleep(0.01)
        workers = children(proc.pid)
        proc.kill()
        killed = time.time()
        proc.wait()
        while [w for w in workers if alive(w)] and time.monotonic() < deadline:
            time.sleep(0.005)
        exited = time.time()
        err = proc.stderr.read()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    before = read_jsonl(str(metrics))
    (lost,) = [r for r in before if r["event"] == "store_lost"] or [None]
    if lost is None:
        raise RuntimeError(f"no store_lost record:\n{err[-3000:]}")
    trained = max(r["step"] for r in before if r["event"] == "step") + 1
    started = time.time()
    records = run_job(sets, metrics)  # the same command again (appends to the same metrics)
    resume = next(r for r in records if r["event"] == "resume")
    first = next(r for r in records if r["event"] == "step" and r["wall_time"] > started)
    restart = first["wall_time"] - started
    summary = records[-1]
    return {"detect_s": lost["noticed_wall"] - killed, "save_s": lost["wall_time"] - lost["noticed_wall"],
            "exit_s": exited - lost["wall_time"], "restart_s": restart,
            "time_lost_s": first["wall_time"] - killed - first["step_time_s"],
            "steps_lost": trained - resume["step"], "resumed_at": resume["step"],
            "step_time_s": statistics.median(r["step_time_s"] for r in before if r["event"] == "step"),
            "params_sha256": summary["params_sha256"], "state_sha256": summary["state_sha256"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--kill-at", type=int, default=12, help="steps written before the SIGKILL")
    ap.add_argument("--out", default=str(HERE / "results" / "store_loss"))
    args = ap.parse_args()
    reference = run_job(JOB)[-1]
    runs = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            r = one_run(Path(tmp), args.kill_at)
        r["identical"] = (r["params_sha256"], r["state_sha256"]) == (reference["params_sha256"], reference["state_sha256"])
        runs.append(r)
        print(f"run {i}: detect {r['detect_s']:.2f} s, save {r['save_s']:.3f} s, exit {r['exit_s']:.2f} s, restart "
              f"{r['restart_s']:.2f} s, time lost {r['time_lost_s']:.2f} s, steps lost {r['steps_lost']}, "
              f"identical {r['identical']}", flush=True)
    keys = ["detect_s", "save_s", "exit_s", "restart_s", "time_lost_s", "step_time_s"]
    med = {k: statistics.median(r[k] for r in runs) for k in keys}
    rng = {k: [min(r[k] for r in runs), max(r[k] for r in runs)] for k in keys}
    ratio = [r["time_lost_s"] / r["restart_s"] for r in runs]
    doc = {"command": f"python bench/store_loss.py --runs {args.runs} --kill-at {args.kill_at}", "job": JOB,
           "runs": runs, "median": med, "range": rng, "time_lost_over_restart": statistics.median(ratio),
           "time_lost_over_restart_range": [min(ratio), max(ratio)],
           "steps_lost": [r["steps_lost"] for r in runs], "identical": sum(r["identical"] for r in runs)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    lines = [f"# The store holder SIGKILLed (`{doc['command']}`)", "",
             "README default job (tiny Llama, dp=2 x pp=2), deterministic, SIGKILL of `elaswave run` "
             f"after {args.kill_at} steps; the same command run again. Medians (range) of {len(runs)} runs.", "",
             "| phase | median s | range s |", "| --- | --- | --- |"]
    lines += [f"| {k[:-2]} | {med[k]:.3f} | {rng[k][0]:.3f}-{rng[k][1]:.3f} |" for k in keys]
    lines += ["", f"time lost / restart alone: {doc['time_lost_over_restart']:.3f} "
                  f"({doc['time_lost_over_restart_range'][0]:.3f}-{doc['time_lost_over_restart_range'][1]:.3f}); "
                  f"steps lost per run: {doc['steps_lost']}; bit-identical to the failure-free run: "
                  f"{doc['identical']} of {len(runs)}"]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
