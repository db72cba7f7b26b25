"""The process holding the control store SIGKILLed: time lost, steps lost, bit-identity.

The README's default job (``elaswave run``: the tiny Llama, dp=2 x pp=2), deterministic, with a
disk checkpoint directory and no periodic checkpoints. At step ``--kill-at`` the ``elaswave run``
process -- which hosts the store -- is SIGKILLed. Two designs, in the same bench run:

*failover* (``elastic.store_failover``, the default): the workers notice within the heartbeat
timeout and move the store to rank 0's standby at the end of one step; the job trains on.

- *detect*: SIGKILL -> the ranks' links gave up (the ``store_moved`` record's ``noticed_wall``);
- *move*: the move itself (new store seeded, ports registered, a barrier);
- *time lost*: SIGKILL -> the end of the first step after the move, less the median step time for
  each step trained in between (those steps were not lost: only the stall was);

*floor* (failover off): the workers save the state after the last step they trained and exit;
then the same command is run again and resumes there.

- *detect*: SIGKILL -> the ranks' links gave up (the ``store_lost`` record's ``noticed_wall``);
- *save*: -> the state was on disk (the record's time); *exit*: -> the last worker was gone;
- *restart*: the new command's start -> the end of its first step (process start, torch import,
  checkpoint load, groups): the cost of any whole-job restart, measured here as the baseline;
- *time lost*: SIGKILL -> the end of the first step after the restart, less that step's own time.

*host* (failover, two agents on loopback, a pipeline per host): node 0's whole host -- its agent,
which holds the store, and ranks 0 and 1 -- is SIGKILLed at once; host 1's ranks find the store
gone in their recovery, move it to rank 2's standby and recover there. Beside it, in the same
bench run, *host_workers*: only node 0's two workers are SIGKILLed (the store lives): the same
loss without the store's. Each: the fault -> the end of the first step on the two ranks left, less
that step's own time, and the recovery record's ``store`` phase (the links' grace and the move).

The first two: time lost over the restart alone (how it compares with the restart a job without either
would need anyway, which would also redo the steps since its last checkpoint); *steps lost* (goal 0);
*identical*: the final ``params_sha256`` and ``state_sha256`` equal a failure-free run's.

    python bench/faults/store_loss.py --runs 5
"""
from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common, tests.helpers
from bench.common import bench_args, cli_argv, run_job, write_results  # noqa: E402
from elaswave.runtime.metrics import read_jsonl  # noqa: E402
from tests.helpers.spawn import alive, children, free_port, kill_session, steps_written  # noqa: E402

STEPS = 60
JOB = [f"train.steps={STEPS}", "train.deterministic=true", "parallel.timeout_s=60"]


def one_run(tmp: Path, kill_at: int, failover: bool) -> dict:
    sets = JOB + [f"checkpoint.dir={tmp / 'ckpt'}", f"elastic.store_failover={str(failover).lower()}"]
    metrics = tmp / "run.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cli_argv("run", sets, metrics), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
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
    if failover:
        return _moved(before, killed, err)
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


