"""The GPU checklist: what elaswave's parts, and elaswave itself, do on one CUDA GPU.

    python bench/gpu.py [--out DIR] [--quick]   # measure: DIR/gpu.json (raw) and DIR/gpu.md (tables)
    python bench/gpu.py --page                  # BENCHMARKS.md's GPU section from bench/results/gpu.json

Seven independent items (one that fails records its error; the rest still run):
1 nccl: a world-size-1 ProcessGroupNCCL from elaswave's comm/backend.py over a TCPStore and a HashStore;
  all-reduce, all-gather, reduce-scatter checked; time to construct it and to its first collective
  (where NCCL builds its communicator). Two ranks on the one GPU, through NCCL and through `elaswave run`.
2 matmul: n^3 products in bf16, fp32 (TF32 off: torch's default, what elaswave trains in) and TF32;
  TFLOP/s and the relative error against float64.
3 attention: scaled_dot_product_attention with the flash and the memory-efficient kernel forced,
  against the written-out causal attention of elaswave's Block; forward+backward time, peak memory,
  difference from written-out fp32; same bits over repeats; behaviour under deterministic algorithms.
4 determinism: `elaswave run --deterministic` (dp=1 pp=1) twice on the GPU and `elaswave reference
  --deterministic` on this machine's CPU; every loss and params_sha256 compared.
5 step time: one GPT trained by elaswave (dp=1 pp=1, fast mode, elastic on and off) and by a plain
  loop (nn.ModuleList of the same layers, AdamW, same micro-batches and clipping), and the plain loop
  in bf16 autocast with fused attention and fused AdamW (what a real run would do).
6 mfu: model FLOPs per step / step time / the datasheet peak of each precision.
7 nvml: name, power, clocks, application clocks, whether setting them is restricted; elaswave's NVML
  actuator. Read-only: lent machines must be left as found, so no clock is set, and whether a set
  would be allowed is read from NVML's API restriction instead.

Timing: kernels with CUDA events, the median of repeats after warm-up; training steps on the host
clock (each step ends in a synchronisation), the median after WARMUP_STEPS. Without CUDA it says so,
writes nothing and exits 0.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
WARMUP_STEPS = 5
# Datasheet dense peaks, TFLOP/s (no sparsity).
PEAKS = {"SXM": {"fp32": 67.0, "tf32": 494.0, "bf16": 989.0}, "PCIe": {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0}}
STEP_JOB = ["parallel.dp=1", "parallel.pp=1", "model.d_model=512", "model.num_heads=8", "model.num_blocks=8",
            "model.seq_len=256", "train.micro_batch_size=8", "train.num_micro_batches=4"]


def _median_ms(fn, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _short(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def _tail(text: str) -> str:
    """The first two lines that name an error, and the last line (progress bars and warnings left out)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and "%|" not in ln and "Warning" not in ln]
    errors = [ln for ln in lines if "error" in ln.lower()][:2]
    return " | ".join(errors + [ln for ln in lines[-1:] if ln not in errors])[-600:]


def environment() -> dict:
    p, nccl = torch.cuda.get_device_properties(0), torch.cuda.nccl.version()
    env = {"device": p.name, "capability": f"{p.major}.{p.minor}", "sm_count": p.multi_processor_count,
           "memory_gib": round(p.total_memory / 2 ** 30, 1), "torch": torch.__version__, "cuda": torch.version.cuda,
           "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl), "python": platform.python_version(),
           "cpus": os.cpu_count(), "date": datetime.date.today().isoformat()}
    try:
        import pynvml
        pynvml.nvmlInit()
        env["driver"] = pynvml.nvmlSystemGetDriverVersion()
    except Exception as exc:  # noqa: BLE001 - recorded, not fatal
        env["driver"] = f"unknown ({_short(exc)})"
    return env


# -- 1. NCCL -----------------------------------------------------------------------------------------
TWO_RANKS = """import sys, torch, torch.distributed as dist
from elaswave.comm import backend
rank, device = int(sys.argv[1]), torch.device("cuda", 0)
torch.cuda.set_device(device)
pg = backend.make_process_group(dist.FileStore(sys.argv[2], 2), "two", rank, 2, "nccl", 30.0, device)
x = torch.ones(4, device=device)
backend.wait(backend.all_reduce(pg, x), 30.0, "all-reduce")
print("all-reduce gave", x.tolist(), flush=True)
"""


