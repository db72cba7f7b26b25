"""The GPU checklist's items that train: elaswave on CUDA as a user runs it (deterministic mode,
step time against a plain PyTorch loop) and the model FLOPs utilisation of those steps. Run by
bench/gpu.py; shared with bench/gpu_llama.py."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types

import torch
import torch.nn.functional as F

from bench.gpu import PEAKS, ROOT, STEP_JOB, WARMUP_STEPS, _short, _tail


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
    job = ["parallel.dp=1", "parallel.pp=1", "train.precision=fp32", "train.steps=20"]
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
    from elaswave.data.sampler import open_sampler
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
    sampler = open_sampler(cfg, m)
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


