"""What one rank holds for an epoch, built from the plan: its schedule, links, buckets, holder-group
communicators and its share of the optimizer state. The stage (the layers' weights) outlives
epochs; everything here is rebuilt when the membership changes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from elaswave.comm.backend import reduce_scatter_is_all_reduce
from elaswave.comm.groups import Communicator, Group
from elaswave.config import JobConfig
from elaswave.data.sampler import Sampler
from elaswave.pipeline.balance import BalanceRelay
from elaswave.pipeline.emulate import EmulatedCompute, layer_forward_s
from elaswave.pipeline.executor import Executor
from elaswave.pipeline.p2p import P2P, incoming_of
from elaswave.pipeline.release import send_releases
from elaswave.pipeline.routed import layout_stage, plan_schedules
from elaswave.pipeline.schedule import Action, stage_schedule
from elaswave.pipeline.stage import Stage
from elaswave.plan.buckets import gradient_chunks, issue_order, ready_after
from elaswave.plan.chunks import ChunkIndex, ChunkKey
from elaswave.plan.plan import Plan
from elaswave.precision import compute_dtype
from elaswave.runtime.actuator import Actuator
from elaswave.runtime.experts import attach as attach_experts
from elaswave.tensor.shards import TensorShards
from elaswave.zero.bucket import Bucket
from elaswave.zero.optimizer import ShardedAdamW
from elaswave.zero.reduce import Gathering, GradAccumulator, Reduction
from elaswave.zero.watch import LayerWatch


@dataclass
class RankState:
    rank: int
    plan: Plan
    stage: Stage
    schedule: list[Action]
    executor: Executor
    accumulator: GradAccumulator
    buckets: list[Bucket]
    groups: list[Group]
    world: Group
    """Every rank of the epoch: loss exchange, norms, snapshots, pipeline p2p."""
    reduction: Reduction
    """The step's gradient sums, bucket by bucket as the schedule makes them whole."""
    gathering: Gathering
    """The last update's parameter all-gathers, each waited for by the first forward that reads it."""
    optimizer: ShardedAdamW
    chunk_index: ChunkIndex
    device: torch.device
    backend_name: str
    norm_needs_exchange: bool
    """Decided from the plan, the same on every rank: with pipelines of different depths some ranks
    hold every layer and others do not, yet all must take part in the exchange."""
    shards: TensorShards | None = None
    """A tensor-parallel rank's view of the whole model (its norm and digests); None without tp."""
    experts: dict | None = None
    """Its MoE blocks' expert-parallel group and placement this epoch (runtime/experts.py)."""

    @property
    def epoch(self) -> int:
        return self.plan.epoch