def item_nccl(quick: bool) -> dict:
    from datetime import timedelta

    import torch.distributed as dist

    from elaswave.comm import backend

    name, device = backend.choose("auto")
    out = {"backend_auto_chooses": name, "gpus_visible": torch.cuda.device_count(), "stores": {}}
    for kind in ("TCPStore", "HashStore"):
        store = (dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=60)) if kind == "TCPStore" else dist.HashStore())
        began = time.perf_counter()
        pg = backend.make_process_group(store, "gpu-bench", 0, 1, "nccl", 60.0, device)
        construct_s = time.perf_counter() - began
        x = torch.arange(1 << 20, dtype=torch.float32, device=device) * 1.5
        expect = x.clone()
        began = time.perf_counter()
        backend.wait(backend.all_reduce(pg, x), 60.0, "all-reduce")
        torch.cuda.synchronize()
        first_s = time.perf_counter() - began
        gathered, scattered = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))  # poisoned
        backend.wait(backend.all_gather(pg, gathered, expect), 60.0, "all-gather")
        backend.wait(backend.reduce_scatter(pg, scattered, expect), 60.0, "reduce-scatter")
        torch.cuda.synchronize()
        out["stores"][kind] = {"construct_s": construct_s, "first_all_reduce_s": first_s,
                               "all_reduce_correct": torch.equal(x, expect),
                               "all_gather_correct": torch.equal(gathered, expect),
                               "reduce_scatter_correct": torch.equal(scattered, expect)}
        if hasattr(pg, "shutdown"):
            pg.shutdown()
    # Two ranks on the one GPU: straight through NCCL, then through elaswave's launcher.
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTHONPATH=str(ROOT), NCCL_DEBUG="WARN")
        procs = [subprocess.Popen([sys.executable, "-c", TWO_RANKS, str(r), os.path.join(tmp, "store")], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
        res = []
        for p in procs:
            try:
                res.append({"exit_code": p.wait(timeout=60), "output": _tail(p.stdout.read())})
            except subprocess.TimeoutExpired:
                p.kill()
                res.append({"exit_code": "hung for 60 s; killed", "output": ""})
        out["two_ranks_one_gpu_nccl"] = res
    run = _elaswave("run", ["parallel.dp=2", "parallel.pp=1", "train.steps=2", "train.num_micro_batches=2",
                            "elastic.enabled=false", "parallel.timeout_s=30"], False, timeout_s=90)
    out["two_ranks_one_gpu_elaswave"] = {"exit_code": run["exit_code"], "steps": len(run["losses"]), "error": run["error"]}
    return out


# -- 2. matmul ---------------------------------------------------------------------------------------
def item_matmul(quick: bool) -> dict:
    rows = []
    try:
        for n in [4096] if quick else [4096, 8192]:
            for label, dtype, precision in (("bf16", torch.bfloat16, "highest"), ("fp32", torch.float32, "highest"),
                                            ("tf32", torch.float32, "high")):
                torch.set_float32_matmul_precision(precision)
                # Random data (zeros run faster) in two input sets, alternated.
                sets = [[torch.randn(n, n, device="cuda", dtype=dtype) for _ in range(2)] for _ in range(2)]
                turn = iter(range(10 ** 9))
                ms = _median_ms(lambda: torch.mm(*sets[next(turn) % 2]), warmup=3, reps=6 if quick else 12)
                a, b = sets[0]
                ref = a.double() @ b.double()
                rel = float(torch.linalg.norm(torch.mm(a, b).double() - ref) / torch.linalg.norm(ref))
                rows.append({"n": n, "precision": label, "ms": ms, "tflops": 2 * n ** 3 / ms / 1e9, "rel_err_vs_fp64": rel})
                del sets, a, b, ref
    finally:
        torch.set_float32_matmul_precision("highest")
    return {"rows": rows}


# -- 3. attention ------------------------------------------------------------------------------------
def written_attention(q, k, v, mask):
    """elaswave's Block: softmax(QK^T / sqrt(d)) masked causal, times V (its dropout left out here)."""
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    return att.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v


def _sdpa(kernel):
    from torch.nn.attention import sdpa_kernel

    def attend(q, k, v, mask):
        with sdpa_kernel(kernel):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return attend


def item_attention(quick: bool) -> dict:
    from torch.nn.attention import SDPBackend

    warnings.filterwarnings("ignore", category=UserWarning)  # sdpa_kernel explains every refusal at length
    impls = {"written": written_attention, "flash": _sdpa(SDPBackend.FLASH_ATTENTION),
             "mem_efficient": _sdpa(SDPBackend.EFFICIENT_ATTENTION)}
    batch, heads, head_dim = 4, 32, 128
    rows, repeatable = [], {}
    for seq in [2048] if quick else [2048, 4096]:
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device="cuda"), diagonal=1)
        base = [torch.randn(batch, heads, seq, head_dim, device="cuda") for _ in range(4)]  # q, k, v, grad out
        q, k, v = (t.clone().requires_grad_() for t in base[:3])
        ref = written_attention(q, k, v, mask)  # the yardstick: elaswave's arithmetic in fp32
        ref.backward(base[3])
        ref, ref_dq = ref.detach(), q.grad
        del q, k, v
        for dtype in (torch.bfloat16, torch.float32):
            q, k, v = (t.to(dtype).requires_grad_() for t in base[:3])
            g = base[3].to(dtype)
            for name, attend in impls.items():
                row = {"seq": seq, "dtype": str(dtype).removeprefix("torch."), "impl": name}
                rows.append(row)

                def step():
                    q.grad = k.grad = v.grad = None
                    out = attend(q, k, v, mask)
                    out.backward(g)
                    return out
                try:
                    q.grad = k.grad = v.grad = None
                    torch.cuda.synchronize()
                    held = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    out = step()
                    torch.cuda.synchronize()
                    row["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - held) / 2 ** 30
                    row["max_abs_diff_out"] = float((out.float() - ref).abs().max())
                    row["max_abs_diff_dq"] = float((q.grad.float() - ref_dq).abs().max())
                    del out
                    row["fwd_bwd_ms"] = _median_ms(step, warmup=2, reps=3 if quick else 8)
                    if seq == 2048 and dtype == torch.bfloat16:
                        repeatable[name] = _repeatable(step, q, k, v)
                except Exception as exc:  # noqa: BLE001 - flash has no fp32 kernel; an OOM is a finding too
                    row["error"] = _short(exc)
                torch.cuda.empty_cache()
            del q, k, v, g
        del base, ref, ref_dq, mask
        torch.cuda.empty_cache()
    return {"shape": f"batch {batch}, heads {heads}, head_dim {head_dim}, causal", "rows": rows,
            "same_bits_4_runs_bf16_seq2048": repeatable, "under_deterministic_algorithms": _under_deterministic(impls)}


def _repeatable(step, q, k, v, runs: int = 4) -> dict:
    """Whether ``runs`` forward+backward passes on the same inputs give the same bits."""
    first, same = None, {}
    for _ in range(runs):
        got = {"out": step().detach(), "dq": q.grad.clone(), "dk": k.grad.clone(), "dv": v.grad.clone()}
        first = first or got
        same = {key: same.get(key, True) and torch.equal(got[key], first[key]) for key in got}
    return same


def _under_deterministic(impls) -> dict:
    """Each kernel under torch.use_deterministic_algorithms(True) (bf16, batch 4, heads 32, seq 2048):
    whether it runs, and whether 4 runs then give the same bits."""
    res = {}
    q, k, v = (torch.randn(4, 32, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn_like(q)
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device="cuda"), diagonal=1)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS refuses deterministic mode without it
    torch.use_deterministic_algorithms(True)
    try:
        for name, attend in impls.items():
            def step():
                q.grad = k.grad = v.grad = None
                out = attend(q, k, v, mask)
                out.backward(g)
                return out
            try:
                res[name] = _repeatable(step, q, k, v)
            except Exception as exc:  # noqa: BLE001
                res[name] = _short(exc)
    finally:
        torch.use_deterministic_algorithms(False)
    return res


# -- elaswave as a user runs it ----------------------------------------------------------------------
def _elaswave(command: str, sets: list[str], deterministic: bool, timeout_s: float = 150) -> dict:
    """``python -m elaswave.cli COMMAND`` with this checkout on PYTHONPATH (the launcher hands its
    environment to the workers): every step record, the summary, and the error if it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        cmd = [sys.executable, "-m", "elaswave.cli", command, "--metrics-out", metrics]
        cmd += [x for s in sets for x in ("--set", s)] + (["--deterministic"] if deterministic else [])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        began = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
            code, err = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as exc:
            code, err = 124, f"timed out after {timeout_s} s: " + (exc.stderr or b"").decode(errors="replace")
        records = [json.loads(line) for line in open(metrics)] if os.path.exists(metrics) else []
    steps = [r for r in records if r.get("event") == "step"]
    return {"exit_code": code, "wall_s": time.perf_counter() - began, "steps": steps, "losses": [r["loss"] for r in steps],
            "sha": next((r["params_sha256"] for r in records if r.get("event") == "summary"), None),
            "error": _tail(err) if code else None}


def _same(a: dict, b: dict) -> bool:
    """Every loss and the final parameters bit-identical (and both runs finished)."""
    return bool(a["losses"]) and a["losses"] == b["losses"] and a["sha"] is not None and a["sha"] == b["sha"]


def _max_diff(a: dict, b: dict) -> float | None:
    n = len(a["losses"])
    return max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) if n and n == len(b["losses"]) else None


# -- 4. determinism ----------------------------------------------------------------------------------
def item_determinism(quick: bool) -> dict:
    job = ["parallel.dp=1", "parallel.pp=1", "train.steps=20"]
    gpu = [_elaswave("run", job + ["parallel.backend=nccl"], True) for _ in range(2)]
    cpu = _elaswave("reference", job, True)
    runs = {"gpu_run_1": gpu[0], "gpu_run_2": gpu[1], "cpu_reference": cpu}
    out = {"job": job + ["--deterministic"], "gpu_runs_identical": _same(*gpu), "gpu_equals_cpu": _same(gpu[0], cpu),
           "max_loss_diff_gpu_vs_cpu": _max_diff(gpu[0], cpu),
           "first_loss_gpu_cpu": [r["losses"][0] if r["losses"] else None for r in (gpu[0], cpu)]}
    if not quick:  # the GPU draws dropout masks from CUDA's Philox stream: without dropout, arithmetic alone
        for name, command in (("gpu_dropout0", "run"), ("cpu_dropout0", "reference")):
            runs[name] = _elaswave(command, job + ["model.dropout=0"], True)
        out["dropout0_gpu_equals_cpu"] = _same(runs["gpu_dropout0"], runs["cpu_dropout0"])
        out["dropout0_max_loss_diff"] = _max_diff(runs["gpu_dropout0"], runs["cpu_dropout0"])
    out["runs"] = {n: {"exit_code": r["exit_code"], "steps": len(r["losses"]), "params_sha256": r["sha"],
                       "wall_s": r["wall_s"], "error": r["error"]} for n, r in runs.items()}
    return out


# -- 5. step time against a plain loop ---------------------------------------------------------------
def _sdpa_block_forward(self, x, gen):
    """elaswave's Block with fused causal attention and torch's own dropout (the 'real run' variant)."""
    b, t, d = x.shape
    p = self.p if gen is not None else 0.0
    q, k, v = (z.view(b, t, self.num_heads, d // self.num_heads).transpose(1, 2)
               for z in self.qkv(self.ln1(x)).split(d, dim=2))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p).transpose(1, 2).reshape(b, t, d)
    x = x + F.dropout(self.proj(y), p)
    return x + F.dropout(self.out(F.gelu(self.fc(self.ln2(x)))), p)


def plain_loop(sets: list[str], steps: int, fast: bool = False, device: str = "cuda") -> dict:
    """One process, no elaswave runtime: the same layers, data, loss scaling, clipping, LR schedule
    and AdamW (decay on matrices only). ``fast``: bf16 autocast, fused attention, fused AdamW."""
    from torch import nn

    from elaswave import config
    from elaswave.data.corpus import load_corpus
    from elaswave.data.sampler import Sampler
    from elaswave.model.gpt import build_layer, token_loss_sum
    from elaswave.zero.optimizer import lr_at

    cfg = config.load(None, sets)
    m, t = cfg.model, cfg.train
    layers = nn.ModuleList(build_layer(m, i, t.seed) for i in range(m.num_layers)).to(device)
    for block in list(layers)[1:-1] if fast else []:
        block.forward = types.MethodType(_sdpa_block_forward, block)
    params = list(layers.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=fast or None)
    sampler = Sampler(load_corpus(cfg.data, m.vocab_size, m.seq_len + 1), t.seed, t.micro_batch_size, m.seq_len)
    gen = torch.Generator(device=device)
    gen.manual_seed(t.seed)
    global_tokens = t.num_micro_batches * t.micro_batch_size * m.seq_len
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def train_step(step: int) -> float:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, t)
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for mb in range(t.num_micro_batches):
            batch = sampler.micro_batch(step, mb)
            x = batch.inputs.to(device)
            with torch.autocast(device, torch.bfloat16, enabled=fast):
                for layer in layers:
                    x = layer(x, gen)
            loss_sum = token_loss_sum(x.float(), batch.targets.to(device))
            (loss_sum / global_tokens).backward()
            total += loss_sum.detach()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        opt.step()
        return float(total) / global_tokens

    times, losses = [], []
    for step in range(steps):
        sync()
        started = time.perf_counter()
        losses.append(train_step(step))
        sync()
        times.append(time.perf_counter() - started)
    res = {"step_time_s": statistics.median(times[WARMUP_STEPS:]), "final_loss": losses[-1], "losses": losses}
    if device == "cuda":
        try:  # how much of the step the GPU spends in kernels: the rest it waits for the host
            res["gpu_busy_fraction"] = _gpu_busy(lambda: [train_step(s) for s in range(steps - 3, steps)])
        except Exception as exc:  # noqa: BLE001
            res["gpu_busy_fraction"] = _short(exc)
    return res


def _gpu_busy(fn) -> float:
    """Kernel (and copy) time recorded by the profiler over the wall time of ``fn`` (profiler on)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall_s = time.perf_counter() - began
    busy_us = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages())
    return busy_us / 1e6 / wall_s


