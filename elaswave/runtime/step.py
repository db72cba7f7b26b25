"""One training step on one rank; reads as the algorithm."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from elaswave.config import JobConfig
from elaswave.pipeline.schedule import Op
from elaswave.runtime.rank import RankState
from elaswave.snapshot.pool import SnapshotPool
from elaswave.zero.optimizer import clip_coef, clip_of_norm, lr_at


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    phases_s: dict[str, float] = field(default_factory=dict)
    """Wall time of each phase of the step on this rank (compute, reduce, norm, optimizer, gather, snapshot)."""
    joining: int = 0
    """Ranks the leader admitted during this step: every member grows the job at its end."""
    speeds: dict[int, float] = field(default_factory=dict)
    """Every rank's micro-batches per second of its own compute this step (0: it ran none), the
    same on every rank: stragglers are found from it."""
    store_lost: bool = False
    """Every rank's link to the control store has given up: all stop after this step. (A rank cut
    off from a store that the others still reach trains on until they leave it out.)"""
    tokens: int = 0
    """Target tokens of the global batch."""
    loss_tokens: int = 0
    aux_loss: float | None = None
    """The mean of the step's forwards' load-balancing losses (a mixture of experts; None: none)."""
    """Of them, the ones trained (all, unless the corpus has a loss mask): the loss is their mean."""
    tp_bytes: int = 0
    """Bytes this rank gave its tensor-parallel group's collectives in the step (0 without tp)."""
    early_sums: int = 0
    """Gradient buckets whose sum this rank started while its schedule still computed."""
    sums_in_backwards: int = 0
    """Of those, the ones started while the backward that made them whole still ran (zero/watch.py)."""
    gathers_in_forwards: int = 0
    """Parameter all-gathers of the last update that this step's forwards waited for (overlapped)."""
    expert_bytes: int = 0
    """Bytes this rank sent its expert-parallel group's all-to-alls in the step (0: none)."""


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


def _norm(st: RankState, reduced: list[torch.Tensor], t) -> tuple[float, float]:
    """(global norm, clip factor), summed per chunk in chunk order. When every rank saw every chunk,
    each computes it alone; otherwise owners exchange their chunks' squares exactly. A tensor-
    parallel rank counts each value where it sits in the whole model (the same at every degree)."""
    if st.shards is not None:
        owned = [b.my_part(g) if g.numel() > b.slot_numel else g for b, g in zip(st.buckets, reduced)]
        norm = st.shards.norm(owned, st.world, t.grad_fixed_point_bits if t.deterministic else None)
        return clip_of_norm(norm, t.grad_clip)
    if not st.norm_needs_exchange:
        sumsq = st.optimizer.chunk_sumsq(reduced, st.chunk_index, owned_only=False, exact_layout=t.deterministic)
    else:
        owned = st.optimizer.chunk_sumsq(reduced, st.chunk_index, owned_only=True, exact_layout=t.deterministic)
        sumsq = dict(enumerate(_exchange_exact(st, owned, st.chunk_index.total)))
    return clip_coef(list(sumsq.values()), t.grad_clip)