def host_run(tmp: Path, kill_at: int, whole: bool) -> dict:
    """Two agents; SIGKILL node 0's whole host (``whole``) or only its workers."""
    sets, metrics = JOB + ["elastic.respawn_after_s=-1"], tmp / "run.jsonl"
    endpoint = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", ELASWAVE_TOKEN="bench", TORCH_CPP_LOG_LEVEL="ERROR")
    agents = [subprocess.Popen(cli_argv("run", sets, metrics) + ["--nnodes", "2", "--node-rank", str(k), "--rdzv-endpoint", endpoint],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                               env=env) for k in (0, 1)]
    try:
        deadline = time.monotonic() + 300
        while steps_written(metrics) < kill_at and time.monotonic() < deadline:
            time.sleep(0.01)
        if whole:
            os.killpg(agents[0].pid, signal.SIGKILL)
        else:
            for pid in children(agents[0].pid):
                os.kill(pid, signal.SIGKILL)
        killed = time.time()
        agents[1].wait(timeout=300)
        err = agents[1].stderr.read()
    finally:
        for a in agents:
            kill_session(a.pid)
    records = read_jsonl(str(metrics))
    recovery = next((r for r in records if r["event"] == "recovery"), None)
    summary = next((r for r in records if r["event"] == "summary"), None)
    if recovery is None or summary is None:
        raise RuntimeError(f"no recovery or summary record:\n{err[-3000:]}")
    steps = [r for r in records if r["event"] == "step"]
    first = next((r for r in steps if r["world_size"] == 2), None)
    if first is None:
        raise RuntimeError(f"no step on two ranks: {recovery}\n{err[-3000:]}")
    return {"fault_to_first_step_s": first["wall_time"] - killed, "time_lost_s": first["wall_time"] - killed - first["step_time_s"],
            "store_s": recovery["phases_s"].get("store", 0.0), "lost_ranks": recovery["lost_ranks"],
            "is_fallback": recovery["is_fallback"], "steps_lost": STEPS - len({r["step"] for r in steps}),
            "params_sha256": summary["params_sha256"], "state_sha256": summary["state_sha256"]}


def _moved(records: list[dict], killed: float, err: str) -> dict:
    """A failover run's figures, from its one metrics file."""
    (moved,) = [r for r in records if r["event"] == "store_moved"] or [None]
    summary = next((r for r in records if r["event"] == "summary"), None)
    if moved is None or summary is None:
        raise RuntimeError(f"no store_moved or summary record:\n{err[-3000:]}")
    steps = [r for r in records if r["event"] == "step"]
    step_time = statistics.median(r["step_time_s"] for r in steps)
    first = next(r for r in steps if r["step"] == moved["step"])
    between = [r for r in steps if killed < r["wall_time"] <= first["wall_time"]]
    return {"detect_s": moved["noticed_wall"] - killed, "move_s": moved["move_s"],
            "time_lost_s": first["wall_time"] - killed - len(between) * step_time,
            "steps_lost": STEPS - len({r["step"] for r in steps}), "steps_repeated": len(steps) - len({r["step"] for r in steps}),
            "step_time_s": step_time, "params_sha256": summary["params_sha256"], "state_sha256": summary["state_sha256"]}


def _table(runs: list[dict], keys: list[str]) -> list[str]:
    med = {k: statistics.median(r[k] for r in runs) for k in keys}
    lines = ["| phase | median s | range s |", "| --- | --- | --- |"]
    return lines + [f"| {k[:-2]} | {med[k]:.3f} | {min(r[k] for r in runs):.3f}-{max(r[k] for r in runs):.3f} |"
                    for k in keys]