def item_step_time(quick: bool) -> dict:
    steps = 15 if quick else 40
    job = STEP_JOB + [f"train.steps={steps}"]
    rows = {"plain_fp32_before": plain_loop(job, steps)}
    variants = {"elaswave_fast": job}
    if not quick:  # elasticity's share; and the clipping norm's per-chunk cost, with 256x fewer chunks
        variants.update(elaswave_fast_elastic_off=job + ["elastic.enabled=false"],
                        elaswave_fast_chunk_1m=job + ["parallel.chunk_numel=1048576"])
    for name, sets in variants.items():
        res = _elaswave("run", sets, False, timeout_s=240)
        kept = res["steps"][WARMUP_STEPS:]
        rows[name] = {"exit_code": res["exit_code"], "error": res["error"], "steps": len(res["steps"])}
        if kept:
            rows[name].update(step_time_s=statistics.median(r["step_time_s"] for r in kept), final_loss=res["losses"][-1],
                              phases_s={k: statistics.median(r["phases_s"][k] for r in kept) for k in kept[0]["phases_s"]})
    rows["plain_fp32_after"] = plain_loop(job, steps)  # the same baseline again: drift shows as a difference
    if not quick:
        rows["plain_bf16_sdpa"] = plain_loop(job, steps, fast=True)
    plain = statistics.mean(rows[k]["step_time_s"] for k in ("plain_fp32_before", "plain_fp32_after"))
    for row in rows.values():
        row.pop("losses", None)
        if "step_time_s" in row:
            row["over_plain_fp32"] = row["step_time_s"] / plain
    return {"job": job, "warmup_steps_dropped": WARMUP_STEPS, "rows": rows}


