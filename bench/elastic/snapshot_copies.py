"""Snapshot redundancy (issue 18): a rank SIGKILLed together with its first snapshot holder, with
``elastic.snapshot_copies`` 1 and 2, and the steady-state cost of the second copy.

    python bench/elastic/snapshot_copies.py --runs 5

*Double kill*: dp=3 x pp=2, deterministic, no disk checkpoint (as a new user runs it). After step
10 is written a rank drawn from the run's seed is SIGKILLed from outside the job and, 0.02-0.3 s
later (drawn too), the peer after it on the snapshot ring -- its only holder with one copy, its
first with two. Each run is judged against the reference (losses, ``params_sha256``,
``state_sha256``) and counted as a recovery from memory or a fallback (to step 0 here).

*Steady state*: the same job failure-free, 60 steps, K=1 and K=2 interleaved per round; the median
step time over steps 5.. of each run, the ratio K=2 / K=1 per round, and the snapshot bytes each
rank holds.
"""
from __future__ import annotations

import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common, tests.helpers
from bench.common import bench_args, in_turn, set_flags, write_results  # noqa: E402
from tests.helpers.spawn import Running, children, rank_of, run_cli, steps_written  # noqa: E402

DP, PP, MBS = 3, 2, 6
JOB = ["model.d_model=32", "model.num_heads=2", "model.seq_len=32", "model.num_blocks=4", "train.micro_batch_size=2",
       "data.max_corpus_bytes=200000", f"train.num_micro_batches={MBS}", "parallel.timeout_s=60",
       "elastic.straggler_gain=0", f"parallel.dp={DP}", f"parallel.pp={PP}"]


def _args(steps: int, copies: int) -> list[str]:
    sets = [*JOB, f"train.steps={steps}", f"elastic.snapshot_copies={copies}"]
    return ["run", "--deterministic"] + set_flags(sets)


def double_kill(seed: int, copies: int, steps: int, reference: dict, tmp: Path) -> dict:
    rng = random.Random(seed)
    victim = rng.randrange(DP * PP)
    holder = (victim + 1) % (DP * PP)  # the ring of one host's launcher: rank order
    gap_s = rng.uniform(0.02, 0.3)
    metrics = tmp / f"kill-{seed}-k{copies}.jsonl"
    with Running(_args(steps, copies), metrics) as job:
        deadline = time.monotonic() + 120
        while steps_written(metrics) <= 10 and time.monotonic() < deadline:
            time.sleep(0.005)
        pids = {rank_of(p): p for p in children(job.proc.pid)}
        os.kill(pids[victim], signal.SIGKILL)
        time.sleep(gap_s)
        os.kill(pids[holder], signal.SIGKILL)
        res = job.finish(300)
    recoveries = [r for r in res.records if r["event"] == "recovery"]
    equal = (res.returncode == 0 and res.losses == reference["losses"]
             and res.summary.get("params_sha256") == reference["params_sha256"]
             and res.summary.get("state_sha256") == reference["state_sha256"])
    return {"seed": seed, "copies": copies, "victims": [victim, holder], "gap_s": round(gap_s, 3),
            "exit": res.returncode, "equal": equal, "fallback": any(r["is_fallback"] for r in recoveries),
            "resume_steps": [r["resume_step"] for r in recoveries],
            "lost": [r["lost_ranks"] for r in recoveries]}


def steady(copies: int, steps: int, tmp: Path) -> dict:
    res = run_cli(_args(steps, copies), tmp, timeout_s=600)
    if res.returncode != 0:
        raise RuntimeError(f"a failure-free run failed:\n{res.stderr[-2000:]}")
    times = [r["step_time_s"] for r in res.steps if r["step"] >= 5]
    snap = [r["phases_s"]["snapshot"] for r in res.steps if r["step"] >= 5]
    return {"step_s": statistics.median(times), "snapshot_phase_s": statistics.median(snap),
            "held_bytes": res.summary["snapshot_bytes_held_per_rank"]}


def main() -> None:
    ap = bench_args(__doc__, out="snapshot_copies")
    ap.add_argument("--runs", type=int, default=5, help="double-kill runs per setting and steady-state rounds")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    if args.runs < 1 or args.steps < 20:
        ap.error(f"--runs={args.runs} must be >= 1 and --steps={args.steps} >= 20 (the kills come after step 10)")
    kills, rounds = [], []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ref = run_cli(["reference", "--deterministic"] + set_flags([*JOB, f"train.steps={args.steps}"]), tmp,
                      timeout_s=600)
        reference = {"losses": ref.losses, "params_sha256": ref.summary["params_sha256"],
                     "state_sha256": ref.summary["state_sha256"]}
        for seed in range(args.runs):
            for copies in (1, 2):
                r = double_kill(seed, copies, args.steps, reference, tmp)
                kills.append(r)
                print(json.dumps(r), flush=True)
        for i in range(args.runs):
            pair = {k: steady(k, 60, tmp) for k in in_turn(i, (1, 2))}
            rounds.append({"k1": pair[1], "k2": pair[2], "ratio": pair[2]["step_s"] / pair[1]["step_s"]})
            print(json.dumps(rounds[-1]), flush=True)
    summary = {}
    for copies in (1, 2):
        mine = [r for r in kills if r["copies"] == copies]
        summary[f"k{copies}"] = {"runs": len(mine), "equal": sum(r["equal"] for r in mine),
                                 "from_memory": sum(not r["fallback"] for r in mine),
                                 "fallbacks": sum(r["fallback"] for r in mine)}
    ratios = [r["ratio"] for r in rounds]
    summary["steady"] = {"ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                         "k1_step_s": statistics.median(r["k1"]["step_s"] for r in rounds),
                         "k2_step_s": statistics.median(r["k2"]["step_s"] for r in rounds),
                         "k1_held_bytes": rounds[0]["k1"]["held_bytes"], "k2_held_bytes": rounds[0]["k2"]["held_bytes"]}
    s = summary["steady"]
    lines = ["# Snapshot redundancy", "", f"`python bench/elastic/snapshot_copies.py --runs {args.runs} --steps {args.steps}`: "
             f"dp={DP} x pp={PP}, deterministic, no disk checkpoint; a rank and then (0.02-0.3 s later) its first "
             "snapshot holder SIGKILLed after step 10.", "",
             "| snapshot_copies | runs | recovered from memory | fell back (to step 0) | bit-identical |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {c} | {summary[f'k{c}']['runs']} | {summary[f'k{c}']['from_memory']} | {summary[f'k{c}']['fallbacks']} | "
              f"{summary[f'k{c}']['equal']} |" for c in (1, 2)]
    lines += ["", "| seed | copies | killed (rank, its holder) | gap s | resumed at | fallback | equal |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['seed']} | {r['copies']} | {r['victims']} | {r['gap_s']} | {r['resume_steps']} | {r['fallback']} | "
              f"{r['equal']} |" for r in kills]
    lines += ["", f"Steady state (failure-free, 60 steps, {args.runs} interleaved rounds): step time K=2 / K=1 median "
              f"**{s['ratio_median']:.3f}** (range {s['ratio_min']:.3f}-{s['ratio_max']:.3f}); medians "
              f"{s['k1_step_s'] * 1e3:.1f} ms and {s['k2_step_s'] * 1e3:.1f} ms. Snapshot bytes held per rank: "
              f"K=1 {s['k1_held_bytes']}, K=2 {s['k2_held_bytes']}."]
    write_results(args.out, {"summary": summary, "kills": kills, "rounds": rounds}, lines)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
