"""Chaos: seeded random schedules of kills, hangs, double kills, kills during a recovery and joins.

Each seed runs dp=3 x pp=2 (6 ranks), deterministic, for ``--steps`` steps under the schedule
``elaswave.control.chaos.schedule(seed, ...)`` draws, with disk checkpoints every 10 steps (the
fallback when a rank dies with its snapshot holder). A run *ends equal* when it exits 0, writes
every step exactly once, and its losses and final ``params_sha256`` equal the failure-free
reference's; the runner also counts processes of the job left alive after the launcher exits.

    python bench/faults/chaos.py --seeds 20
    python bench/faults/chaos.py --any-instant --seeds 60

``--any-instant``: instead of faults the ranks inject into themselves at clean points, a thread
outside the job sends SIGKILL (three in four) or SIGSTOP to live workers at instants drawn from the
seed (``elaswave.control.chaos.strikes``: inside a step, or 0-0.5 s after the previous strike, so
inside its recovery or its replacement's join), with a replacement started for every dead rank
(``--respawn-after 0``); layouts cycle over dp x pp = 3 x 2, 2 x 2 and 4 x 1, 80 steps each. Every
run is counted as equal, equal after a loud return to a disk checkpoint, a loud failure, a silent
divergence, or a hang (``tests/helpers/striker.py``).
"""
from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common, tests.helpers
from bench.common import bench_args, set_flags, write_results  # noqa: E402
from elaswave.control.chaos import schedule  # noqa: E402
from tests.helpers.spawn import run_cli  # noqa: E402  the tests' helper: starts jobs, counts what they leave
DP, PP, MBS = 3, 2, 6
JOB = ["model.d_model=32", "model.num_heads=2", "model.seq_len=32", "model.num_blocks=4", "train.micro_batch_size=2",
       "data.max_corpus_bytes=200000", f"train.num_micro_batches={MBS}", "parallel.timeout_s=60",
       "elastic.heartbeat_timeout_s=1.0", "elastic.heartbeat_interval_s=0.1"]


def _cli(args: list[str], tmp: Path, metrics: Path, timeout_s: float):
    """(the run's Result, or None when it timed out; wall seconds): through the tests' one way of
    starting ranks, which also counts the processes a run leaves behind."""
    began = time.perf_counter()
    try:
        res = run_cli(args, tmp, timeout_s=timeout_s, metrics=metrics)
    except AssertionError:  # the helper's timeout
        res = None
    return res, time.perf_counter() - began


def sets(steps: int, faults: list[str], ckpt: str) -> list[str]:
    return [*JOB, f"train.steps={steps}", f"parallel.dp={DP}", f"parallel.pp={PP}", f"checkpoint.dir={ckpt}",
            "checkpoint.every_steps=10", "elastic.inject=" + ";".join(faults)]


def run_seed(seed: int, steps: int, reference: list[dict], tmp: Path, timeout_s: float) -> dict:
    faults = schedule(seed, DP * PP, steps)
    metrics = tmp / f"seed{seed}.jsonl"
    args = ["run", "--deterministic"] + set_flags(sets(steps, faults, str(tmp / f"ckpt{seed}")))
    res, wall = _cli(args, tmp, metrics, timeout_s)
    code, err, left = (res.returncode, res.stderr, res.left_behind) if res else (124, "timed out", 0)
    records = res.records if res else []
    steps_seen = [r["step"] for r in records if r["event"] == "step"]
    losses = [r["loss"] for r in records if r["event"] == "step"]
    summary = next((r for r in records if r["event"] == "summary"), {})
    ref_losses = [r["loss"] for r in reference if r["event"] == "step"]
    ref_sha = next(r for r in reference if r["event"] == "summary")["params_sha256"]
    changes = [r for r in records if r["event"] in ("recovery", "join", "rebalance")]
    equal = (code == 0 and steps_seen == list(range(steps)) and losses == ref_losses
             and summary.get("params_sha256") == ref_sha)
    return {"seed": seed, "faults": faults, "equal": equal, "exit": code, "left_behind": left, "wall_s": wall,
            "steps_ok": steps_seen == list(range(steps)),
            "recoveries": sum(1 for r in changes if r["event"] == "recovery"),
            "joins": sum(len(r.get("joined_ranks", [])) for r in changes),
            "fallbacks": sum(1 for r in changes if r.get("is_fallback")),
            "max_mttr_s": max((r["mttr_s"] for r in changes if r["event"] == "recovery"), default=None),
            "final_ranks": summary.get("ranks"), "stderr_tail": "" if equal else err[-2000:]}


def reference_run(steps: int, tmp: Path) -> list[dict]:
    args = ["reference", "--deterministic"] + set_flags([*JOB, f"train.steps={steps}"])
    res, _ = _cli(args, tmp, tmp / "reference.jsonl", 600)
    if res is None or res.returncode != 0:
        raise RuntimeError(f"the reference failed:\n{res.stderr[-2000:] if res else 'timed out'}")
    return res.records