# -- 6. MFU ------------------------------------------------------------------------------------------
def item_mfu(step_item: dict | None, env: dict) -> dict:
    from elaswave import config

    if not step_item:
        raise RuntimeError("needs item 5's step times, which did not run")
    cfg = config.load(None, STEP_JOB)
    m, t = cfg.model, cfg.train
    tokens = t.num_micro_batches * t.micro_batch_size * m.seq_len
    # Non-embedding parameters: the blocks (12 d^2 + 13 d each) and the head (LayerNorm, d x vocab).
    n = m.num_blocks * (12 * m.d_model ** 2 + 13 * m.d_model) + 2 * m.d_model + m.d_model * m.vocab_size
    flops = 6 * n * tokens + 12 * m.num_blocks * m.d_model * m.seq_len * tokens
    peaks = PEAKS["PCIe" if "PCIe" in env.get("device", "") else "SXM"]
    rows = {name: {"tflops": flops / row["step_time_s"] / 1e12, **{f"of_{p}_peak": flops / row["step_time_s"] / 1e12 / peak
                                                                  for p, peak in peaks.items()}}
            for name, row in step_item["rows"].items() if "step_time_s" in row}
    return {"formula": "6 N T + 12 L d S T (N non-embedding parameters, T tokens per step, L blocks, d model width, "
                       "S sequence; attention over the full S x S)", "non_embedding_params": n, "tokens_per_step": tokens,
            "model_tflop_per_step": flops / 1e12, "peaks_tflops": peaks, "rows": rows}