def train_step(st: RankState, cfg: JobConfig, step: int, pool: SnapshotPool | None,
               fault: Callable[[int, str], None], admit: Callable[[RankState], int] | None = None,
               corrupts: Callable[[int], bool] | None = None,
               store_lost: Callable[[], bool] | None = None) -> StepResult:
    """``admit``: on the epoch's leader, answers pending join requests and returns how many ranks
    it admitted into the next epoch; the count travels in the loss exchange. ``store_lost``:
    whether this rank's link to the control store gave up; the count travels there too, so that
    when it is every rank, all stop after the same step."""
    t = cfg.train
    lap = _Laps()
    tp_sent, expert_sent = _tp_sent(st), _expert_sent(st)
    # 1. Forward and backward of this pipeline's micro-batches (1F1B); each micro-batch's gradient
    #    is folded into the sums as soon as its backward ends (fixed point in deterministic mode).
    #    Each bucket's sum over the holder group starts as soon as its gradients are whole here
    #    (a chunk's last backward under interleaved 1F1B), overlapping the compute still to run.
    st.accumulator.zero()
    st.reduction.reset()
    losses = st.executor.run(st.schedule, step)
    gathers_in_forwards = st.gathering.in_forwards
    st.gathering.settle()  # the last step's all-gathers of chunks that ran no forward here
    # The losses travel with one flag per rank: "I hold a verified snapshot of my peer's state at
    # the start of this step". Nobody updates until every flag is in, so nobody drops the older
    # generation while some chunk exists only there. With them, the leader's count of ranks it
    # admitted (everyone learns of a join in the same step), how many ranks lost the control
    # store, and every rank's speed.
    is_verified = pool.verify(st.world, step) if pool is not None else True
    # One loss entry per unit of the global batch (a micro-batch when nothing is reshaped).
    M = t.num_micro_batches * st.plan.units_per_micro_batch
    W = st.world.size
    exchange = torch.zeros(3 * M + 3 + W + 1, dtype=torch.float64)
    for mb, (loss_sum, loss_tokens, aux) in losses.items():
        exchange[mb] = loss_sum  # one contributor per entry: the sum is exact
        exchange[M + 3 + W + mb] = loss_tokens
        if aux is not None:  # the forward's load-balancing loss (a mixture of experts), and a count of them
            exchange[2 * M + 3 + W + mb] = aux
            exchange[3 * M + 3 + W] += 1
    exchange[M] = admit(st) if admit is not None else 0
    exchange[M + 1] = 1.0 if is_verified else 0.0
    exchange[M + 2] = 1.0 if store_lost is not None and store_lost() else 0.0
    forwards = sum(1 for a in st.schedule if a.op is Op.FORWARD and a.micro_batch not in st.executor.ghosts)
    exchange[M + 3 + st.world.group_rank] = forwards / st.executor.busy_s if forwards and st.executor.busy_s > 0 else 0.0
    exchange = exchange.to(st.device)
    lap("compute")

    # 2. Sum over all M micro-batches within each holder group: each owner gets its chunks
    #    (on gloo every holder gets the whole bucket, at the same cost). What is left starts now,
    #    before the exchange: on the world group every rank issues them in this order.
    fault(step, "reduce")
    early_sums, sums_in_backwards = st.reduction.early, st.reduction.within
    st.reduction.start_rest()
    exchange_work = st.world.all_reduce_async(exchange)
    reduced = st.reduction.finish()
    lap("reduce")

    # 3. Global norm for clipping (see _norm).
    norm, coef = _norm(st, reduced, t)
    if exchange_work is not None:
        st.world.wait(exchange_work, "loss exchange")
    exchange = exchange.cpu()
    if pool is not None:
        if exchange[M + 1].item() == st.world.size:  # else a holder discarded a damaged one (it said so)
            pool.commit(step)
        pool.wait_sends(st.world)
    lap("norm")

    # 4. ZeRO-1: each owner updates its chunks, then the holders re-gather whole layers.
    lr = lr_at(step, t)
    grads = [b.my_part(g) if g.numel() > b.slot_numel else g for b, g in zip(st.buckets, reduced)]
    st.optimizer.step(grads, step, lr, coef)
    fault(step, "optimizer")
    lap("optimizer")
    reduced = grads = None  # not alive beside the all-gather's bucket
    # With parallel.overlap_param_gather they are waited for by the next step's first forwards.
    start_gathers(st)
    if not cfg.parallel.overlap_param_gather:
        st.gathering.settle()
    lap("gather")

    # 5. Snapshot: the new state of this rank's chunks goes to its holder while the next step computes.
    if pool is not None:
        pool.send(st.world, st.plan, st.optimizer.gen, st.optimizer.snapshot_slots(), st.device,
                  corrupt=corrupts is not None and corrupts(step))
        pool.expect(st.world, st.plan, st.device)
    fault(step, "snapshot")
    lap("snapshot")

    store_gone = exchange[M + 2].item() == st.world.size
    joining = int(exchange[M].item())
    if st.shards is not None:  # every slice stops, or grows, after the same step, or none does
        store_gone, joining = st.shards.vote(store_gone, joining)
    loss_tokens = int(exchange[M + 3 + W:2 * M + 3 + W].sum().item())
    forwards_with_experts = int(exchange[3 * M + 3 + W].item())
    aux_loss = (math.fsum(exchange[2 * M + 3 + W:3 * M + 3 + W].tolist()) / forwards_with_experts
                if forwards_with_experts else None)
    # A mean over no tokens is undefined (every target masked): None in the record, not a perfect 0.0.
    loss = math.fsum(exchange[:M].tolist()) / loss_tokens if loss_tokens else None
    speeds = dict(zip(st.world.members, exchange[M + 3:M + 3 + W].tolist()))
    return StepResult(loss=loss, grad_norm=norm, lr=lr, phases_s=lap.phases, joining=joining,
                      speeds=speeds, store_lost=store_gone,
                      tokens=samples_of(st.plan, t) * st.stage.model.seq_len,
                      loss_tokens=loss_tokens, aux_loss=aux_loss,
                      tp_bytes=_tp_sent(st) - tp_sent, early_sums=early_sums, sums_in_backwards=sums_in_backwards,
                      gathers_in_forwards=gathers_in_forwards, expert_bytes=_expert_sent(st) - expert_sent)


def _tp_sent(st: RankState) -> int:
    group = st.shards.group if st.shards is not None else None
    return group.payload_bytes if group is not None else 0


def _expert_sent(st: RankState) -> int:
    return sum(x.sent_bytes for x in st.experts["exchanges"]) if st.experts else 0


def samples_of(plan, t) -> int:
    """Sequences the plan trains in a step (the global batch, unless a baseline dropped some)."""
    return plan.batch_units * t.micro_batch_size // plan.units_per_micro_batch


def start_gathers(st: RankState) -> None:
    """Every holder's owned chunks -> whole layers on every holder, rounded to the layers' dtype
    before they travel (a bfloat16 copy of a float32 master is the same wherever it is rounded);
    started, not waited for (zero/reduce.Gathering)."""
    by_index = {l.index: l for l in st.stage.layers}
    with torch.no_grad():
        st.gathering.start(st.optimizer.params, [[by_index[i].flat for i in b.layers] for b in st.buckets])


def gather_params(st: RankState) -> None:
    """:func:`start_gathers`, and wait for them."""
    start_gathers(st)
    st.gathering.settle()


def gather_masters(st: RankState) -> None:
    """At the end of a run: the layers hold the float32 masters (what digests and exports read)."""
    for layer in st.stage.layers:
        layer.cast(torch.float32)
    gather_params(st)
