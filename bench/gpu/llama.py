"""The Llama family on a GPU: ``python bench/gpu/llama.py [--out DIR]`` (exits 0 without CUDA).

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
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import RESULTS, run_parts  # noqa: E402
from bench.gpu.checklist_training import WARMUP_STEPS, elaswave_row, plain_trainer, timed_steps  # noqa: E402

JOB = ["parallel.dp=1", "parallel.pp=1", "model.preset=llama-tiny", "model.dropout=0", "train.precision=fp32", "model.d_model=512", "model.num_heads=8",
       "model.num_kv_heads=4", "model.num_blocks=8", "model.ffn_dim=1408", "model.seq_len=256",
       "train.micro_batch_size=8", "train.num_micro_batches=4", "train.steps=30"]


def parity() -> dict:
    import transformers

    from elaswave import config
    from elaswave.model.registry import model_for
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
    from elaswave.model.config import to_hf_config

    cfg = config.load(None, sets)
    m, t = cfg.model, cfg.train
    torch.manual_seed(t.seed)
    hf = {k: v for k, v in to_hf_config(m).items() if k != "architectures"}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf)).to(device).train()
    autocast = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext

    def micro_batch_loss(b):
        with autocast():
            logits = model(b.inputs.to(device)).logits
        return F.cross_entropy(logits.reshape(-1, m.vocab_size).float(), b.targets.to(device).reshape(-1), reduction="sum")

    train_step = plain_trainer(cfg, list(model.parameters()), micro_batch_loss, device, fused=bf16 and device == "cuda")
    times, losses = timed_steps(train_step, t.steps, device)
    # The loop runs in the bench's own process: hand its cached blocks back before the next row's
    # `elaswave run` (a 1B model's loop kept 21 GiB reserved, and the run beside it ran out).
    train_step = model = None
    if device == "cuda":
        import gc
        gc.collect()
        torch.cuda.empty_cache()
    return {"step_time_s": statistics.median(times[WARMUP_STEPS:]), "final_loss": losses[-1]}


def step() -> dict:
    rows = {"transformers_plain_before": plain_step(JOB)}
    for name, extra in (("elaswave_fast", []), ("elaswave_fast_chunk_1m", ["parallel.chunk_numel=1048576"])):
        rows[name] = elaswave_row(JOB + extra, False, timeout_s=300)
    rows["transformers_plain_after"] = plain_step(JOB)
    base = statistics.mean(rows[k]["step_time_s"] for k in ("transformers_plain_before", "transformers_plain_after"))
    for row in rows.values():
        if "step_time_s" in row:
            row["over_transformers"] = row["step_time_s"] / base
    return {"job": JOB, "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu/llama.py: no CUDA device here; nothing measured")
        return 0
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    run_parts(doc, {"parity": parity, "step": step}, Path(args.out) / "gpu_llama.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