# -- 7. NVML -----------------------------------------------------------------------------------------
def item_nvml(quick: bool) -> dict:
    import pynvml as nv

    from elaswave.runtime.actuator import NvmlActuator

    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)

    def read(fn, *args, scale=1):
        try:
            value = fn(h, *args)
            return value / scale if scale != 1 else value
        except nv.NVMLError as exc:
            return f"NVMLError: {exc}"
    mem_clocks = read(nv.nvmlDeviceGetSupportedMemoryClocks)
    graphics = read(nv.nvmlDeviceGetSupportedGraphicsClocks, mem_clocks[0]) if isinstance(mem_clocks, list) else []
    graphics = graphics if isinstance(graphics, list) else []
    restricted = read(nv.nvmlDeviceGetAPIRestriction, nv.NVML_RESTRICTED_API_SET_APPLICATION_CLOCKS)
    out = {"name": read(nv.nvmlDeviceGetName), "power_draw_w": read(nv.nvmlDeviceGetPowerUsage, scale=1e3),
           "power_limit_w": read(nv.nvmlDeviceGetPowerManagementLimit, scale=1e3),
           "sm_clock_mhz": read(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_SM),
           "sm_clock_max_mhz": read(nv.nvmlDeviceGetMaxClockInfo, nv.NVML_CLOCK_SM),
           "app_clock_sm_mhz": read(nv.nvmlDeviceGetApplicationsClock, nv.NVML_CLOCK_SM),
           "default_app_clock_sm_mhz": read(nv.nvmlDeviceGetDefaultApplicationsClock, nv.NVML_CLOCK_SM),
           "supported_memory_clocks_mhz": mem_clocks, "supported_graphics_clocks": len(graphics),
           "graphics_clock_range_mhz": [min(graphics), max(graphics)] if graphics else None,
           "set_app_clocks_root_only": restricted == nv.NVML_FEATURE_ENABLED if isinstance(restricted, int) else restricted,
           "running_as_root": os.geteuid() == 0, "clock_set_attempted": False}
    # elaswave's actuator: its constructor only reads; apply() and close() set and reset application
    # clocks, which are not ours to change here, so the clocks it would pick are computed instead.
    try:
        act = NvmlActuator(torch.device("cuda", 0))
        pick = {str(lv): max((c for c in act.clocks if c <= act.nominal * lv), default=act.clocks[0])
                for lv in (0.7, 0.85, 1.0, 1.15)}
        out["actuator"] = {"constructs": True, "nominal_mhz": act.nominal, "mem_clock_mhz": act.mem_clock,
                           "levels": len(act.clocks), "would_set_mhz": pick}
    except Exception as exc:  # noqa: BLE001
        out["actuator"] = {"constructs": False, "error": _short(exc)}
    return out


