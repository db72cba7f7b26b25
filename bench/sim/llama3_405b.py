"""The simulator's failure-free step against Llama 3 405B's published throughput (issue 36, item 4).

Meta trained Llama 3 405B on up to 16,384 H100s at 8 x 16 x DP (TP x PP x DP), 8,192-token
sequences, 16 M tokens a step, at 430 (8,192 GPUs) and 400 (16,384 GPUs) BF16 TFLOP/s per GPU
("The Llama 3 Herd of Models", arXiv:2407.21783, table 4). This runs ``elaswave simulate`` on
the same layouts with the sourced H100 preset (``--hardware h100``: elaswave/sim/workload.py; no
figure in it is fitted to this run) and no clock planning, and puts its model TFLOP/s per GPU
beside the published one, with two bounds that say where the difference sits:

- *compute*: the step's FLOPs at the preset's sustained share of the peak on every GPU, nothing else;
- *1F1B*: that, stretched by the one-forward-one-backward schedule's fill and drain, (m + p - 1) / m
  for m micro-batches a pipeline -- the simulator's schedule. Llama 3 ran an interleaved schedule
  (V model chunks a stage: fill and drain (p - 1) / (V m)), which the simulator does not model.

    python bench/sim/llama3_405b.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import RESULTS, bench_args, write_results  # noqa: E402
from bench.sim.simulator import simulate  # noqa: E402  `elaswave simulate --json` in this process

from elaswave.sim.workload import HARDWARE, MODELS, model_flops_per_micro_batch  # noqa: E402

TOKENS_PER_STEP = 16 * 2 ** 20
ROWS = ((8192, 64, 430.0), (16384, 128, 400.0))
"""(GPUs, DP, published TFLOP/s per GPU) at TP 8, PP 16, 8,192-token sequences (table 4)."""
TP, PP = 8, 16


def row(gpus: int, dp: int, published: float) -> dict:
    model, hw = MODELS["llama3-405b"], HARDWARE["h100"]
    sequences = TOKENS_PER_STEP // model.seq_len

    def run(*more: str) -> dict:
        return simulate(["--devices", str(gpus), "--tp", str(TP), "--dp", str(dp), "--pp", str(PP), "--model",
                         "llama3-405b", "--micro-batches", str(sequences), "--hardware", "h100", "--no-dvfs",
                         "--policies", "elaswave_no_dvfs", *more])
    doc, unlimited = run(), run("--device-gib", "0")
    free = doc["config"]["failure_free"]
    m = sequences // dp
    flops = sequences * model_flops_per_micro_batch(model, 1)
    compute_s = flops / gpus / (hw.device_tflops * 1e12 * hw.efficiency)
    return {"gpus": gpus, "tp": TP, "pp": PP, "dp": dp, "micro_batches_per_pipeline": m,
            "published_tflops_per_gpu": published, "simulated_tflops_per_gpu": free["model_tflops_per_gpu"],
            "simulated_over_published": free["model_tflops_per_gpu"] / published,
            "step_s": free["step_s"], "step_without_memory_limit_s": unlimited["config"]["failure_free"]["step_s"],
            "tflops_without_memory_limit": unlimited["config"]["failure_free"]["model_tflops_per_gpu"],
            "compute_bound_s": compute_s, "one_f_one_b_bound_s": compute_s * (m + PP - 1) / m,
            "published_step_s": flops / gpus / (published * 1e12), "device_gib": doc["config"]["device_gib"],
            "mfu": free["mfu"]}


def main() -> None:
    args = bench_args(__doc__, out="llama3_405b").parse_args()
    rows = [row(*r) for r in ROWS]
    lines = ["| GPUs | TP x PP x DP | micro-batches a pipeline | published TFLOP/s/GPU | simulated (80 GiB) | "
             "simulated / published | simulated, no memory limit | step s: simulated (80 GiB) | no memory limit | "
             "1F1B bound | compute bound | published |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['gpus']:,} | {r['tp']} x {r['pp']} x {r['dp']} | {r['micro_batches_per_pipeline']} | "
                     f"{r['published_tflops_per_gpu']:.0f} | {r['simulated_tflops_per_gpu']:.0f} | "
                     f"{r['simulated_over_published']:.2f} | {r['tflops_without_memory_limit']:.0f} | "
                     f"{r['step_s']:.2f} | {r['step_without_memory_limit_s']:.2f} | "
                     f"{r['one_f_one_b_bound_s']:.2f} | {r['compute_bound_s']:.2f} | {r['published_step_s']:.2f} |")
    write_results(Path(args.out) if args.out else RESULTS / "llama3_405b", {"rows": rows}, lines)


if __name__ == "__main__":
    main()
