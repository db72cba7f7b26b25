"""One training step on one rank; reads as the algorithm."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from elaswave.comm import backend
from elaswave.config import JobConfig
from elaswave.runtime.rank import RankState
from elaswave.zero import reduce
from elaswave.zero.optimizer import clip_coef, lr_at


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    phases_s: dict[str, float] = field(default_factory=dict)
    """Wall time of each phase of the step on this rank (compute, reduce, norm, optimizer, gather)."""


class _Laps:
    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = now - self.last
        self.last = now


def _exchange_exact(values: dict[int, float], size: int, device: torch.device) -> list[float]:
    """World all-reduce of a vector in which every entry has one non-zero contributor: exact."""
    vec = torch.zeros(size, dtype=torch.float64)
    for i, v in values.items():
        vec[i] = v
    vec = vec.to(device)
    dist.all_reduce(vec)
    return vec.cpu().tolist()


def train_step(st: RankState, cfg: JobConfig, step: int) -> StepResult:
    t = cfg.train
    lap = _Laps()
    # 1. Forward and backward of this pipeline's micro-batches (1F1B); each micro-batch's gradient
    #    is folded into the sums as soon as its backward ends (fixed point in deterministic mode).
    st.accumulator.zero()
    losses = st.executor.run(st.schedule, step)
    # The losses are only reported: their exchange overlaps the rest of the step.
    loss_vec = torch.zeros(t.num_micro_batches, dtype=torch.float64)
    for mb, loss_sum in losses.items():
        loss_vec[mb] = loss_sum  # one last stage contributes each entry: the sum is exact
    loss_vec = loss_vec.to(st.device)
    loss_work = dist.all_reduce(loss_vec, async_op=True)
    lap("compute")

    # 2. Sum over all M micro-batches within each holder group: each owner gets its chunks
    #    (on gloo every holder gets the whole bucket, at the same cost).
    whole = backend.reduce_scatter_is_all_reduce(st.backend_name)
    reduced = [st.accumulator.to_float(reduce.reduce(b, st.accumulator.sums, g, whole))
               for b, g in zip(st.buckets, st.groups)]
    lap("reduce")

    # 3. Global norm for clipping, summed per chunk in chunk order. A rank that saw every chunk
    #    computes it alone; otherwise owners exchange their chunks' squares exactly.
    sumsq = st.optimizer.chunk_sumsq(reduced, st.chunk_index, owned_only=False)
    if len(sumsq) < st.chunk_index.total:
        owned = st.optimizer.chunk_sumsq(reduced, st.chunk_index, owned_only=True)
        sumsq = dict(enumerate(_exchange_exact(owned, st.chunk_index.total, st.device)))
    norm, coef = clip_coef(list(sumsq.values()), t.grad_clip)
    lap("norm")

    # 4. ZeRO-1: each owner updates its chunks, then the holders re-gather whole layers.
    lr = lr_at(step, t)
    grads = [b.my_part(g) if g.numel() > b.slot_numel else g for b, g in zip(st.buckets, reduced)]
    st.optimizer.step(grads, step, lr, coef)
    lap("optimizer")
    by_index = {l.index: l for l in st.stage.layers}
    with torch.no_grad():
        for b, g, shard in zip(st.buckets, st.groups, st.optimizer.params):
            for i, flat in zip(b.layers, reduce.all_gather(b, shard, g)):
                by_index[i].flat.copy_(flat)
    backend.wait(loss_work, cfg.parallel.timeout_s, "loss exchange")
    lap("gather")

    global_tokens = t.num_micro_batches * t.micro_batch_size * cfg.model.seq_len
    return StepResult(loss=math.fsum(loss_vec.cpu().tolist()) / global_tokens, grad_norm=norm, lr=lr,
                      phases_s=lap.phases)