# -- the report --------------------------------------------------------------------------------------
def _f(x, digits=3):
    return "-" if x is None else f"{x:.{digits}g}" if isinstance(x, float) else str(x)


def _table(head: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)] + [
        "| " + " | ".join(map(_f, r)) + " |" for r in rows]


def markdown(doc: dict) -> list[str]:
    env, items = doc["env"], doc["items"]
    out = [f"`python bench/gpu.py{' --quick' if doc['quick'] else ''}` on {env['date']}: {env['device']} "
           f"({env['sm_count']} SMs, {env['memory_gib']} GiB), driver {env['driver']}, torch {env['torch']}, "
           f"CUDA {env['cuda']}, NCCL {env['nccl']}, "
           f"Python {env['python']}, {env['cpus']} CPUs; {doc.get('wall_s', 0):.0f} s.", ""]
    titles = {"nccl": "1. NCCL", "matmul": "2. Matrix products", "attention": "3. Fused against written-out attention",
              "determinism": "4. Deterministic mode on CUDA", "step_time": "5. Step time against a plain PyTorch loop",
              "mfu": "6. Model FLOPs utilisation", "nvml": "7. NVML"}
    for key, title in titles.items():
        out += [f"### {title}", ""]
        item = items.get(key, {"error": "not run"})
        if "result" not in item:
            out += [f"Failed: `{item['error']}`", ""]
            continue
        r = item["result"]
        if key == "nccl":
            out += _table(["world size 1, store", "construct (s)", "first all-reduce (s)", "all-reduce ok", "all-gather ok",
                           "reduce-scatter ok"], [[k, v["construct_s"], v["first_all_reduce_s"], v["all_reduce_correct"],
                                                  v["all_gather_correct"], v["reduce_scatter_correct"]]
                                                 for k, v in r["stores"].items()])
            two = r["two_ranks_one_gpu_elaswave"]
            out += ["", f"GPUs visible: {r['gpus_visible']}. Two NCCL ranks on this one GPU: "
                        + "; ".join(f"rank {i} exit {x['exit_code']}: `{x['output']}`"
                                    for i, x in enumerate(r["two_ranks_one_gpu_nccl"]))
                    + f". `elaswave run` with dp=2: exit {two['exit_code']}, {two['steps']} steps: `{two['error']}`."]
        elif key == "matmul":
            out += _table(["n", "precision", "ms", "TFLOP/s", "rel. error vs fp64"],
                          [[x["n"], x["precision"], x["ms"], x["tflops"], x["rel_err_vs_fp64"]] for x in r["rows"]])
        elif key == "attention":
            out += [f"{r['shape']}; forward+backward; differences from written-out attention in fp32.", ""]
            out += _table(["seq", "dtype", "kernel", "fwd+bwd (ms)", "peak extra (GiB)", "max abs diff out",
                           "max abs diff dq", "error"],
                          [[x["seq"], x["dtype"], x["impl"], x.get("fwd_bwd_ms"), x.get("peak_extra_gib"),
                            x.get("max_abs_diff_out"), x.get("max_abs_diff_dq"), x.get("error", "")] for x in r["rows"]])
            out += ["", f"Same bits over 4 runs (bf16, seq 2048): `{json.dumps(r['same_bits_4_runs_bf16_seq2048'])}`.",
                    "", "The same with `torch.use_deterministic_algorithms(True)`: "
                        f"`{json.dumps(r['under_deterministic_algorithms'])}`."]
        elif key == "determinism":
            out += _table(["run", "exit", "steps", "params_sha256", "wall (s)", "error"],
                          [[k, v["exit_code"], v["steps"], (v["params_sha256"] or "-")[:16], v["wall_s"], v["error"] or ""]
                           for k, v in r["runs"].items()])
            out += ["", f"`{' '.join(r['job'])}`: GPU run 1 == GPU run 2 (every loss, params_sha256): "
                        f"**{r['gpu_runs_identical']}**; GPU == CPU reference: **{r['gpu_equals_cpu']}**, "
                        f"max loss difference {_f(r['max_loss_diff_gpu_vs_cpu'])} "
                        f"(first losses {r['first_loss_gpu_cpu']})"
                    + (f"; with model.dropout=0: GPU == CPU **{r['dropout0_gpu_equals_cpu']}**, max loss difference "
                       f"{_f(r['dropout0_max_loss_diff'])}." if "dropout0_max_loss_diff" in r else ".")]
        elif key == "step_time":
            out += [f"`{' '.join(r['job'])}`; median step after {r['warmup_steps_dropped']} warm-up steps.", ""]
            out += _table(["trainer", "median step (s)", "over plain fp32", "GPU busy", "elaswave phases (s)", "final loss"],
                          [[k, v.get("step_time_s"), v.get("over_plain_fp32"), v.get("gpu_busy_fraction"),
                            ", ".join(f"{p} {_f(s, 2)}" for p, s in v.get("phases_s", {}).items()) or v.get("error") or "",
                            v.get("final_loss")] for k, v in r["rows"].items()])
        elif key == "mfu":
            out += [f"FLOPs per step = {r['formula']} = {_f(r['model_tflop_per_step'])} TFLOP "
                    f"(N = {r['non_embedding_params']}, "
                    f"T = {r['tokens_per_step']}); datasheet peaks {json.dumps(r['peaks_tflops'])} TFLOP/s.", ""]
            out += _table(["trainer", "TFLOP/s", "of fp32 peak", "of TF32 peak", "of bf16 peak"],
                          [[k, v["tflops"], v["of_fp32_peak"], v["of_tf32_peak"], v["of_bf16_peak"]]
                           for k, v in r["rows"].items()])
        elif key == "nvml":
            out += _table(["reading", "value"], [[k, f"`{json.dumps(v)}`"] for k, v in r.items()])
        if key == "step_time":
            out += [""] + [f"- {k}: {p} takes {v['phases_s'][p]:.3g} s of its {v['step_time_s']:.3g} s step."
                           for k, v in r["rows"].items() if v.get("phases_s")
                           for p in [max(v["phases_s"], key=v["phases_s"].get)]]
        out += ["", NOTES[key], ""] if key in NOTES else [""]
    return out


