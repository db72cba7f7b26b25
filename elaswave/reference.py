"""The reference oracle: a single-process, failure-free trainer that defines "correct".

It runs the whole model on micro-batches 0..M-1 one after the other, with the same data, dropout
streams, precision, fixed-point accumulation (deterministic mode), clipping and AdamW as the distributed
runtime, where one holder owns every chunk. Elastic runs are compared against what it produces.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Callable

import torch

from elaswave.config import JobConfig
from elaswave.data.sampler import Sampler, open_eval_sampler, open_sampler
from elaswave.model import moe
from elaswave.model.registry import model_for
from elaswave.pipeline.stage import Stage
from elaswave.precision import job_dtype, name
from elaswave.plan.chunks import ChunkIndex
from elaswave.zero.bucket import Bucket
from elaswave.zero.digest import owned_state_sum, state_sha256
from elaswave.zero.flat import params_sha256
from elaswave.tensor.shards import TensorShards, whole_digest
from elaswave.zero.optimizer import ShardedAdamW, clip_coef, clip_of_norm, lr_at
from elaswave.zero.reduce import GradAccumulator


def train_reference(cfg: JobConfig, on_step: Callable[[dict], None] | None = None) -> dict:
    """Train ``cfg.train.steps`` steps; returns ``{"losses": [...], "eval_losses": {step: loss},
    "params_sha256": ..., "state_sha256": ...}``.

    With ``elastic.reshape`` each sequence is a micro-batch of its own: the units the runtime
    computes alone in deterministic mode, whichever micro-batches it packs them into."""
    if cfg.elastic.reshape:
        t = cfg.train
        cfg = replace(cfg, train=replace(t, micro_batch_size=1, num_micro_batches=t.num_micro_batches * t.micro_batch_size))
    t, m = cfg.train, model_for(cfg)
    torch.set_num_threads(1)  # the same kernels, hence the same bits, as a one-thread worker rank
    sampler = open_sampler(cfg, m)
    stage = Stage(cfg, (0, m.num_layers), torch.device("cpu"), m)
    layers = stage.layers
    bucket = Bucket((0,), [l.index for l in layers], [l.numel for l in layers], cfg.parallel.chunk_numel, me=0)
    optimizer = ShardedAdamW([bucket], layers, t)  # the float32 masters, before the layers are rounded
    # A tensor-parallel job's reference: the whole model in the same canonical blocks, its norm
    # and digests counted per value of the whole model as the job's shards count them.
    shards = TensorShards(m, layers, [bucket], None) if cfg.parallel.tp > 1 else None
    dtype = job_dtype(t.precision, cfg.parallel.backend)  # auto: what the job's own ranks would run
    for layer in layers:
        layer.cast(dtype)
    accumulator = GradAccumulator(layers, t.deterministic, t.grad_fixed_point_bits, t.num_micro_batches)
    index = ChunkIndex.build([l.numel for l in layers], cfg.parallel.chunk_numel)
    losses, eval_losses = [], {}
    eval_sampler = open_eval_sampler(cfg, m) if t.eval_every else None
    for step in range(t.steps + 1):
        if t.eval_due(step):
            began = time.perf_counter()
            eval_losses[step] = _evaluate(cfg, stage, eval_sampler)
            if on_step is not None:
                on_step({"event": "eval", "step": step, "eval_loss": eval_losses[step][0], "world_size": 1,
                         "epoch": 0, "eval_tokens": eval_losses[step][1], "eval_s": time.perf_counter() - began})
            eval_losses[step] = eval_losses[step][0]
        if step == t.steps:
            break
        started = time.perf_counter()
        global_tokens = sampler.loss_tokens(step)
        accumulator.zero()
        loss_sums, auxes = [], []
        for mb in range(t.num_micro_batches):
            batch = sampler.micro_batch(step, mb)
            with moe.recording() as record:
                logits = stage.forward(batch.inputs, step, mb, documents=batch.documents)
            loss_sum = m.loss_sum(logits, batch.targets)
            loss_sums.append(float(loss_sum.detach()))
            term, aux = moe.balance_term(record, m, batch.targets.shape[0], t.num_micro_batches * t.micro_batch_size)
            auxes += [aux] if aux is not None else []
            (loss_sum / max(1, global_tokens) + (term if term is not None else 0.0)).backward()
            accumulator.add_micro_batch()
        grad = accumulator.to_float(bucket.pack([accumulator.sums[l.index] for l in layers]))
        if shards is not None:
            norm, coef = clip_of_norm(shards.norm([grad], None, t.grad_fixed_point_bits if t.deterministic else None),
                                      t.grad_clip)
        else:
            norm, coef = clip_coef(list(optimizer.chunk_sumsq([grad], index, owned_only=True,
                                                              exact_layout=t.deterministic).values()), t.grad_clip)
        optimizer.step([grad], step, lr_at(step, t), coef)
        with torch.no_grad():
            for layer, flat in zip(layers, bucket.unpack(optimizer.params[0])):
                layer.flat.copy_(flat)
        loss = math.fsum(loss_sums) / global_tokens if global_tokens else None  # as the runtime records it
        losses.append(loss)
        if on_step is not None:
            on_step({"event": "step", "step": step, "loss": loss, "grad_norm": norm,
                     **({"aux_loss": math.fsum(auxes) / len(auxes)} if auxes else {}),
                     "num_samples": t.num_micro_batches * t.micro_batch_size, "world_size": 1, "epoch": 0,
                     "tokens": t.num_micro_batches * t.micro_batch_size * m.seq_len, "loss_tokens": global_tokens,
                     "step_time_s": time.perf_counter() - started})
    for layer, flat in zip(layers, bucket.unpack(optimizer.params[0])):  # the masters, for digest and export
        layer.cast(torch.float32)
        layer.flat.copy_(flat)
    wholes = dict(shards.each_whole(layers)) if shards is not None else None
    if cfg.checkpoint.export_hf:
        from elaswave.checkpoint import export
        written = shards.whole_layers(wholes, wholes) if shards is not None else layers
        export.write_layers(export.Target.of_job(cfg), cfg.model, written, m.num_layers, m, t.seed)
    if shards is not None:
        params = params_sha256([bytes.fromhex(whole_digest(wholes[i])) for i in range(m.num_layers)])
        state = state_sha256(optimizer.gen, [shards.state_sum(optimizer, layers)])
    else:
        params = params_sha256([l.digest() for l in layers])
        state = state_sha256(optimizer.gen, [owned_state_sum(optimizer)])
    return {"losses": losses, "eval_losses": eval_losses, "params_sha256": params, "state_sha256": state,
            "precision": name(dtype)}


def _evaluate(cfg: JobConfig, stage: Stage, sampler: Sampler) -> tuple[float, int]:
    """The held-out loss of the whole model, micro-batch after micro-batch (see runtime/evaluation.py),
    and its count of loss tokens."""
    t, m = cfg.train, stage.model
    sums, tokens = [], 0
    with torch.no_grad():
        for j in range(t.eval_batches):
            for mb in range(t.num_micro_batches):
                batch = sampler.micro_batch(j, mb)
                sums.append(float(m.loss_sum(stage.forward(batch.inputs, j, mb, train=False, documents=batch.documents),
                                             batch.targets)))
                tokens += batch.loss_tokens
    return (math.fsum(sums) / tokens if tokens else None), tokens
