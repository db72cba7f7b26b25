"""Real models on elaswave, measured: ``python bench/training/llama.py step|rss|all [--runs N]``.

step: the tiny Llama (GQA, fast mode, fused attention) trained by elaswave at dp=2 x pp=1 against
      the same-shaped transformers LlamaForCausalLM in a plain PyTorch DDP loop on the same two
      ranks (bench/training/hf_ddp.py under torchrun), same micro-batches, clipping and AdamW. Runs
      alternate, the ratio is the median over pairs of medians; the first 3 steps are warm-up.
rss:  a >= 1 GB Hugging Face directory (made here with transformers, random weights) loaded with
      ``train.steps=0`` at pp=1 and at pp=4: peak RSS per rank from the job's summary.
Results: bench/results/llama_*.json|md.
"""
from __future__ import annotations

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
from bench.common import ROOT, bench_args, free_port, run_job, set_flags, write_named  # noqa: E402

STEP_JOB = ["model.preset=llama-tiny", "model.dropout=0", "model.d_model=128", "model.num_heads=4", "model.num_kv_heads=2",
            "model.ffn_dim=384", "model.seq_len=128", "train.micro_batch_size=4", "train.num_micro_batches=8",
            "train.steps=20", "data.max_corpus_bytes=400000", "elastic.straggler_gain=0"]
WARMUP = 3


def _elaswave_step(sets) -> float:
    records = run_job([*sets, "parallel.dp=2", "parallel.pp=1"])
    return statistics.median(r["step_time_s"] for r in records if r["event"] == "step" and r["step"] >= WARMUP)


def _ddp_step(sets) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ddp.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
               str(HERE / "hf_ddp.py"), "--out", str(out)] + set_flags(sets)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT,
                              env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)))
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-3000:])
        return statistics.median(json.loads(out.read_text())["step_times_s"][WARMUP:])


def step(runs: int) -> dict:
    pairs = []
    for _ in range(runs):
        ours, theirs = _elaswave_step(STEP_JOB), _ddp_step(STEP_JOB)
        pairs.append({"elaswave_s": ours, "ddp_transformers_s": theirs, "ratio": ours / theirs})
        print(f"step: elaswave {ours:.4f} s, DDP+transformers {theirs:.4f} s, ratio {ours / theirs:.3f}", flush=True)
    return {"job": STEP_JOB, "pairs": pairs, "median_ratio": statistics.median(p["ratio"] for p in pairs)}


def big_hf_dir(path: Path) -> int:
    import torch
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=8,
                                   num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=256)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, max_shard_size="400MB")
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def rss() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        size = big_hf_dir(hf)
        out = {"hf_dir_bytes": size}
        for pp in (1, 4):
            began = time.perf_counter()
            records = run_job([f"model.init_from={hf}", "model.seq_len=16", "train.steps=0", "parallel.dp=1",
                               f"parallel.pp={pp}", "train.num_micro_batches=1", "train.micro_batch_size=1",
                               "data.max_corpus_bytes=100000", "data.source=stdlib"])
            summary = next(r for r in records if r["event"] == "summary")
            out[f"pp{pp}"] = {"peak_rss_bytes_per_rank": summary["peak_rss_bytes_per_rank"],
                              "wall_s": time.perf_counter() - began}
            print(f"rss: pp={pp} peak RSS per rank (MB) "
                  f"{[round(b / 2 ** 20) for b in summary['peak_rss_bytes_per_rank']]}", flush=True)
    return out


def main() -> int:
    ap = bench_args(__doc__, runs=5, parts=("step", "rss"))
    args = ap.parse_args()
    write_named(args.what, {"step": lambda: step(args.runs), "rss": rss}, "llama", indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