NOTES = {  # what a reader needs to read the figures; true of the code, whatever the figures
    "nccl": "NCCL builds its communicator at the first collective, not in the constructor; the TCPStore group, made "
            "first, also pays for loading NCCL in the process. Two ranks need two GPUs: "
            "NCCL refuses two ranks on one device, and elaswave's launcher gives rank r the GPU LOCAL_RANK=r "
            "(comm/backend.py choose), which does not exist here, so multi-rank NCCL was not measured.",
    "attention": "'Same bits' over 4 runs shows no difference was seen, not that the kernel is deterministic. "
                 "The written-out rows in fp32 are the yardstick run again (hence 0).",
    "determinism": "At dp=1 pp=1 elaswave makes no process group (a group of one member is None in "
                   "comm/groups.py), so this exercises CUDA compute, the fixed-point sums and AdamW, not NCCL. "
                   "With dropout the GPU draws its masks from CUDA's generator and the CPU from its own, so the "
                   "runs see different masks; with model.dropout=0 the difference is arithmetic alone.",
    "step_time": "GPU busy: kernel and copy time over wall time of 3 profiled steps of the plain loop; far under 1 "
                 "means the host's launching, not the GPU, sets the step at this size. The norm phase computes one "
                 "squared norm per ZeRO chunk (zero/optimizer.py chunk_sumsq), each read back to the host: "
                 "elaswave_fast_chunk_1m has 256x fewer chunks.",
    "mfu": "elaswave trains in fp32 with TF32 off (bf16 with fp32 masters is open issue 16), so its peak is the "
           "fp32 one; plain_bf16_sdpa is measured against bf16's.",
    "nvml": "No clock was set: the machine is lent and must be left as found. elaswave's NvmlActuator was "
            "constructed (it only reads clocks); apply() would call nvmlDeviceSetApplicationsClocks, which was "
            "not called, and would_set_mhz is what it would ask for.",
}


