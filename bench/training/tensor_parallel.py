"""Tensor parallelism on this CPU: ``python bench/training/tensor_parallel.py step|memory|all [--runs N]``.

step: for the default job's model (llama-tiny) and a wider one, fast mode, one pipeline of one stage:
the median step time at tp=2 (two ranks cutting every layer) over tp=1 (one rank), runs
alternated; and the bytes each tp=2 rank gave its tensor-parallel group's collectives per step,
measured by the runtime (the step records' ``tp_bytes``), against the prediction from the
simulator's pricing of TP (elaswave.sim.workload.tp_all_reduces: a micro-batch's activation in
all-reduces' worth per layer, forward and backward). The first 3 steps are warm-up. Two ranks on
two cores: tp=2 has twice the cores of tp=1, so the ratio is what splitting buys here, not a GPU
figure. Results: bench/results/tensor_parallel.json|md.
memory: a 1.2 GB Hugging Face folder (bench/training/llama.py's, random weights) trained 2 steps at
dp=1 x pp=1 x tp=1, 2, 4: each rank's peak in step 1 as the memory model predicts it and as
torch's profiler measures it (``train.measure_memory_step``), and its peak RSS. Results:
bench/results/tensor_parallel_memory.json.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository: bench.common
from bench.common import (bench_args, in_turn, median_step_s, run_job, step_records, write_json,  # noqa: E402
                          write_results, RESULTS)

BASE = ["elastic.enabled=false", "parallel.dp=1", "parallel.pp=1", "train.steps=12", "data.max_corpus_bytes=400000",
        "model.dropout=0"]
MODELS = {
    "default job's model (llama-tiny: d=64, 4 heads, ffn 128, seq 64, 8 x 4 sequences)": [
        "model.preset=llama-tiny"],
    "wider (d=256, 8 heads, ffn 1024, seq 128, 8 x 4 sequences)": [
        "model.preset=llama-tiny", "model.d_model=256", "model.num_heads=8", "model.num_kv_heads=4",
        "model.ffn_dim=1024", "model.seq_len=128", "train.micro_batch_size=4"],
}
WARMUP = 3


def predicted_tp_bytes(records: list[dict]) -> float:
    """Per step and rank: every layer's all-reduces of one micro-batch's activation, forward and
    backward, for each micro-batch (one stage holds every layer here), in fp32."""
    from elaswave.sim.workload import tp_all_reduces
    cfg = records[0]["config"]
    m, t = cfg["model"], cfg["train"]
    layers = m["num_blocks"] + 2
    activation = t["micro_batch_size"] * m["seq_len"] * m["d_model"] * 4
    return 2 * sum(tp_all_reduces(layers)) * activation * t["num_micro_batches"]


def measure(sets: list[str], runs: int) -> dict:
    times = {1: [], 2: []}
    measured = []
    predicted = None
    for i in range(runs):
        for tp in in_turn(i, (1, 2)):
            records = run_job([*BASE, *sets, f"parallel.tp={tp}"])
            times[tp].append(median_step_s(records, WARMUP))
            if tp == 2:
                measured += [r["tp_bytes"] for r in step_records(records)[WARMUP:]]
                predicted = predicted_tp_bytes(records)
    tp_bytes = statistics.median(measured)
    return {"step_s": {str(k): v for k, v in times.items()},
            "tp2_over_tp1": statistics.median(times[2]) / statistics.median(times[1]),
            "tp_bytes_per_step_measured": tp_bytes, "tp_bytes_per_step_predicted": predicted,
            "measured_over_predicted": tp_bytes / predicted}


def memory() -> dict:
    import tempfile
    from bench.training.llama import big_hf_dir
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        out = {"hf_dir_bytes": big_hf_dir(hf)}
        for tp in (1, 2, 4):
            records = run_job([f"model.init_from={hf}", "model.seq_len=16", "train.steps=2", "parallel.dp=1",
                               "parallel.pp=1", f"parallel.tp={tp}", "train.num_micro_batches=1",
                               "train.micro_batch_size=1", "train.measure_memory_step=1", "elastic.enabled=false", "data.source=stdlib",
                               "data.max_corpus_bytes=100000"])
            s = next(r for r in records if r["event"] == "summary")
            rows = [{"predicted_bytes": p["total"], "measured_peak_bytes": m["peak_bytes"],
                     "predicted_static_bytes": p["layers"] + p["optimizer"] + p["snapshots"] + p["data"],
                     "measured_before_bytes": m["before_bytes"], "peak_rss_bytes": rss}
                    for p, m, rss in zip(s["memory_predicted_per_rank"], s["memory_measured_per_rank"],
                                         s["peak_rss_bytes_per_rank"])]
            out[f"tp{tp}"] = rows
            print(f"memory: tp={tp} per rank (MiB) predicted/measured "
                  f"{[(round(r['predicted_bytes'] / 2 ** 20), round(r['measured_peak_bytes'] / 2 ** 20)) for r in rows]}"
                  f", peak RSS {[round(r['peak_rss_bytes'] / 2 ** 20) for r in rows]}", flush=True)
    return out


def main() -> None:
    args = bench_args(__doc__, out="tensor_parallel", runs=3, parts=("step", "memory")).parse_args()
    if args.what in ("memory", "all"):
        write_json(RESULTS / "tensor_parallel_memory.json", memory())
    if args.what not in ("step", "all"):
        return
    doc = {name: measure(sets, args.runs) for name, sets in MODELS.items()}
    lines = ["| model | step s tp=1 | step s tp=2 | tp=2 / tp=1 | TP bytes/step/rank measured | predicted | ratio |",
             "|---|---|---|---|---|---|---|"]
    for name, r in doc.items():
        lines.append(f"| {name} | {statistics.median(r['step_s']['1']):.4f} | {statistics.median(r['step_s']['2']):.4f} "
                     f"| {r['tp2_over_tp1']:.3f} | {r['tp_bytes_per_step_measured']:,.0f} "
                     f"| {r['tp_bytes_per_step_predicted']:,.0f} | {r['measured_over_predicted']:.3f} |")
    write_results(args.out, doc, lines)


if __name__ == "__main__":
    main()
