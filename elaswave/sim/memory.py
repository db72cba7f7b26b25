"""Which layouts of a model survive the loss of a stage within a device's memory: the runtime's
memory model (elaswave.plan.memory, built by elaswave.runtime.memory) and its planner, for a job
too large to run here.

A layout *survives* the loss of stage ``s`` of a pipeline when the planner re-partitions that
pipeline's survivors within the limit (they go on training); otherwise they *stand by* -- the
other pipelines carry the whole batch until ranks join -- or, with no other pipeline, the job
*stops* (after saving its state).
"""
from __future__ import annotations

import ctypes
from dataclasses import replace

import torch

from elaswave import config
from elaswave.model.contract import counted_numels, tie_pairs
from elaswave.plan.buckets import size_starts
from elaswave.plan.memory import MIB, MemoryModel, rank_bytes
from elaswave.plan.plan import PlanError, initial_plan
from elaswave.plan.replan import replan
from elaswave.runtime.memory import config_memory_model


def survival(sets: list[str], layouts: list[tuple[int, int]], limit_mib: float, device: str = "cuda") -> list[dict]:
    """For each ``(dp, pp)``: whether the job (config ``sets``) starts within ``limit_mib`` per
    device, its largest modelled rank, and what the loss of each stage of pipeline 0 leads to."""
    out = []
    cfg, model, memory = job_memory(sets, device)  # the same for every layout
    costs, numels = [c.flops_per_token for c in model.layer_costs()], counted_numels(model)
    for dp, pp in layouts:
        row = {"dp": dp, "pp": pp, "activation_checkpointing": cfg.train.activation_checkpointing}
        try:
            plan = initial_plan(dp * pp, dp, pp, costs, cfg.train.num_micro_batches, numels, cfg.parallel.chunk_numel,
                                stage_memory_limit=limit_mib, ties=tie_pairs(model), memory=memory,
                                bucket_starts=size_starts(numels, cfg.parallel.bucket_numel))
        except PlanError as exc:
            out.append({**row, "starts": False, "why": str(exc)})
            continue
        row.update(starts=True, peak_gib=max(rank_bytes(memory, plan, r)["total"] for r in plan.ranks) / 2 ** 30)
        outcomes = []
        for lost in plan.pipelines[0]:
            live = [r for r in plan.ranks if r != lost]
            try:
                after = replan(plan, live, 1, cfg.train.num_micro_batches, detours=False)
            except PlanError:
                outcomes.append("stops")
                continue
            outcomes.append("re-partitions" if after.micro_batches[0] else "stands by")
            if after.micro_batches[0]:
                worst = max(rank_bytes(memory, after, r)["total"] for r in after.pipelines[0]) / MIB
                row["peak_after_gib"] = max(row.get("peak_after_gib", 0.0), worst / 1024)
        row["after_loss"] = {o: outcomes.count(o) for o in sorted(set(outcomes))}
        out.append(row)
    return out


def job_memory(sets: list[str], device: str = "cuda"):
    """(the config, the model, its memory model) of the job configured by ``sets`` on a ``device``
    of that type."""
    cfg = config.load(None, sets)
    dev = torch.device(device)
    try:
        return (cfg, *config_memory_model(cfg, dev, None if dev.type == "cpu" else _gpu_dtype(cfg.train.precision)))
    finally:
        _return_freed_heap()


def _return_freed_heap() -> None:
    """Hand the heap the measurement freed back to the system. Measuring a large model frees
    ~0.5 GB of small host allocations a call (llama3-405b) that glibc keeps; a sweep over many
    configurations in one process (bench/sim/llama3_405b.py) grew to 23 GB and was OOM-killed."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to hand back this way
        pass


def _gpu_dtype(precision: str) -> torch.dtype:
    """The dtype the runtime computes in on a GPU with bfloat16 (what ``auto`` resolves to there)."""
    return torch.float32 if precision == "fp32" else torch.bfloat16


def tp_shard(memory: MemoryModel, tp: int) -> MemoryModel:
    """What one GPU of a TP group of ``tp`` holds (Megatron's split with sequence parallelism): a
    ``1/tp`` share of every layer's values -- so of its gradients, optimizer state and snapshots --
    and of every activation it keeps or sends (and, under ZB-H1, keeps for a W). The norms'
    replicated weights are counted in the share too (under 0.01 % of a block at these widths)."""
    if tp == 1:
        return memory
    return replace(memory, layer_numels=tuple(-(-n // tp) for n in memory.layer_numels),
                   tied_numels=tuple(-(-n // tp) for n in memory.tied_numels),
                   layer_activation_bytes=tuple(b / tp for b in memory.layer_activation_bytes),
                   layer_held_for_w_bytes=tuple(b / tp for b in memory.layer_held_for_w_bytes),
                   boundary_bytes=memory.boundary_bytes / tp)
