"""Issue 16's GPU checklist: bf16 training on one CUDA GPU. ``python bench/gpu/precision.py [--out DIR]``
writes DIR/gpu_precision.json (``--only step --shapes llama_1b``: a part; exits 0, measuring nothing, without CUDA; ``--device cpu`` runs every
item at toy size on this CPU to check the script itself, and writes nothing).

step:     the tiny Llama and a ~1B Llama (d=2048, 16 blocks, 32 / 8 heads, ffn 8192, byte vocabulary:
          973M parameters), dp=1 pp=1: elaswave in bf16 fast mode (bf16 layers, fp32 master shards)
          against transformers' model of the same shape in a plain loop as a real bf16 run is written
          (fp32 parameters under bf16 autocast, fused AdamW, SDPA, same micro-batches, clipping, loss
          scale); the loop runs before and after elaswave and the ratio is over their mean (goal <= 1.05x).
          Beside them elaswave fp32 and elaswave bf16 deterministic (its written-out attention,
          fixed-point gradient sums, CUDA's deterministic algorithms): bf16 over fp32, and what
          deterministic mode costs. MFU: 6 x the contract's forward multiply-adds per token x tokens per
          step / step time / the datasheet bf16 (or fp32) peak.
repeat:   elaswave bf16 deterministic twice on the GPU (tiny Llama, dropout on): every loss and
          params_sha256 equal?
staging:  a snapshot message (256 MiB) staged to pinned host memory on the side stream
          (snapshot/staging.py) while the compute stream is busy with ~0.3 s of matmuls: how long the
          host waits for it, against a plain ``.cpu()`` of the same message, which waits for the compute;
          the device checksum equals the int64 sum of the words on the host.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import RESULTS, run_parts, try_job  # noqa: E402
from bench.gpu.checklist_training import PEAKS, elaswave_row  # noqa: E402
from bench.gpu.llama import plain_step  # noqa: E402

BASE = ["parallel.dp=1", "parallel.pp=1", "model.arch=llama", "model.vocab_size=256", "model.dropout=0"]
SHAPES = {
    "llama_tiny": ["parallel.dp=1", "parallel.pp=1", "model.preset=llama-tiny", "model.dropout=0", "model.seq_len=256", "train.micro_batch_size=8",
                   "train.num_micro_batches=4", "train.steps=30"],
    "llama_1b": BASE + ["model.d_model=2048", "model.num_heads=32", "model.num_kv_heads=8", "model.num_blocks=16",
                        "model.ffn_dim=8192", "model.seq_len=512", "model.tie_embeddings=false",
                        "train.micro_batch_size=4", "train.num_micro_batches=4", "train.steps=20"],
}
TOY = BASE + ["model.d_model=64", "model.num_heads=4", "model.num_kv_heads=2", "model.num_blocks=2", "model.ffn_dim=128",
              "model.seq_len=32", "train.micro_batch_size=2", "train.num_micro_batches=2", "train.steps=8"]


def _trained_flops(sets: list[str]) -> float:
    from elaswave import config
    from elaswave.model.registry import model_for
    cfg = config.load(None, sets)
    t = cfg.train
    tokens = t.num_micro_batches * t.micro_batch_size * cfg.model.seq_len
    return 6.0 * sum(c.flops_per_token for c in model_for(cfg).layer_costs()) * tokens


def step(device: str, shapes: list[str]) -> dict:
    peaks = PEAKS["PCIe" if "PCIe" in (torch.cuda.get_device_name() if device == "cuda" else "") else "SXM"]
    out = {}
    for name, shape in ({"toy": TOY} if device == "cpu" else {k: SHAPES[k] for k in shapes}).items():
        rows = {"plain_bf16_before": plain_step(shape, bf16=True, device=device)}
        for row, (precision, det) in {"elaswave_bf16_fast": ("bf16", False), "elaswave_fp32_fast": ("fp32", False),
                                      "elaswave_bf16_deterministic": ("bf16", True)}.items():
            # Step 2's peak beside the memory model's prediction (a bf16 1B run ran out of 80 GiB once).
            rows[row] = elaswave_row(shape + [f"train.precision={precision}", "train.measure_memory_step=2"], det,
                                     timeout_s=540)
        rows["plain_bf16_after"] = plain_step(shape, bf16=True, device=device)
        base = statistics.mean(rows[k]["step_time_s"] for k in ("plain_bf16_before", "plain_bf16_after"))
        flops = _trained_flops(shape)
        for row_name, row in rows.items():
            if "step_time_s" in row:
                peak = peaks["fp32"] if "fp32" in row_name else peaks["bf16"]
                row.update(over_plain_bf16=row["step_time_s"] / base, tflops=flops / row["step_time_s"] / 1e12,
                           mfu=flops / row["step_time_s"] / 1e12 / peak)
        ratios = {}
        for ratio, (a, b) in {"bf16_over_fp32": ("elaswave_bf16_fast", "elaswave_fp32_fast"),
                              "deterministic_over_fast": ("elaswave_bf16_deterministic", "elaswave_bf16_fast")}.items():
            if "step_time_s" in rows[a] and "step_time_s" in rows[b]:
                ratios[ratio] = rows[a]["step_time_s"] / rows[b]["step_time_s"]
        out[name] = {"job": shape, "model_tflop_per_step": flops / 1e12, "peaks_tflops": peaks, "rows": rows, **ratios}
        print(name, json.dumps(out[name], indent=1), flush=True)
    return out


def repeat(device: str, shapes: list[str]) -> dict:
    shape = (TOY if device == "cpu" else SHAPES["llama_tiny"][:-1] + ["train.steps=20"]) + ["model.dropout=0.1",
                                                                                             "train.precision=bf16"]
    runs = [try_job("run", shape, True) for _ in range(2)]
    return {"job": shape, "exit_codes": [r["exit_code"] for r in runs], "errors": [r["error"] for r in runs],
            "losses_equal": runs[0]["losses"] == runs[1]["losses"] and bool(runs[0]["losses"]),
            "params_sha256_equal": runs[0]["sha"] == runs[1]["sha"] and runs[0]["sha"] is not None}


def staging(device: str, shapes: list[str]) -> dict:
    from elaswave.snapshot.staging import HostStaging, word_sum
    if device != "cuda":
        return {"skipped": "CUDA only: on CPU the received buffer is kept as it is"}
    dev = torch.device("cuda")
    message = torch.randint(0, 256, (256 << 20,), dtype=torch.uint8, device=dev)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def busy() -> float:
        """Queue about 0.3 s of matmuls on the compute stream; returns their time alone."""
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(300):
            a @ a
        torch.cuda.synchronize()
        return time.perf_counter() - began

    compute_s = busy()
    staging_ = HostStaging(dev)
    rows = []
    for _ in range(3):
        for _ in range(300):
            a @ a
        began = time.perf_counter()
        staged = staging_.start(message, 64)
        staged.wait()
        side_s = time.perf_counter() - began
        torch.cuda.synchronize()
        for _ in range(300):
            a @ a
        began = time.perf_counter()
        message.cpu()
        plain_s = time.perf_counter() - began
        torch.cuda.synchronize()
        rows.append({"side_stream_wait_s": side_s, "plain_cpu_wait_s": plain_s})
        staging_.recycle(staged.kept)
    host_sum = int(staged.kept[64:].view(torch.int32).to(torch.int64).sum())
    return {"message_bytes": message.numel(), "compute_alone_s": compute_s, "rounds": rows,
            "side_stream_wait_s": statistics.median(r["side_stream_wait_s"] for r in rows),
            "plain_cpu_wait_s": statistics.median(r["plain_cpu_wait_s"] for r in rows),
            "device_checksum_equals_host": int(staged.check) == host_sum == int(word_sum(message[64:]))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--only", default="step,repeat,staging")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="of step: " + ", ".join(SHAPES))
    args = ap.parse_args()
    items, shapes = {"step": step, "repeat": repeat, "staging": staging}, args.shapes.split(",")
    for flag, given, valid in (("--only", args.only.split(","), items), ("--shapes", shapes, SHAPES)):
        if set(given) - set(valid):
            ap.error(f"{flag} {','.join(given)}: unknown {', '.join(sorted(set(given) - set(valid)))}; "
                     f"valid: {', '.join(valid)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/gpu/precision.py: no CUDA device here; nothing measured")
        return 0
    doc = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (a check of the script)",
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    run_parts(doc, {name: functools.partial(items[name], args.device, shapes) for name in args.only.split(",")},
              Path(args.out) / "gpu_precision.json" if args.device == "cuda" else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