def build_rank(cfg: JobConfig, plan: Plan, rank: int, stage: Stage, sampler: Sampler | None, world: Group,
               comm: Communicator, device: torch.device, backend_name: str, gen: int = 0,
               chunks: Mapping[ChunkKey, torch.Tensor] | None = None,
               before: Callable[[int, Action], None] | None = None,
               actuator: Actuator | None = None, fault: Callable[[int, str], None] | None = None) -> RankState:
    """``gen``/``chunks``: the optimizer generation and the chunk states to start from (a recovery);
    ``actuator``: where this rank's planned frequency level goes (emulated compute reads it);
    ``fault``: (step, phase) -> fault injection inside an expert exchange."""
    t, par = cfg.train, cfg.parallel
    d, s = plan.position(rank)
    pipeline = plan.pipelines[d]
    model = stage.model
    numels = stage.units.numels
    buckets, groups, built = [], [], {}
    for holders, layers in plan.gradient_buckets():
        if rank not in holders:
            continue
        if holders not in built:  # one group, however many buckets its layers are cut into
            built[holders] = world if holders == world.members else comm.adopt(
                comm.build(holders, plan.epoch, kind="holders"), holders, plan.epoch)
        buckets.append(Bucket(holders, layers, [numels[i] for i in layers], par.chunk_numel, rank, device,
                              owners=[plan.chunk_owners[i] for i in layers]))
        groups.append(built[holders])
    # The float32 masters come from the layers as built (or from ``chunks``), before the layers
    # are rounded to the compute dtype.
    optimizer = ShardedAdamW(buckets, stage.layers, t, gen, chunks)
    dtype = compute_dtype(t.precision, device)
    for layer in stage.layers:
        layer.cast(dtype)
    k = plan.units_per_micro_batch
    # One fold per unit when each is computed alone (deterministic reshaping): the reference's bound.
    folds = t.num_micro_batches * (k if t.deterministic else 1)
    accumulator = GradAccumulator(stage.layers, t.deterministic, t.grad_fixed_point_bits, folds)
    experts = attach_experts(cfg, plan, rank, stage, accumulator, world, comm, built)
    # With model chunks the pipeline's ranks form a ring: the last one's chunk c feeds the first one's c + 1.
    ring, depth = plan.virtual_stages > 1, len(pipeline)
    at, whole = layout_stage(plan, rank, s, depth)  # a broken pipeline's survivor: its tags follow the whole ring's
    first, last = at == 0, at == whole - 1
    p2p = P2P(world, pipeline[s - 1] if s > 0 or ring else None, pipeline[(s + 1) % depth] if s < depth - 1 or ring else None,
              (t.micro_batch_size, getattr(model, "boundary_tokens", model.seq_len), model.hidden_size), device, dtype,
              plan.virtual_stages, first=first, last=last)
    ghosts = frozenset(plan.ghosts[d])  # (they send nothing down the pipeline: plan/experts.py)
    # A mixture of experts' load-balancing loss spans every (virtual) stage a micro-batch passes:
    # its statistics travel beside the messages (pipeline/balance.py), on detours too. Relayed with
    # any coefficient, so the recorded value is whole.
    relayed = bool(getattr(getattr(model, "cfg", None), "num_experts", 0))
    if ring and depth > 1 and not plan.routes:  # each peer's messages in the order it sends them (p2p.py)
        p2p.expect(incoming_of(pipeline, s, plan.virtual_stages, lambda other: [a for a in stage_schedule(
            par.schedule, other, depth, plan.schedule_of(d), plan.virtual_stages) if a.micro_batch not in ghosts],
            beside=relayed))
    def step_tokens(step: int) -> int:
        return sampler.loss_tokens(step, plan.batch_units // k)
    # With detours (the reroute baseline) no per-pipeline 1F1B fits; all ranks derive one schedule.
    schedule = (plan_schedules(plan, cfg.emulate.backward_factor, par.schedule).get(rank, []) if plan.routes
                else stage_schedule(par.schedule, s, len(pipeline), plan.schedule_of(d), plan.virtual_stages))
    emulated = None
    if cfg.emulate.enabled:
        emulated = EmulatedCompute(layer_forward_s(cfg, model), cfg.emulate.backward_factor, stage.chunks,
                                   actuator or Actuator())
    shards = TensorShards(model, stage.layers, buckets, model.cut.group) if par.tp > 1 else None
    # Each bucket's sum starts once this rank's schedule has made its gradients whole (plan/buckets.py:
    # a bucket's layers are computed by the same chunks, so its first tells).
    ready = [ready_after(schedule, gradient_chunks(plan, rank, plan.layer_of(b.layers[0]))) if par.overlap_grad_reduce
             else len(schedule) for b in buckets]
    reduction = Reduction(buckets, groups, accumulator, reduce_scatter_is_all_reduce(backend_name),
                          issue_order([(b.holders, b.layers) for b in buckets], plan.layer_of), ready, len(schedule),
                          cfg.emulate.link_gbps if cfg.emulate.enabled else 0.0)
    # A bucket's all-gather is waited for at the first forward of a layer that reads it: its units', or a tied use.
    gathering = Gathering(buckets, groups, [{*map(plan.layer_of, b.layers), *(u for o, u in plan.ties if o in b.layers)}
                                            for b in buckets], cfg.emulate.link_gbps if cfg.emulate.enabled else 0.0)
    stage.reads = gathering.before_layer
    executor = Executor(stage, p2p, sampler, step_tokens, accumulator.add_micro_batch, before, emulated,
                        pieces_of(plan, t) if k > 1 else None, after=reduction.after)
    executor.ghosts = ghosts
    if not plan.routes and depth > 1:  # each send freed once the peer must have taken it (pipeline/release.py)
        every = [stage_schedule(par.schedule, other, depth, plan.schedule_of(d), plan.virtual_stages) for other in range(depth)]
        executor.releases = {i: [(pipeline[dst], tag) for dst, tag in sends]
                             for i, sends in send_releases(every, s, plan.virtual_stages, ghosts).items()}
    # ... and within the backward that makes them whole, layer by layer (zero/watch.py).
    executor.watch = (LayerWatch(stage.layers, accumulator, reduction, emulated, stage.followers)
                      if par.overlap_grad_reduce else None)
    for exchange in experts["exchanges"] if fault is not None else ():
        exchange.fault = lambda what: fault(executor.step, what)
    if relayed:
        executor.relay = BalanceRelay(model, t.num_micro_batches * t.micro_batch_size, device)
    return RankState(
        rank=rank, plan=plan, stage=stage, shards=shards, experts=experts,
        schedule=schedule,
        executor=executor,
        accumulator=accumulator, buckets=buckets, groups=groups, world=world, reduction=reduction, gathering=gathering,
        optimizer=optimizer,
        chunk_index=ChunkIndex.build(numels, par.chunk_numel), device=device, backend_name=backend_name,
        norm_needs_exchange=not (reduce_scatter_is_all_reduce(backend_name) and all(
            plan.chunk_ranges(r) == ((0, plan.num_layers),) for r in plan.ranks)
            and all(h == plan.ranks for h in plan.expert_holders)))  # (experts held by their owners alone)


def pieces_of(plan: Plan, t):
    """A reshaped plan's micro-batch -> its computations (:class:`~elaswave.pipeline.executor.Executor`):
    its sequences as one batch, or in deterministic mode each unit alone, keyed by the unit."""
    rows = t.micro_batch_size // plan.units_per_micro_batch

    def pieces(mb: int):
        first, count = plan.first_unit(mb), plan.units_of(mb)
        if t.deterministic:
            return [(first + i, ((first + i) * rows, rows)) for i in range(count)]
        return [(first, (first * rows, count * rows))]
    return pieces
