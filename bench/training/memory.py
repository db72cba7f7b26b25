"""The memory model against measurement, and what it says of a 70B job: ``python bench/training/memory.py table|survival|all``.

table:    the default job (the tiny Llama) in three layouts and modes, as real runs on this CPU; each
          rank measures its peak tensor bytes in step 3 (train.measure_memory_step: live tensors at
          the step's start plus the CPU allocator's peak through torch.profiler) beside the memory
          model's prediction by part; and, in bf16, the optimizer-state bytes each rank holds
          against 12 bytes x its ZeRO share (goal: equal, padding included).
survival: llama3-70b in bf16 on 80 GiB devices, 8 GiB of them kept for the CUDA context, NCCL and
          fragmentation as the simulator's --reserve-gib does (the model's shapes on the meta device,
          activations priced as the fused attention kernel keeps them): which dp x pp layouts start,
          and what losing each stage of a pipeline leads to (re-partitions / stands by / stops), by
          activation checkpointing.
lora:     the same job fine-tuned in full and with LoRA adapters (rank 8 on every projection), 2x2,
          d_model 256: each rank's measured peak, its optimizer-state bytes and the model's
          prediction, LoRA over full.
Results: bench/results/memory_{table,survival,lora}.json.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import bench_args, run_job, write_named  # noqa: E402
from elaswave.plan.memory import OPTIMIZER_BYTES, STATE_BYTES  # noqa: E402

LAYOUTS = [
    ("2x2 fp32 fast", ["parallel.dp=2", "parallel.pp=2"], False),
    ("1x3 bf16 deterministic, full checkpointing",
     ["parallel.dp=1", "parallel.pp=3", "train.precision=bf16", "train.activation_checkpointing=full"], True),
    ("4x1 bf16 fast, every_2", ["parallel.dp=4", "parallel.pp=1", "train.precision=bf16",
                                "train.activation_checkpointing=every_2"], False),
    # Wide enough that chunk padding is a small part of a rank's bytes: its bytes per parameter
    # are the table's (docs/memory.md, on a CPU).
    ("4x1 bf16 fast, d_model=256", ["parallel.dp=4", "parallel.pp=1", "train.precision=bf16", "model.d_model=256",
                                    "model.ffn_dim=1024", "train.activation_checkpointing=full"], False),
]
COMMON = ["train.steps=5", "train.measure_memory_step=3", "data.max_corpus_bytes=100000"]
SURVIVAL = ["model.preset=llama3-70b", "train.precision=bf16", "train.micro_batch_size=1",
            "train.num_micro_batches=64", "parallel.chunk_numel=16777216"]
SURVIVAL_LAYOUTS = [(8, 10), (6, 16), (8, 16), (10, 16), (16, 16), (4, 20), (6, 20), (8, 20), (16, 20), (2, 40), (3, 40), (8, 40)]


def table() -> dict:
    rows = []
    for name, sets, deterministic in LAYOUTS:
        records = run_job(sets + COMMON, deterministic=deterministic)
        s = next(r for r in records if r["event"] == "summary")
        for rank, measured, state, master in zip(s["ranks"], s["memory_measured_per_rank"],
                                                 s["optimizer_state_bytes_per_rank"], s["master_bytes_per_rank"]):
            p = measured["predicted"]
            rows.append({"layout": name, "rank": rank, "predicted": p, "measured_peak_bytes": measured["peak_bytes"],
                         "measured_at_step_start_bytes": measured["before_bytes"],
                         "ratio": p["total"] / measured["peak_bytes"],
                         # One generation of master + moments against 12 B x the ZeRO slot (what the model counts).
                         "state_bytes_measured": state + master,
                         "state_bytes_predicted": p["optimizer"] * STATE_BYTES / OPTIMIZER_BYTES,
                         # Static bytes per held parameter: what is alive at the step's start less
                         # the corpus, against the model's layers + optimizer + snapshots.
                         "static_bytes_per_parameter_measured": (measured["before_bytes"] - p["data"])
                         / measured["held_values"],
                         "static_bytes_per_parameter_predicted": (p["layers"] + p["optimizer"] + p["snapshots"])
                         / measured["held_values"]})
            print(f"{name:45s} rank {rank}: predicted {p['total'] / 2**20:6.2f} MiB (activations "
                  f"{p['activations'] / 2**20:5.2f}), measured {measured['peak_bytes'] / 2**20:6.2f} MiB, "
                  f"ratio {rows[-1]['ratio']:.3f}; static bytes per parameter predicted "
                  f"{rows[-1]['static_bytes_per_parameter_predicted']:.2f}, measured "
                  f"{rows[-1]['static_bytes_per_parameter_measured']:.2f}", flush=True)
    worst = max(abs(r["ratio"] - 1) for r in rows)
    print(f"table: worst |predicted/measured - 1| = {100 * worst:.1f} % over {len(rows)} ranks (goal <= 15 %)")
    return {"rows": rows, "worst_abs_error": worst, "within_15_percent": worst <= 0.15}


def survival() -> dict:
    from elaswave.sim.memory import survival as survive
    out = {}
    for ac in ("none", "every_2", "full"):
        rows = survive([*SURVIVAL, f"train.activation_checkpointing={ac}"], SURVIVAL_LAYOUTS, (80 - 8) * 1024)
        out[ac] = rows
        for r in rows:
            what = (f"peak {r['peak_gib']:.1f} GiB; after losing one stage: {r['after_loss']}"
                    + (f" (peak then {r['peak_after_gib']:.1f} GiB)" if "peak_after_gib" in r else "")
                    if r["starts"] else r["why"].split(": ", 1)[-1])
            print(f"llama3-70b {r['dp']}x{r['pp']} checkpointing={ac}: {'starts' if r['starts'] else 'does not start'}; "
                  f"{what}", flush=True)
    return out


LORA_JOB = ["parallel.dp=2", "parallel.pp=2", "model.d_model=256", "model.num_heads=8", "model.num_kv_heads=4",
            "model.ffn_dim=1024", "train.micro_batch_size=2", *COMMON]


def lora() -> dict:
    rows = {}
    for name, sets in (("full", []), ("lora", ["model.lora.rank=8"])):
        s = next(r for r in run_job(LORA_JOB + sets, deterministic=False) if r["event"] == "summary")
        rows[name] = [{"rank": rank, "peak_bytes": m["peak_bytes"], "predicted_bytes": m["predicted"]["total"],
                       "optimizer_state_bytes": state}
                      for rank, m, state in zip(s["ranks"], s["memory_measured_per_rank"],
                                                s["optimizer_state_bytes_per_rank"])]
    for full, tuned in zip(rows["full"], rows["lora"]):
        print(f"rank {full['rank']}: peak {tuned['peak_bytes'] / 2**20:7.2f} MiB with LoRA, "
              f"{full['peak_bytes'] / 2**20:7.2f} MiB full = {tuned['peak_bytes'] / full['peak_bytes']:.3f}; optimizer "
              f"state {tuned['optimizer_state_bytes'] / max(1, full['optimizer_state_bytes']):.4f} of full's; "
              f"predicted/measured {tuned['predicted_bytes'] / tuned['peak_bytes']:.3f} (LoRA), "
              f"{full['predicted_bytes'] / full['peak_bytes']:.3f} (full)")
    return {"job": LORA_JOB, "ranks": rows}


def main() -> None:
    ap = bench_args(__doc__, parts=("table", "survival", "lora"))
    args = ap.parse_args()
    write_named(args.what, {"table": table, "survival": survival, "lora": lora}, "memory")


if __name__ == "__main__":
    main()
