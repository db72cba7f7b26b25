"""The Llama family on a GPU: ``python bench/gpu_llama.py [--out DIR]`` (exits 0 without CUDA).

parity: a random LlamaForCausalLM (GQA, tied embeddings, Llama-3 rope scaling) saved with
        save_pretrained, loaded by elaswave (model.init_from) on the GPU in fp32 (TF32 off):
        max |logit difference| against transformers on the same GPU, fused attention on and off.
step:   elaswave (dp=1 pp=1, fast mode: SDPA) against the same-shaped transformers model in a plain
        loop (same micro-batches, loss scale, clipping, AdamW), median step after warm-up.
Writes DIR/gpu_llama.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.gpu import WARMUP_STEPS, run_parts  # noqa: E402
from bench.gpu_training import _elaswave  # noqa: E402

JOB = ["parallel.dp=1", "parallel.pp=1", "model.preset=llama-tiny", "model.dropout=0", "train.precision=fp32", "model.d_model=512", "model.num_heads=8",
       "model.num_kv_heads=4", "model.num_blocks=8", "model.ffn_dim=1408", "model.seq_len=256",
       "train.micro_batch_size=8", "train.num_micro_batches=4", "train.steps=30"]


def parity() -> dict:
    import transformers

    from elaswave import config
    from elaswave.model.contract import model_for
    from elaswave.pipeline.stage import Stage

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True,
                                      max_position_embeddings=512,
                                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    ref = transformers.LlamaForCausalLM(hf_cfg).eval()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        ref.save_pretrained(tmp)
        ref = ref.cuda()
        ids = torch.randint(0, 512, (2, 256), generator=torch.Generator().manual_seed(1)).cuda()
        with torch.no_grad():
            theirs = ref(ids).logits
        for mode, deterministic in (("fused", False), ("written_out", True)):
            cfg = config.load(None, [f"model.init_from={tmp}", "model.seq_len=256", "parallel.dp=1", "parallel.pp=1",
                                     f"train.deterministic={str(deterministic).lower()}"])
            model = model_for(cfg)
            stage = Stage(cfg, (0, model.num_layers), torch.device("cuda"), model)
            with torch.no_grad():
                ours = stage.forward(ids, 0, 0, train=False)
            out[mode] = float((ours - theirs).abs().max())
    return out


def plain_step(sets: list[str], bf16: bool = False, device: str = "cuda") -> dict:
    """transformers' model of the job's shape in a plain loop; ``bf16``: what a real bf16 run does
    (float32 parameters under bfloat16 autocast, fused AdamW)."""
    import contextlib

    import transformers

    from elaswave import config
    from elaswave.data.sampler import open_sampler
    from elaswave.model.config import to_hf_config
    from elaswave.zero.optimizer import lr_at

    cfg = config.load(None, sets)
    m, t = cfg.model, cfg.train
    torch.manual_seed(t.seed)
    hf = {k: v for k, v in to_hf_config(m).items() if k != "architectures"}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf)).to(device).train()
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=bf16 and device == "cuda")
    autocast = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sampler = open_sampler(cfg, m)
    tokens = t.num_micro_batches * t.micro_batch_size * m.seq_len
    times, losses = [], []
    for step in range(t.steps):
        sync()
        began = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, t)
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for mb in range(t.num_micro_batches):
            b = sampler.micro_batch(step, mb)
            with autocast():
                logits = model(b.inputs.to(device)).logits
            loss = F.cross_entropy(logits.reshape(-1, m.vocab_size).float(), b.targets.to(device).reshape(-1), reduction="sum")
            (loss / tokens).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        opt.step()
        losses.append(float(total) / tokens)
        sync()
        times.append(time.perf_counter() - began)
    return {"step_time_s": statistics.median(times[WARMUP_STEPS:]), "final_loss": losses[-1]}


def step() -> dict:
    rows = {"transformers_plain_before": plain_step(JOB)}
    for name, extra in (("elaswave_fast", []), ("elaswave_fast_chunk_1m", ["parallel.chunk_numel=1048576"])):
        res = _elaswave("run", JOB + extra, False, timeout_s=300)
        kept = res["steps"][WARMUP_STEPS:]
        rows[name] = {"exit_code": res["exit_code"], "error": res["error"]}
        if kept:
            rows[name].update(step_time_s=statistics.median(r["step_time_s"] for r in kept),
                              final_loss=res["losses"][-1],
                              phases_s={k: statistics.median(r["phases_s"][k] for r in kept) for k in kept[0]["phases_s"]})
    rows["transformers_plain_after"] = plain_step(JOB)
    base = statistics.mean(rows[k]["step_time_s"] for k in ("transformers_plain_before", "transformers_plain_after"))
    for row in rows.values():
        if "step_time_s" in row:
            row["over_transformers"] = row["step_time_s"] / base
    return {"job": JOB, "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu_llama.py: no CUDA device here; nothing measured")
        return 0
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    run_parts(doc, {"parity": parity, "step": step}, Path(args.out) / "gpu_llama.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
