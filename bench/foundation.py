"""Step time of elaswave vs a baseline of PyTorch's own parts, same model, data and layout.

    python bench/foundation.py [--layouts 4x1,2x2] [--steps 30] [--repeats 3] [--out bench/results]

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

HERE = os.path.dirname(os.path.abspath(__file__))
WARMUP = 5


def _median_after_warmup(times):
    return statistics.median(times[WARMUP:])


def run_ours(sets, deterministic, workdir):
    out = os.path.join(workdir, f"ours-{time.monotonic_ns()}.jsonl")
    cmd = [sys.executable, "-m", "elaswave.cli", "run", "--metrics-out", out]
    cmd += [x for s in sets for x in ("--set", s)] + (["--deterministic"] if deterministic else [])
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=900)
    recs = [json.loads(line) for line in open(out)]
    times = [r["step_time_s"] for r in recs if r["event"] == "step"]
    summary = next(r for r in recs if r["event"] == "summary")
    return _median_after_warmup(times), summary["optimizer_state_bytes_per_rank"]


def run_torch(sets, nproc, workdir):
    out = os.path.join(workdir, f"torch-{time.monotonic_ns()}.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(HERE, "torch_baseline.py"), "--out", out] + [x for s in sets for x in ("--set", s)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
    res = json.load(open(out))
    return _median_after_warmup(res["step_times_s"]), res["optimizer_state_bytes_per_rank"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="4x1,2x2")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
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
    with open(os.path.join(args.out, "foundation.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    lines = ["| dp×pp | baseline | ours fast / torch | ours deterministic / torch | opt. state bytes/rank ours vs torch |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['dp']}×{r['pp']} | {r['baseline']} | {r['fast_over_torch']:.3f} "
                     f"({r['ours_fast_step_s'] * 1e3:.1f} vs {r['torch_step_s'] * 1e3:.1f} ms) | "
                     f"{r['det_over_torch']:.3f} ({r['ours_det_step_s'] * 1e3:.1f} ms) | "
                     f"{max(r['ours_opt_state_bytes_per_rank'])} vs {max(r['torch_opt_state_bytes_per_rank'])} |")
    with open(os.path.join(args.out, "foundation.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