def main() -> None:
    ap = bench_args(__doc__, out="store_loss", runs=5)
    ap.add_argument("--kill-at", type=int, default=12, help="steps written before the SIGKILL")
    args = ap.parse_args()
    reference = run_job(JOB)[-1]
    runs: dict[str, list[dict]] = {"failover": [], "floor": [], "host": [], "host_workers": []}
    failed: dict[str, list[str]] = {}
    for i in range(args.runs):
        for mode, found in runs.items():
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    r = (host_run(Path(tmp), args.kill_at, mode == "host") if mode.startswith("host") else
                         one_run(Path(tmp), args.kill_at, mode == "failover"))
                except RuntimeError as exc:  # counted and shown, not hidden: the table says how many
                    failed.setdefault(mode, []).append(str(exc)[:2000])
                    print(f"run {i} {mode}: FAILED {str(exc)[:300]}", flush=True)
                    continue
            r["identical"] = (r["params_sha256"], r["state_sha256"]) == (reference["params_sha256"],
                                                                         reference["state_sha256"])
            found.append(r)
            print(f"run {i} {mode}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                  for k, v in r.items() if not k.endswith("sha256")), flush=True)
    restart = statistics.median(r["restart_s"] for r in runs["floor"])
    doc = {"command": f"python bench/faults/store_loss.py --runs {args.runs} --kill-at {args.kill_at}", "job": JOB,
           "restart_s": restart}
    lines = [f"# The store holder SIGKILLed (`{doc['command']}`)", "",
             "README default job (tiny Llama, dp=2 x pp=2), deterministic, SIGKILL of `elaswave run` "
             f"after {args.kill_at} steps. Medians (range) of {args.runs} runs of each design, alternating.", ""]
    for mode, keys in (("failover", ["detect_s", "move_s", "time_lost_s", "step_time_s"]),
                       ("floor", ["detect_s", "save_s", "exit_s", "restart_s", "time_lost_s", "step_time_s"])):
        found = runs[mode]
        ratio = [r["time_lost_s"] / restart for r in found]
        doc[mode] = {"runs": found, "median": {k: statistics.median(r[k] for r in found) for k in keys},
                     "time_lost_over_restart": statistics.median(ratio),
                     "time_lost_over_restart_range": [min(ratio), max(ratio)],
                     "steps_lost": [r["steps_lost"] for r in found], "identical": sum(r["identical"] for r in found)}
        how = ("the store moves to rank 0's standby; the job trains on" if mode == "failover" else
               "`elastic.store_failover=false`: the ranks save and stop; the same command run again")
        lines += [f"## {mode}: {how}", "", *_table(found, keys), "",
                  f"time lost / the floor's restart (median {restart:.3f} s): {doc[mode]['time_lost_over_restart']:.3f} "
                  f"({min(ratio):.3f}-{max(ratio):.3f}); steps lost per run: {doc[mode]['steps_lost']}; "
                  f"bit-identical to the failure-free run: {doc[mode]['identical']} of {len(found)}", ""]
    host_keys = ["fault_to_first_step_s", "time_lost_s", "store_s"]
    for mode in ("host", "host_workers"):
        found = runs[mode]
        doc[mode] = {"runs": found, "median": {k: statistics.median(r[k] for r in found) for k in host_keys},
                     "steps_lost": [r["steps_lost"] for r in found], "identical": sum(r["identical"] for r in found),
                     "fallbacks": sum(r["is_fallback"] for r in found)}
    whole, workers = (statistics.median(r["time_lost_s"] for r in runs[m]) for m in ("host", "host_workers"))
    doc["host_over_host_workers"] = whole / workers
    lines += ["## host: node 0's whole host (its agent holds the store) SIGKILLed, two agents", "",
              "| case | " + " | ".join(k[:-2] + " s (range)" for k in host_keys) + " |", "| --- |" + " --- |" * len(host_keys)]
    for mode, what in (("host", "agent + ranks 0, 1 (the store with them)"), ("host_workers", "ranks 0, 1 only (the store lives)")):
        found = runs[mode]
        lines.append(f"| {what} | " + " | ".join(f"{statistics.median(r[k] for r in found):.3f} "
                                                 f"({min(r[k] for r in found):.3f}-{max(r[k] for r in found):.3f})"
                                                 for k in host_keys) + " |")
    lines += ["", f"time lost, the store with them / without: {doc['host_over_host_workers']:.2f}x; steps lost per run: "
                  f"{doc['host']['steps_lost']} / {doc['host_workers']['steps_lost']}; recovered from snapshots (no "
                  f"fallback): {len(runs['host']) - doc['host']['fallbacks']} / {len(runs['host_workers']) - doc['host_workers']['fallbacks']} "
                  f"of {len(runs['host'])}; bit-identical: {doc['host']['identical']} / {doc['host_workers']['identical']} "
                  f"of {len(runs['host'])}", ""]
    doc["failed"] = failed
    lines += [f"Runs that failed: {', '.join(f'{m} {len(f)}' for m, f in failed.items()) or 'none'} "
              f"(of {args.runs} per design)"]
    write_results(args.out, doc, lines)


if __name__ == "__main__":
    main()