ANY_LAYOUTS = ((3, 2), (2, 2), (4, 1))


def _any_job(mbs: int) -> list[str]:
    return [s if not s.startswith("train.num_micro_batches=") else f"train.num_micro_batches={mbs}" for s in JOB]


def _strikes_text(fired: list[dict]) -> str:
    return ", ".join(f"{f['rank']} {f['signal'][3:]} @{f['steps_written']}" for f in fired)


def any_instant(args) -> None:
    """Strikes from outside at seeded instants; see the module docstring."""
    from tests.helpers.spawn import Result
    from tests.helpers.striker import strike_run

    steps = args.steps
    verdicts = ("equal", "fallback_equal", "failed", "diverged", "hang")
    runs = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        references: dict[int, Result] = {}
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            dp, pp = args.layouts[seed % len(args.layouts)]
            mbs = 6 if dp * pp == 6 else 4  # micro-batches: a multiple of every dp
            if mbs not in references:
                ref_args = ["reference", "--deterministic"] + set_flags([*_any_job(mbs), f"train.steps={steps}"])
                ref, _ = _cli(ref_args, tmp, tmp / f"reference{mbs}.jsonl", 600)
                if ref is None or ref.returncode != 0:
                    raise RuntimeError(f"the reference failed:\n{ref.stderr[-2000:] if ref else 'timed out'}")
                references[mbs] = ref
            sets_ = [*_any_job(mbs), f"train.steps={steps}", f"parallel.dp={dp}", f"parallel.pp={pp}",
                     f"checkpoint.dir={tmp / f'ckpt{seed}'}", "checkpoint.every_steps=10",
                     f"elastic.snapshot_copies={args.snapshot_copies}"]
            cli = ["run", "--deterministic", "--respawn-after", "0"] + set_flags(sets_)
            out = strike_run(seed, cli, tmp / f"seed{seed}.jsonl", references[mbs], steps,
                             min_alive=max(2, dp * pp // 2), timeout_s=args.timeout_s)
            if out.verdict not in ("equal", "fallback_equal") and (tmp / f"seed{seed}.jsonl").exists():
                kept = Path(args.out + "_any_instant_failures")  # the evidence, for whoever debugs it
                kept.mkdir(parents=True, exist_ok=True)
                shutil.copy(tmp / f"seed{seed}.jsonl", kept / f"seed{seed}.jsonl")
            runs.append({"seed": seed, "dp": dp, "pp": pp, "verdict": out.verdict, "wall_s": out.wall_s,
                         "recoveries": out.recoveries, "joins": out.joins, "left_behind": out.left_behind,
                         "fired": out.fired, "skipped": out.skipped, "detail": out.detail})
            print(f"seed {seed:3d} {dp}x{pp}: {out.verdict:14s} wall {out.wall_s:5.1f}s recoveries {out.recoveries} "
                  f"joins {out.joins} left {out.left_behind} strikes {_strikes_text(out.fired)}", flush=True)
    counts = {v: sum(r["verdict"] == v for r in runs) for v in verdicts}
    summary = {"seeds": len(runs), "steps": steps, "layouts": [f"{dp}x{pp}" for dp, pp in args.layouts], **counts,
               "struck_runs": sum(bool(r["fired"]) for r in runs), "strikes": sum(len(r["fired"]) for r in runs),
               "sigstops": sum(f["signal"] == "SIGSTOP" for r in runs for f in r["fired"]),
               "left_behind": sum(r["left_behind"] for r in runs),
               "recoveries": sum(r["recoveries"] for r in runs), "joins": sum(r["joins"] for r in runs),
               "wall_s_median": statistics.median(r["wall_s"] for r in runs)}
    summary["snapshot_copies"] = args.snapshot_copies
    out_path = Path(args.out + "_any_instant" + (f"_{steps}" if steps != 80 else "")
                    + (f"_k{args.snapshot_copies}" if args.snapshot_copies != 1 else ""))
    lines = ["# Chaos at any instant", "",
             f"`python bench/faults/chaos.py --any-instant --seeds {args.seeds} --first-seed {args.first_seed} --steps {steps}"
             f" --layouts {','.join(summary['layouts'])} --snapshot-copies {args.snapshot_copies}`: layouts "
             f"{', '.join(summary['layouts'])} in turn, deterministic, a replacement for every dead rank; SIGKILL / "
             f"SIGSTOP sent from outside the job at seeded instants; each rank's snapshot kept by "
             f"{args.snapshot_copies} peer(s).", "",
             f"- bit-identical to the reference: **{counts['equal']}**; bit-identical after a loud return to a disk "
             f"checkpoint: **{counts['fallback_equal']}**",
             f"- loud failures (non-zero exit): {counts['failed']}; silent divergence: {counts['diverged']}; "
             f"hangs: {counts['hang']}",
             f"- runs struck at least once: {summary['struck_runs']} of {summary['seeds']}; "
             f"strikes sent: {summary['strikes']} ({summary['sigstops']} SIGSTOP); recoveries {summary['recoveries']}, "
             f"ranks joined {summary['joins']}; processes left behind: {summary['left_behind']}; wall per run: median "
             f"{summary['wall_s_median']:.1f} s", "",
             "| seed | layout | verdict | recoveries | joins | strikes (rank, signal, steps written) |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['seed']} | {r['dp']}x{r['pp']} | {r['verdict']} | {r['recoveries']} | {r['joins']} | "
              f"{_strikes_text(r['fired'])} |" for r in runs]
    write_results(out_path, {"summary": summary, "runs": runs}, lines)
    print(json.dumps(summary))
    if counts["diverged"] or counts["hang"] or counts["failed"]:
        sys.exit(1)


def main() -> None:
    ap = bench_args(__doc__, out="chaos")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None, help="120 (80 with --any-instant)")
    ap.add_argument("--timeout-s", type=float, default=300)
    ap.add_argument("--any-instant", action="store_true")
    ap.add_argument("--layouts", default=",".join(f"{dp}x{pp}" for dp, pp in ANY_LAYOUTS),
                    help="dp x pp layouts the any-instant seeds cycle over")
    ap.add_argument("--snapshot-copies", type=int, default=1,
                    help="elastic.snapshot_copies of the any-instant runs (peers keeping each rank's snapshot)")
    args = ap.parse_args()
    if args.steps is None:
        args.steps = 80 if args.any_instant else 120
    if args.seeds < 1:
        ap.error(f"--seeds={args.seeds} must be >= 1")
    if args.snapshot_copies < 1:
        ap.error(f"--snapshot-copies={args.snapshot_copies} must be >= 1")
    if args.steps < 12:
        ap.error(f"--steps={args.steps} is too short for a chaos run: it must be >= 12")
    try:
        args.layouts = [tuple(int(x) for x in item.split("x")) for item in args.layouts.split(",")]
        assert all(len(t) == 2 and min(t) >= 1 for t in args.layouts)
    except (ValueError, AssertionError):
        ap.error(f"--layouts={args.layouts!r}: expected DPxPP items separated by commas, e.g. 3x2,2x2")
    if args.any_instant:
        any_instant(args)
        return
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        reference = reference_run(args.steps, tmp)
        runs = []
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            r = run_seed(seed, args.steps, reference, tmp, args.timeout_s)
            runs.append(r)
            print(f"seed {seed:3d}: {'equal' if r['equal'] else 'DIFFERENT'}  exit {r['exit']}  "
                  f"left {r['left_behind']}  wall {r['wall_s']:.1f}s  recoveries {r['recoveries']}  joins {r['joins']}  "
                  f"fallbacks {r['fallbacks']}  max mttr {r['max_mttr_s']}  ranks {r['final_ranks']}  {r['faults']}",
                  flush=True)
    mttrs = [r["max_mttr_s"] for r in runs if r["max_mttr_s"] is not None]
    walls = [r["wall_s"] for r in runs]
    summary = {"seeds": len(runs), "equal": sum(r["equal"] for r in runs), "steps": args.steps,
               "dp": DP, "pp": PP, "left_behind": sum(r["left_behind"] for r in runs),
               "wall_s_median": statistics.median(walls), "wall_s_max": max(walls),
               "max_mttr_s": max(mttrs) if mttrs else None,
               "recoveries": sum(r["recoveries"] for r in runs), "joins": sum(r["joins"] for r in runs),
               "fallbacks": sum(r["fallbacks"] for r in runs)}
    lines = ["# Chaos runs", "", f"`python bench/faults/chaos.py --seeds {args.seeds} --steps {args.steps}`: dp={DP} x pp={PP}, "
             "deterministic, kills / hangs / double kills / kills during a recovery / joins drawn per seed.", "",
             f"- runs that ended equal to the failure-free reference: **{summary['equal']} / {summary['seeds']}**",
             f"- processes left behind: {summary['left_behind']}",
             f"- wall time per run: median {summary['wall_s_median']:.1f} s, max {summary['wall_s_max']:.1f} s",
             f"- max MTTR over all recoveries: {summary['max_mttr_s']:.3f} s" if mttrs else "- no recoveries",
             f"- recoveries {summary['recoveries']}, ranks joined {summary['joins']}, "
             f"disk fallbacks {summary['fallbacks']}", "",
             "| seed | equal | wall s | recoveries | joins | max MTTR s | final ranks | schedule |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        lines.append(f"| {r['seed']} | {'yes' if r['equal'] else 'NO'} | {r['wall_s']:.1f} | {r['recoveries']} | "
                     f"{r['joins']} | {r['max_mttr_s'] if r['max_mttr_s'] is None else round(r['max_mttr_s'], 3)} | "
                     f"{r['final_ranks']} | {'; '.join(r['faults'])} |")
    write_results(args.out, {"summary": summary, "runs": runs}, lines)
    print(json.dumps(summary))
    if summary["equal"] != summary["seeds"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
