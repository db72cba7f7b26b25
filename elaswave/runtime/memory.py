"""The job's memory model (elaswave.plan.memory) built from its config and model, and the
measurement it is checked against: the peak of one step's tensor bytes.

The measurement is the allocator's, not the model's: every tensor alive when the step starts
(found through the garbage collector, each storage counted once), plus the highest the CPU
allocator's running total of the step's own allocations reaches (torch.profiler's memory events;
on CUDA, ``max_memory_allocated``). Temporaries inside a kernel, gloo's buffers and the Python heap
are not tensors and are not in it.
"""
from __future__ import annotations

from dataclasses import replace

import gc
import json
import os
import tempfile
from typing import Callable

import torch

from elaswave.config import JobConfig
from elaswave.data.corpus import corpus_bytes
from elaswave.model.contract import Model, on_meta, saved_activation_bytes, tie_pairs, untie
from elaswave.model.registry import model_for
from elaswave.model.units import units_of
from elaswave.pipeline.zero_bubble import held_for_w_bytes
from elaswave.plan.buckets import size_starts
from elaswave.plan.memory import MIB, MemoryModel, by_cost, rank_bytes
from elaswave.plan.partition import least_memory
from elaswave.plan.plan import initial_plan
from elaswave.plan.recompute import every_block
from elaswave.precision import compute_dtype


