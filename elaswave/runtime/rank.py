"""What one rank holds for an epoch, built from the plan: its stage, schedule, links, buckets,
holder-group communicators and its share of the optimizer state."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from elaswave.comm import backend
from elaswave.config import JobConfig
from elaswave.data.sampler import Sampler
from elaswave.model.gpt import build_layer
from elaswave.pipeline.executor import Executor
from elaswave.pipeline.p2p import P2P
from elaswave.pipeline.schedule import Action, one_f_one_b
from elaswave.pipeline.stage import Stage
from elaswave.plan.chunks import ChunkIndex
from elaswave.plan.plan import Plan
from elaswave.zero.bucket import Bucket
from elaswave.zero.optimizer import ShardedAdamW
from elaswave.zero.reduce import GradAccumulator


@dataclass
class RankState:
    rank: int
    plan: Plan
    stage: Stage
    schedule: list[Action]
    executor: Executor
    accumulator: GradAccumulator
    buckets: list[Bucket]
    groups: list[dist.ProcessGroup | None]
    optimizer: ShardedAdamW
    chunk_index: ChunkIndex
    device: torch.device
    backend_name: str


def layer_numels(cfg: JobConfig) -> list[int]:
    """Parameter count of every layer, from shapes alone (no weights are built)."""
    with torch.device("meta"):
        return [sum(p.numel() for p in build_layer(cfg.model, i, 0, init=False).parameters())
                for i in range(cfg.model.num_layers)]


def build_rank(cfg: JobConfig, plan: Plan, rank: int, tokens: torch.Tensor | None,
               backend_name: str, device: torch.device) -> RankState:
    t, m, par = cfg.train, cfg.model, cfg.parallel
    d, s = plan.position(rank)
    pipeline = plan.pipelines[d]
    stage = Stage(cfg, plan.layers_of(rank), device)
    numels = layer_numels(cfg)

    # Every rank creates every holder group, in the same order, as torch.distributed requires.
    buckets, groups = [], []
    for holders, layers in plan.holder_groups().items():
        group = backend.new_group(holders, backend_name, par.timeout_s) if len(holders) > 1 else None
        if rank in holders:
            buckets.append(Bucket(holders, layers, [numels[i] for i in layers], par.chunk_numel, rank, device))
            groups.append(group)

    accumulator = GradAccumulator(stage.layers, t.deterministic, t.grad_fixed_point_bits, t.num_micro_batches)
    sampler = Sampler(tokens, t.seed, t.micro_batch_size, m.seq_len) if tokens is not None else None
    p2p = P2P(pipeline[s - 1] if s > 0 else None, pipeline[s + 1] if s < len(pipeline) - 1 else None,
              (t.micro_batch_size, m.seq_len, m.d_model), device, par.timeout_s)
    global_tokens = t.num_micro_batches * t.micro_batch_size * m.seq_len
    return RankState(
        rank=rank, plan=plan, stage=stage,
        schedule=one_f_one_b(s, len(pipeline), plan.micro_batches[d]),
        executor=Executor(stage, p2p, sampler, global_tokens, accumulator.add_micro_batch),
        accumulator=accumulator, buckets=buckets, groups=groups,
        optimizer=ShardedAdamW(buckets, stage.layers, t),
        chunk_index=ChunkIndex.build(numels, par.chunk_numel), device=device,
        backend_name=backend_name)
