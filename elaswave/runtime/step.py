"""One training step on one rank; reads as the algorithm."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from elaswave.config import JobConfig
from elaswave.runtime.rank import RankState
from elaswave.zero import reduce
from elaswave.zero.optimizer import clip_coef, lr_at


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float


def train_step(st: RankState, cfg: JobConfig, step: int) -> StepResult:
    t = cfg.train
    # 1. Forward and backward of this pipeline's micro-batches (1F1B); each micro-batch's gradient
    #    is folded into the sums as soon as its backward ends (fixed point in deterministic mode).
    st.accumulator.zero()
    losses = st.executor.run(st.schedule, step)

    # 2. Sum over all M micro-batches, scattered to chunk owners, one bucket per holder group.
    grads = [st.accumulator.to_float(reduce.reduce_scatter(b, st.accumulator.sums, g))
             for b, g in zip(st.buckets, st.groups)]

    # 3. One small world all-reduce carries each micro-batch's loss and each chunk's squared norm.
    #    Every entry has exactly one non-zero contributor, so the sum is exact in any order.
    stats = torch.zeros(t.num_micro_batches + st.chunk_index.total, dtype=torch.float64)
    for mb, loss_sum in losses.items():
        stats[mb] = loss_sum
    for c, sumsq in st.optimizer.chunk_sumsq(grads, st.chunk_index).items():
        stats[t.num_micro_batches + c] = sumsq
    stats = stats.to(st.device)
    dist.all_reduce(stats)
    stats = stats.cpu().tolist()
    norm, coef = clip_coef(stats[t.num_micro_batches:], t.grad_clip)

    # 4. ZeRO-1: each owner updates its chunks, then the holders re-gather whole layers.
    lr = lr_at(step, t)
    st.optimizer.step(grads, step, lr, coef)
    by_index = {l.index: l for l in st.stage.layers}
    with torch.no_grad():
        for b, g, shard in zip(st.buckets, st.groups, st.optimizer.params):
            for i, flat in zip(b.layers, reduce.all_gather(b, shard, g)):
                by_index[i].flat.copy_(flat)

    global_tokens = t.num_micro_batches * t.micro_batch_size * cfg.model.seq_len
    return StepResult(loss=math.fsum(stats[:t.num_micro_batches]) / global_tokens, grad_norm=norm, lr=lr)
