"""The reference trainer against training written with torch alone.

The layout tests compare elastic runs with :func:`train_reference`, which shares the runtime's
stage, ZeRO AdamW, gradient accumulator and clipping: they prove that the layout does not matter,
not that the training is right. Here a plain loop -- one ``nn.Module`` over the same initial layers,
``torch.optim.AdamW``, ``clip_grad_norm_``, a ``LambdaLR`` written from the config's numbers, and
the loss summed over micro-batches and divided by the global token count -- must reach the same
losses, gradient norms and parameters over 20 steps (fp32, fast mode), with clipping in play in
some steps and not in others.

Measured (CPU, one thread, torch 2.13): GPT max |loss diff| 2.4e-7, |grad-norm diff| 1.3e-6,
|param diff| 1.4e-6; the tied Llama 2.4e-7, 1.9e-6 and 2.5e-7. Those are float32 rounding: the
two sides add the same numbers in other orders (a tied tensor's two uses, the norm's chunks in
float64 against torch's per-tensor norms, ``p * (1 - lr * wd)`` against ``p - lr * wd * p``).
"""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from elaswave import config, reference
from elaswave.data.sampler import open_sampler
from elaswave.model.registry import model_for
from elaswave.pipeline.stage import Stage

# Dropout off: elaswave draws its masks from keyed streams (seed, step, micro-batch, layer) that a
# plain module's dropout cannot reproduce. grad_clip=2: the norms run from about 1 to 4 here, so
# some steps are clipped and some are not.
COMMON = ["model.dropout=0", "train.steps=20", "train.num_micro_batches=4", "train.micro_batch_size=2",
          "train.grad_clip=2.0", "train.precision=fp32", "train.deterministic=false", "data.max_corpus_bytes=200000"]
MODELS = {
    "gpt": ["model.arch=gpt", "model.d_model=32", "model.num_heads=2", "model.seq_len=32", "model.num_blocks=4"],
    "llama": ["model.arch=llama"],  # the llama-tiny preset: grouped-query attention, tied embeddings
}
# Parameters are about 0.02 (weights) to 1 (norm gains) and losses about 5. Rounding differences
# reach 2e-6 (above); a wrong beta, clip, schedule step, decay set or loss scale moves them by 1e-4
# and more. 1e-5 absolute plus 1e-5 relative sits between the two.
TOL = dict(atol=1e-5, rtol=1e-5)


class Plain(nn.Module):
    """The model's layers as one module; a tied head holds the embedding's Parameter itself."""

    def __init__(self, cfg: config.JobConfig):
        super().__init__()
        m = model_for(cfg)
        # Each layer initialises itself from its keyed stream: the weights the reference starts from.
        self.layers = nn.ModuleList(m.build_layer(i, cfg.train.seed) for i in range(m.num_layers))
        if cfg.model.tie_embeddings:
            self.layers[-1].lm_head.weight = self.layers[0].embed_tokens.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = idx
        for layer in self.layers:
            x = layer(x, None)  # no dropout stream (dropout is 0 anyway)
        return x


def _lr_factor(t: config.TrainConfig):
    """Linear warm-up to lr over warmup_steps (the first step already above 0), then a cosine
    from lr down to min_lr, reached at the last step."""
    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
        floor = t.min_lr / t.lr
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


def _train_plain(cfg: config.JobConfig) -> tuple[list[float], list[float], Plain]:
    t = cfg.train
    model = Plain(cfg)
    params = list(model.parameters())  # a tied tensor once
    # elaswave decays matrices only (embeddings, linear weights), as GPT training does.
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, _lr_factor(t))
    sampler = open_sampler(cfg, model_for(cfg))
    global_tokens = t.num_micro_batches * t.micro_batch_size * cfg.model.seq_len
    losses, norms = [], []
    for step in range(t.steps):
        opt.zero_grad()
        loss_sum = 0.0
        for mb in range(t.num_micro_batches):
            batch = sampler.micro_batch(step, mb)
            logits = model(batch.inputs)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.targets.reshape(-1), reduction="sum")
            # Every token of the global batch weighs the same, whichever micro-batch holds it.
            (loss / global_tokens).backward()
            loss_sum += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, t.grad_clip)))
        opt.step()
        schedule.step()
        losses.append(loss_sum / global_tokens)
    return losses, norms, model


def _train_reference(cfg: config.JobConfig, monkeypatch) -> tuple[list[float], list[float], Stage]:
    """Losses, gradient norms, and the stage, into whose layers the reference copies its final
    float32 masters (it returns only their digest)."""
    stages, norms = [], []

    class Kept(Stage):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            stages.append(self)

    def on_step(record: dict) -> None:
        if record["event"] == "step":
            norms.append(record["grad_norm"])

    monkeypatch.setattr(reference, "Stage", Kept)
    out = reference.train_reference(cfg, on_step)
    return out["losses"], norms, stages[0]


@pytest.mark.parametrize("arch", list(MODELS))
def test_reference_trains_as_plain_pytorch(arch, monkeypatch):
    torch.set_num_threads(1)
    cfg = config.load(None, MODELS[arch] + COMMON)
    ref_losses, ref_norms, stage = _train_reference(cfg, monkeypatch)
    losses, norms, plain = _train_plain(cfg)

    assert len(losses) == len(ref_losses) == cfg.train.steps
    torch.testing.assert_close(torch.tensor(ref_losses), torch.tensor(losses), **TOL, msg=lambda m: f"losses: {m}")
    torch.testing.assert_close(torch.tensor(ref_norms), torch.tensor(norms), **TOL,
                               msg=lambda m: f"gradient norms: {m}")
    assert min(norms) < cfg.train.grad_clip < max(norms), norms  # both sides of the clip are compared
    compared = 0
    for layer in stage.layers:
        theirs = dict(plain.layers[layer.index].named_parameters())
        for name, p in layer.module.named_parameters():  # a tie's user holds none of its own
            torch.testing.assert_close(p.detach(), theirs[name].detach(), **TOL,
                                       msg=lambda m, i=layer.index, n=name: f"layer {i} {n}: {m}")
            compared += p.numel()
    assert compared == sum(p.numel() for p in plain.parameters())