def write_page(results: Path) -> Path:
    """Replace (or add) BENCHMARKS.md's GPU section, which runs to the end of the page."""
    doc = json.loads(results.read_text())
    target, head = ROOT / "BENCHMARKS.md", "## GPU checklist"
    text = target.read_text() if target.exists() else ""
    text = (text[:text.index(head)] if head in text else text).rstrip()
    section = [f"{head} ({doc['env']['device']}, {doc['env']['date']})", "", "Written by `python bench/gpu.py --page` from "
               "`bench/results/gpu.json`; what is measured and how: the docstring of `bench/gpu.py`.", ""] + markdown(doc)
    target.write_text(text + "\n\n" + "\n".join(section).rstrip() + "\n")
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--quick", action="store_true", help="fewer sizes, repeats and runs")
    ap.add_argument("--page", action="store_true", help="only rewrite BENCHMARKS.md's GPU section from OUT/gpu.json")
    ap.add_argument("--only", default="", help="comma-separated items to run (results in OUT/gpu-only.json)")
    args = ap.parse_args(argv)
    if args.page:  # the tables again from the raw results (e.g. after the notes changed), and the page
        results = Path(args.out) / "gpu.json"
        (results.parent / "gpu.md").write_text("\n".join(markdown(json.loads(results.read_text()))))
        print(f"wrote {results.parent / 'gpu.md'} and {write_page(results)}")
        return 0
    if not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device here; nothing measured (run it on a machine with a GPU)")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    doc = {"quick": args.quick, "env": environment(), "items": {}}
    items = {"nccl": item_nccl, "matmul": item_matmul, "attention": item_attention, "determinism": item_determinism,
             "step_time": item_step_time, "mfu": lambda q: item_mfu(doc["items"]["step_time"].get("result"), doc["env"]),
             "nvml": item_nvml}
    only = [x for x in args.only.split(",") if x]
    if only:
        items = {k: v for k, v in items.items() if k in only}
    results = out / ("gpu-only.json" if only else "gpu.json")
    for name, fn in items.items():
        print(f"[gpu] {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            doc["items"][name] = {"result": fn(args.quick)}
        except Exception as exc:  # noqa: BLE001 - one item's failure is a finding; the rest still run
            doc["items"][name] = {"error": _short(exc), "traceback": traceback.format_exc()[-3000:]}
        doc["items"][name]["s"] = time.perf_counter() - t0
        print(f"[gpu] {name}: {doc['items'][name].get('error', 'ok')} ({doc['items'][name]['s']:.1f} s)", flush=True)
        torch.cuda.empty_cache()
        doc["wall_s"] = time.perf_counter() - began
        results.write_text(json.dumps(doc, indent=1))  # after every item: a cut-off run keeps what it had
    if only:
        return 0
    (out / "gpu.md").write_text("\n".join(markdown(doc)))
    print("\n".join(markdown(doc)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
