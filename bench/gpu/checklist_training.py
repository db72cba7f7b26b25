"""The GPU checklist's items that train: elaswave on CUDA as a user runs it (deterministic mode,
step time against a plain PyTorch loop) and the model FLOPs utilisation of those steps; and what
the other GPU benches share with them: the warm-up, the datasheet peaks, a plain PyTorch training
loop and an elaswave step-time row. Run by bench/gpu/checklist.py; used by bench/gpu/llama.py and
bench/gpu/precision.py."""
from __future__ import annotations

import statistics
import time
import types
from typing import Callable

import torch
import torch.nn.functional as F

from bench.common import decay_groups, short_error, try_job

WARMUP_STEPS = 5
# Datasheet dense peaks, TFLOP/s (no sparsity).
PEAKS = {"SXM": {"fp32": 67.0, "tf32": 494.0, "bf16": 989.0}, "PCIe": {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0}}
STEP_JOB = ["parallel.dp=1", "parallel.pp=1", "model.arch=gpt", "train.precision=fp32", "model.d_model=512", "model.num_heads=8", "model.num_blocks=8",
            "model.seq_len=256", "train.micro_batch_size=8", "train.num_micro_batches=4"]


def elaswave_row(sets: list[str], deterministic: bool, timeout_s: float, with_steps: bool = False) -> dict:
    """``elaswave run``'s median step after ``WARMUP_STEPS``, final loss and median phases (or its
    exit code and error); ``with_steps``: how many steps it wrote, too."""
    res = try_job("run", sets, deterministic, timeout_s=timeout_s)
    kept = res["steps"][WARMUP_STEPS:]
    row = {"exit_code": res["exit_code"], "error": res["error"], **({"steps": len(res["steps"])} if with_steps else {}),
           **({"memory": res["memory"]} if res["memory"] else {})}
    if kept:
        row.update(step_time_s=statistics.median(r["step_time_s"] for r in kept), final_loss=res["losses"][-1],
                   phases_s={k: statistics.median(r["phases_s"][k] for r in kept) for k in kept[0]["phases_s"]})
    return row


def plain_trainer(cfg, params: list, micro_batch_loss: Callable, device: str, fused) -> Callable[[int], float]:
    """One step of a plain loop, no elaswave runtime: the job's LR schedule, AdamW (decay on
    matrices only), every micro-batch's summed token loss (``micro_batch_loss(batch)``) over the
    global batch's tokens, clipping. Returns the step's function (step -> its loss)."""
    from elaswave.data.sampler import open_sampler
    from elaswave.zero.optimizer import lr_at

    m, t = cfg.model, cfg.train
    opt = torch.optim.AdamW(decay_groups(params, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                            fused=fused)
    sampler = open_sampler(cfg, m)
    global_tokens = t.num_micro_batches * t.micro_batch_size * m.seq_len

    def train_step(step: int) -> float:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, t)
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for mb in range(t.num_micro_batches):
            loss_sum = micro_batch_loss(sampler.micro_batch(step, mb))
            (loss_sum / global_tokens).backward()
            total += loss_sum.detach()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        opt.step()
        return float(total) / global_tokens
    return train_step


def timed_steps(train_step: Callable[[int], float], steps: int, device: str) -> tuple[list[float], list[float]]:
    """Each step's time on the host clock (synchronised before and after on CUDA) and its loss."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times, losses = [], []
    for step in range(steps):
        sync()
        started = time.perf_counter()
        losses.append(train_step(step))
        sync()
        times.append(time.perf_counter() - started)
    return times, losses


def _same(a: dict, b: dict) -> bool:
    """Every loss and the final parameters bit-identical (and both runs finished)."""
    return bool(a["losses"]) and a["losses"] == b["losses"] and a["sha"] is not None and a["sha"] == b["sha"]


def _max_diff(a: dict, b: dict) -> float | None:
    n = len(a["losses"])
    return max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) if n and n == len(b["losses"]) else None


# -- 4. determinism ----------------------------------------------------------------------------------
def item_determinism(quick: bool) -> dict:
    job = ["parallel.dp=1", "parallel.pp=1", "train.precision=fp32", "train.steps=20"]
    gpu = [try_job("run", job + ["parallel.backend=nccl"], True) for _ in range(2)]
    cpu = try_job("reference", job, True)
    runs = {"gpu_run_1": gpu[0], "gpu_run_2": gpu[1], "cpu_reference": cpu}
    out = {"job": job + ["--deterministic"], "gpu_runs_identical": _same(*gpu), "gpu_equals_cpu": _same(gpu[0], cpu),
           "max_loss_diff_gpu_vs_cpu": _max_diff(gpu[0], cpu),
           "first_loss_gpu_cpu": [r["losses"][0] if r["losses"] else None for r in (gpu[0], cpu)]}
    if not quick:  # the GPU draws dropout masks from CUDA's Philox stream: without dropout, arithmetic alone
        for name, command in (("gpu_dropout0", "run"), ("cpu_dropout0", "reference")):
            runs[name] = try_job(command, job + ["model.dropout=0"], True)
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
    from elaswave.model.gpt import build_layer, token_loss_sum

    cfg = config.load(None, sets)
    m, t = cfg.model, cfg.train
    layers = nn.ModuleList(build_layer(m, i, t.seed) for i in range(m.num_layers)).to(device)
    for block in list(layers)[1:-1] if fast else []:
        block.forward = types.MethodType(_sdpa_block_forward, block)
    gen = torch.Generator(device=device)
    gen.manual_seed(t.seed)

    def micro_batch_loss(batch):
        x = batch.inputs.to(device)
        with torch.autocast(device, torch.bfloat16, enabled=fast):
            for layer in layers:
                x = layer(x, gen)
        return token_loss_sum(x.float(), batch.targets.to(device))

    train_step = plain_trainer(cfg, list(layers.parameters()), micro_batch_loss, device, fused=fast or None)
    times, losses = timed_steps(train_step, steps, device)
    res = {"step_time_s": statistics.median(times[WARMUP_STEPS:]), "final_loss": losses[-1], "losses": losses}
    if device == "cuda":
        try:  # how much of the step the GPU spends in kernels: the rest it waits for the host
            res["gpu_busy_fraction"] = _gpu_busy(lambda: [train_step(s) for s in range(steps - 3, steps)])
        except Exception as exc:  # noqa: BLE001
            res["gpu_busy_fraction"] = short_error(exc)
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
        rows[name] = elaswave_row(sets, False, timeout_s=240, with_steps=True)
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


