"""Layer and chunk migration after a loss, blocking vs non-blocking (``elastic.overlap_migration``).

dp=2 x pp=2 with real compute and a model large enough that the moved state is not negligible
(d_model 256, 4 blocks: ~3.2 M parameters, ~38 MB of ZeRO state). Rank 1 (stage 1 of pipeline 0) is
SIGKILLed; rank 0 is re-partitioned to hold every layer, so it takes the parameters of layers it
never held (all-gathered from their owners in pipeline 1), and the dead rank's chunks move from
the snapshot holders. Blocking: parameters and Adam moments arrive before the first step.
Non-blocking: parameters first; the moments (two thirds of the bytes) travel while the first step
computes and are waited for at its first backward. Reported: the recovery's ``state`` phase, its
first step, and the MTTR, medians over interleaved runs.

    python bench/elastic/migration.py --runs 5
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import bench_args, run_job, write_results  # noqa: E402

JOB = ["parallel.dp=2", "parallel.pp=2", "model.d_model=256", "model.num_heads=4", "model.seq_len=32",
       "model.num_blocks=4", "train.micro_batch_size=2", "train.num_micro_batches=4", "train.steps=8",
       "parallel.chunk_numel=65536", "elastic.inject=kill:rank=1,step=4,phase=forward",
       # Re-partitioning is what moves state; near the break-even point the planner might take detours.
       "elastic.detours=false"]


def run(sets: list[str]) -> dict:
    return next(r for r in run_job(JOB + sets) if r["event"] == "recovery")


def main() -> None:
    ap = bench_args(__doc__, out="migration", runs=5)
    args = ap.parse_args()
    modes = {"blocking": ["elastic.overlap_migration=false"], "non_blocking": ["elastic.overlap_migration=true"]}
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for k in range(args.runs):
        for mode, sets in modes.items():
            rec = run(sets)
            runs[mode].append({"state_s": rec["phases_s"]["state"], "first_step_s": rec["phases_s"]["first_step"],
                               "mttr_s": rec["mttr_s"], "bytes_received": rec["bytes_received"]})
            print(f"  run {k} {mode}: state {rec['phases_s']['state'] * 1e3:.1f} ms, first step "
                  f"{rec['phases_s']['first_step'] * 1e3:.1f} ms, mttr {rec['mttr_s']:.3f} s", flush=True)
    med = {m: {key: statistics.median(r[key] for r in rs) for key in ("state_s", "first_step_s", "mttr_s")}
           for m, rs in runs.items()}
    result = {"job": JOB, "runs": runs, "medians": med,
              "state_blocking_over_non_blocking": med["blocking"]["state_s"] / med["non_blocking"]["state_s"],
              "mttr_blocking_over_non_blocking": med["blocking"]["mttr_s"] / med["non_blocking"]["mttr_s"],
              "bytes_received_per_recovery": runs["blocking"][0]["bytes_received"]}
    md = [f"Migration after a loss, dp=2 x pp=2, d_model 256, real compute, 2-core CPU box, gloo; rank 1 SIGKILLed; "
          f"medians of {args.runs} interleaved runs.", "",
          "| migration | state phase ms | first step ms | MTTR s |", "| --- | --- | --- | --- |"]
    md += [f"| {m} | {v['state_s'] * 1e3:.1f} | {v['first_step_s'] * 1e3:.1f} | {v['mttr_s']:.3f} |" for m, v in med.items()]
    md += ["", f"State phase blocking / non-blocking: {result['state_blocking_over_non_blocking']:.2f}x; MTTR: "
               f"{result['mttr_blocking_over_non_blocking']:.2f}x; chunk bytes rank 0 received in the "
               f"recovery: {result['bytes_received_per_recovery']:,}."]
    write_results(args.out, result, md)


if __name__ == "__main__":
    main()
