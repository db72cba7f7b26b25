"""Step time of elaswave vs a baseline of PyTorch's own parts, same model, data and layout.

    python bench/peers/foundation.py [--layouts 4x1,2x2] [--steps 30] [--repeats 3] [--out bench/results]

Per layout and repeat it runs, interleaved: elaswave fast mode, the torch baseline (DDP for dp-only;
torch.distributed.pipelining 1F1B + data-parallel all-reduce for dp x pp, under torchrun), and
elaswave deterministic mode. Reports median step time (first 5 steps dropped as warm-up) and
ratios ours/theirs, plus per-rank optimizer-state bytes (ZeRO-1 vs replicated AdamW).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository: bench.common
from bench.common import RESULTS, cli_argv, median_step_s, set_flags, torchrun_argv, write_results  # noqa: E402

WARMUP = 5


def run_ours(sets, deterministic, workdir):
    out = os.path.join(workdir, f"ours-{time.monotonic_ns()}.jsonl")
    subprocess.run(cli_argv("run", sets, out, deterministic), check=True, stdout=subprocess.DEVNULL, timeout=900)
    recs = [json.loads(line) for line in open(out)]
    summary = next(r for r in recs if r["event"] == "summary")
    return median_step_s(recs, WARMUP), summary["optimizer_state_bytes_per_rank"]


def run_torch(sets, nproc, workdir):
    out = os.path.join(workdir, f"torch-{time.monotonic_ns()}.json")
    cmd = torchrun_argv(nproc, str(HERE / "torch_baseline.py"), "--out", out) + set_flags(sets)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
    res = json.load(open(out))
    return statistics.median(res["step_times_s"][WARMUP:]), res["optimizer_state_bytes_per_rank"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="4x1,2x2")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for layout in args.layouts.split(","):
            dp, pp = (int(x) for x in layout.split("x"))
            sets = ["model.arch=gpt", f"parallel.dp={dp}", f"parallel.pp={pp}", f"train.steps={args.steps}", *args.overrides]
            fast, det, base = [], [], []
            for _ in range(args.repeats):
                fast.append(run_ours(sets, False, workdir))
                base.append(run_torch(sets, dp * pp, workdir))
                det.append(run_ours(sets, True, workdir))
            f, b, d = (statistics.median(x[0] for x in xs) for xs in (fast, base, det))
            row = {"dp": dp, "pp": pp, "baseline": "DDP" if pp == 1 else "pipelining 1F1B + DP all-reduce",
                   "ours_fast_step_s": f, "ours_det_step_s": d, "torch_step_s": b,
                   "fast_over_torch": f / b, "det_over_torch": d / b,
                   "ours_opt_state_bytes_per_rank": fast[0][1], "torch_opt_state_bytes_per_rank": base[0][1],
                   "repeats": args.repeats, "steps": args.steps}
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = ["| dp×pp | baseline | ours fast / torch | ours deterministic / torch | opt. state bytes/rank ours vs torch |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['dp']}×{r['pp']} | {r['baseline']} | {r['fast_over_torch']:.3f} "
                     f"({r['ours_fast_step_s'] * 1e3:.1f} vs {r['torch_step_s'] * 1e3:.1f} ms) | "
                     f"{r['det_over_torch']:.3f} ({r['ours_det_step_s'] * 1e3:.1f} ms) | "
                     f"{max(r['ours_opt_state_bytes_per_rank'])} vs {max(r['torch_opt_state_bytes_per_rank'])} |")
    write_results(Path(args.out) / "foundation", rows, lines)


if __name__ == "__main__":
    main()
