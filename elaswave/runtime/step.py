"""One training step on one rank; reads as the algorithm."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from elaswave.comm import backend
from elaswave.config import JobConfig
from elaswave.runtime.rank import RankState
from elaswave.snapshot.pool import SnapshotError, SnapshotPool
from elaswave.zero import reduce
from elaswave.zero.optimizer import clip_coef, lr_at


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    phases_s: dict[str, float] = field(default_factory=dict)
    """Wall time of each phase of the step on this rank (compute, reduce, norm, optimizer, gather, snapshot)."""


class _Laps:
    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = now - self.last
        self.last = now


def _exchange_exact(st: RankState, values: dict[int, float], size: int) -> list[float]:
    """All-reduce of a vector in which every entry has one non-zero contributor: exact."""
    vec = torch.zeros(size, dtype=torch.float64)
    for i, v in values.items():
        vec[i] = v
    vec = vec.to(st.device)
    st.world.all_reduce(vec, "clip-norm exchange")
    return vec.cpu().tolist()


def train_step(st: RankState, cfg: JobConfig, step: int, pool: SnapshotPool | None,
               fault: Callable[[int, str], None]) -> StepResult:
    t = cfg.train
    lap = _Laps()
    # 1. Forward and backward of this pipeline's micro-batches (1F1B); each micro-batch's gradient
    #    is folded into the sums as soon as its backward ends (fixed point in deterministic mode).
    st.accumulator.zero()
    losses = st.executor.run(st.schedule, step)
    # The losses travel with one flag per rank: "I hold a verified snapshot of my peer's state at
    # the start of this step". Nobody updates until every flag is in, so nobody drops the older
    # generation while some chunk exists only there.
    is_verified = pool.verify(st.world, step) if pool is not None else True
    exchange = torch.zeros(t.num_micro_batches + 1, dtype=torch.float64)
    for mb, loss_sum in losses.items():
        exchange[mb] = loss_sum  # one last stage contributes each entry: the sum is exact
    exchange[-1] = 1.0 if is_verified else 0.0
    exchange = exchange.to(st.device)
    exchange_work = st.world.all_reduce_async(exchange)
    lap("compute")

    # 2. Sum over all M micro-batches within each holder group: each owner gets its chunks
    #    (on gloo every holder gets the whole bucket, at the same cost).
    fault(step, "reduce")
    whole = backend.reduce_scatter_is_all_reduce(st.backend_name)
    reduced = [st.accumulator.to_float(reduce.reduce(b, st.accumulator.sums, g, whole))
               for b, g in zip(st.buckets, st.groups)]
    lap("reduce")

    # 3. Global norm for clipping, summed per chunk in chunk order. When every rank saw every chunk,
    #    each computes it alone; otherwise owners exchange their chunks' squares exactly.
    if not st.norm_needs_exchange:
        sumsq = st.optimizer.chunk_sumsq(reduced, st.chunk_index, owned_only=False)
    else:
        owned = st.optimizer.chunk_sumsq(reduced, st.chunk_index, owned_only=True)
        sumsq = dict(enumerate(_exchange_exact(st, owned, st.chunk_index.total)))
    norm, coef = clip_coef(list(sumsq.values()), t.grad_clip)
    if exchange_work is not None:
        st.world.wait(exchange_work, "loss exchange")
    exchange = exchange.cpu()
    if exchange[-1].item() != st.world.size:
        raise SnapshotError(f"step {step}: only {int(exchange[-1].item())} of {st.world.size} snapshots "
                            "passed their checksum")
    if pool is not None:
        pool.commit(step)
        pool.wait_sends(st.world)
    lap("norm")

    # 4. ZeRO-1: each owner updates its chunks, then the holders re-gather whole layers.
    lr = lr_at(step, t)
    grads = [b.my_part(g) if g.numel() > b.slot_numel else g for b, g in zip(st.buckets, reduced)]
    st.optimizer.step(grads, step, lr, coef)
    fault(step, "optimizer")
    lap("optimizer")
    gather_params(st)
    lap("gather")

    # 5. Snapshot: the new state of this rank's chunks goes to its holder while the next step computes.
    if pool is not None:
        pool.send(st.world, st.plan, st.optimizer.gen, st.optimizer.keys(), st.optimizer.payload, st.device)
        pool.expect(st.world, st.plan, st.device)
    fault(step, "snapshot")
    lap("snapshot")

    step_tokens = st.plan.num_micro_batches * t.micro_batch_size * cfg.model.seq_len
    loss = math.fsum(exchange[:-1].tolist()) / step_tokens
    return StepResult(loss=loss, grad_norm=norm, lr=lr, phases_s=lap.phases)


def gather_params(st: RankState) -> None:
    """Every holder's owned chunks -> whole layers on every holder."""
    by_index = {l.index: l for l in st.stage.layers}
    with torch.no_grad():
        for b, g, shard in zip(st.buckets, st.groups, st.optimizer.params):
            for i, flat in zip(b.layers, reduce.all_gather(b, shard, g)):
                by_index[i].flat.copy_(flat)