def job_memory_model(cfg: JobConfig, model: Model, dtype: torch.dtype, device: torch.device) -> MemoryModel:
    t = cfg.train
    units = units_of(model)
    fused = not t.deterministic  # fast mode's scaled_dot_product_attention: a fused kernel on CPU and GPU
    sums = 8 if t.deterministic else (0 if dtype == torch.float32 else 4)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    ties = tie_pairs(model)
    shapes, frozen = {}, []
    with on_meta():
        for tie in model.ties:
            layer = model.build_layer(tie.owner, 0, init=False)
            shapes[(tie.owner, tie.user)] = dict(layer.named_parameters())[tie.owner_param].numel()
            if not dict(layer.named_parameters())[tie.owner_param].requires_grad:
                shapes[(tie.owner, tie.user)] = 0  # a frozen tensor is shared: its user keeps no gradient
        if cfg.model.lora.enabled:
            for i in range(model.num_layers):
                layer = model.build_layer(i, 0, init=False)
                untie(model, layer, i)
                frozen.append(sum(p.numel() for p in layer.parameters() if not p.requires_grad))
    return MemoryModel(
        layer_numels=units.layer_numels, expert_numels=units.numels[model.num_layers:],
        expert_layers=units.expert_layers, expert_share=1.0 / cfg.parallel.ep,
        layer_activation_bytes=tuple(float(b) for b in saved_activation_bytes(
            model, t.micro_batch_size, dtype, fused, selective=t.activation_checkpointing == "selective")),
        boundary_bytes=float(t.micro_batch_size * model.seq_len * model.hidden_size * itemsize),
        param_bytes=itemsize, sum_bytes=sums, chunk_numel=cfg.parallel.chunk_numel,
        grad_bytes=0 if sums == 4 else itemsize,  # fast bfloat16: gradients go straight into the sum
        ties=ties, tied_numels=tuple(shapes[p] for p in ties),
        recomputed=frozenset(i for i in range(model.num_layers) if t.checkpointed(i, model.num_layers)),
        plan_recomputation=t.activation_checkpointing == "auto",
        snapshots=cfg.elastic.enabled and cfg.elastic.snapshots, snapshot_copies=cfg.elastic.snapshot_copies,
        snapshots_to_host=device.type == "cuda",
        generation_before_to_host=device.type == "cuda",
        reduce_whole=device.type != "cuda",  # gloo off a GPU: the reduce-scatter is an all-reduce
        split_backward=cfg.parallel.schedule == "zb-h1", frozen_numels=tuple(frozen),
        layer_held_for_w_bytes=(tuple(float(b) for b in held_for_w_bytes(model, t.micro_batch_size, dtype))
                                if cfg.parallel.schedule == "zb-h1" else ()),
        overlap_grad_reduce=cfg.parallel.overlap_grad_reduce, overlap_param_gather=cfg.parallel.overlap_param_gather,
        data_bytes=float(corpus_bytes(cfg.data)))


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage Python reaches now, each storage once."""
    seen: dict[tuple[str, int], int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            try:
                s = obj.untyped_storage()
            except RuntimeError:  # a tensor without storage (e.g. a sparse or functional wrapper)
                continue
            if s.data_ptr():
                seen[(str(s.device), s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def measure_peak(fn: Callable[[], object], device: torch.device) -> tuple[object, int, int]:
    """``(fn(), bytes alive before it, peak bytes while it ran)``."""
    gc.collect()
    before = live_tensor_bytes()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result, before, before + torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    # The memory events' "Total Allocated" is the allocator's running total of what was allocated
    # while profiling and is still alive: its highest value is the step's own peak.
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = json.load(fh)["traceEvents"]
    finally:
        os.unlink(path)
    peak = max((e["args"]["Total Allocated"] for e in events
                if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0), default=0)
    return result, before, before + peak


def measure_step(st, train_step: Callable[[], object], device: torch.device) -> tuple[object, int, int]:
    """:func:`measure_peak` of a training step with none of its parameter all-gathers out at its
    start or its end: torch's CPU profiler crashed ranks (SIGSEGV, 1-3 runs in 8) with all-gathers
    running on gloo's threads as it started or stopped (``st``: the rank's RankState)."""
    st.gathering.settle()

    def measured():
        out = train_step()
        st.gathering.settle()
        return out
    return measure_peak(measured, device)


def config_memory_model(cfg: JobConfig, device: torch.device, dtype: torch.dtype | None = None) -> tuple[Model, MemoryModel]:
    """(the job's model, its memory model) from the config alone, on a ``device`` of that type
    (``dtype``: the compute dtype, when the device is not here to ask: the simulator's GPUs)."""
    model = model_for(cfg)
    return model, job_memory_model(cfg, model, dtype or compute_dtype(cfg.train.precision, device), device)


def least_stage_memory_mb(cfg: JobConfig, num_stages: int, pipelines: int, device: torch.device | None = None) -> float:
    """The least ``parallel.stage_memory_mb`` under which the job's model splits into pipelines of
    ``num_stages`` stages, ``pipelines`` of them (what to ask for; what tests set limits around)."""
    model, memory = config_memory_model(cfg, device or torch.device("cpu"))
    return least_mb(cfg, model, memory, num_stages, pipelines)


def least_mb(cfg: JobConfig, model: Model, memory: MemoryModel, num_stages: int, pipelines: int) -> float:
    """:func:`least_stage_memory_mb` of ``model`` and its ``memory``. Where the planner partitions
    by memory, the minimax of stage memory; where it partitions by cost and checks after (virtual
    stages, or recomputation it chooses: plan/memory.by_cost), the largest rank of that plan --
    with every block recomputed, where the plan recomputes what it must: a limit it meets (with
    one chunk a rank a little less may still fit, partitioned as full is: recompute.auto_partition)."""
    t = cfg.train
    if not by_cost(cfg.parallel.virtual_stages, memory):
        return least_memory(model.num_layers, num_stages, memory.stage_memory(num_stages, pipelines, t.num_micro_batches))
    units = units_of(model)
    plan = initial_plan(num_stages * pipelines, pipelines, num_stages, [c.flops_per_token for c in model.layer_costs()],
                        t.num_micro_batches, units.numels, cfg.parallel.chunk_numel, ties=tie_pairs(model),
                        memory=memory, units_per_micro_batch=t.micro_batch_size if cfg.elastic.reshape else 1,
                        virtual_stages=cfg.parallel.virtual_stages, unit_layers=units.expert_layers, ep=cfg.parallel.ep,
                        bucket_starts=size_starts(units.numels, cfg.parallel.bucket_numel, units.expert_layers))
    plan = replace(plan, snapshot_copies=cfg.elastic.snapshot_copies)
    if memory.plan_recomputation:
        plan = every_block(plan)
    return max(rank_bytes(memory, plan, r)["total"] for r in plan.ranks) / MIB
