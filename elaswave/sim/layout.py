"""Which layout ``elaswave simulate`` plans: the one asked for or the preferred one, and the first
of those that fits the device memory (pure but for the ConfigErrors that name the flags)."""
from __future__ import annotations

import math
from dataclasses import replace

from elaswave.errors import ConfigError
from elaswave.pipeline.schedule import GENERATORS
from elaswave.plan.buckets import size_starts
from elaswave.plan.memory import MemoryModel, rank_bytes
from elaswave.plan.partition import least_memory
from elaswave.plan.plan import Plan, PlanError, initial_plan
from elaswave.plan.replan import replan
from elaswave.plan.recompute import every_block, every_block_memory
from elaswave.sim.workload import MODELS, choose_layout, model_units

def check_schedule(args) -> None:
    """``--schedule`` and ``--virtual-stages`` checked by parallel.schedule's rules (every policy
    runs each schedule: reroute's lower bound counts virtual stages)."""
    v = args.virtual_stages
    if args.schedule not in GENERATORS:
        raise ConfigError(f"--schedule={args.schedule} is invalid: choose from {', '.join(GENERATORS)}")
    if args.schedule == "interleaved" and v < 2:
        raise ConfigError(f"--virtual-stages={v} is invalid with --schedule interleaved: must be >= 2 (model chunks "
                          "a GPU; 1 is --schedule 1f1b)")
    if args.schedule != "interleaved" and v != 1:
        raise ConfigError(f"--virtual-stages={v} is invalid with --schedule {args.schedule}: must be 1; model chunks "
                          "are interleaved only by --schedule interleaved")


def layouts(args) -> list[tuple[int, int]]:
    """(dp, pp) of the plan, whose devices are TP groups (``--devices / --tp`` of them): the one
    asked for, or -- neither --dp nor --pp given -- the preferred layout (workload.choose_layout)
    followed by the deeper pipelines that also divide the groups, for when it does not fit; with
    ``--virtual-stages`` V, only pipelines whose pp x V chunks get a layer each."""
    num_layers = MODELS[args.model].num_layers
    if args.tp < 1 or args.gpus_per_node < 1 or args.gpus_per_node % args.tp or args.devices % args.tp:
        raise ConfigError(f"--tp={args.tp} is invalid with --gpus-per-node={args.gpus_per_node} and --devices="
                          f"{args.devices}: a TP group is GPUs of one node, so tp must divide both")
    groups = args.devices // args.tp
    if args.dp and args.pp:
        dp, pp = args.dp, args.pp
    elif args.pp:
        dp, pp = groups // args.pp, args.pp
    elif args.dp:
        dp, pp = args.dp, groups // args.dp
    else:
        dp, pp = choose_layout(groups, num_layers // args.virtual_stages)  # every chunk at least a layer
    if dp < 1 or pp < 1 or dp * pp != groups:
        raise ConfigError(f"--dp={args.dp} --pp={args.pp} is invalid for --devices={args.devices}"
                          f"{f' and --tp={args.tp}' if args.tp > 1 else ''}: dp x pp x tp must equal the devices")
    if pp > num_layers:
        raise ConfigError(f"--pp={pp} is invalid: {args.model} has {num_layers} layers")
    if pp * args.virtual_stages > num_layers:
        raise ConfigError(f"--virtual-stages={args.virtual_stages} is invalid with pp={pp}: {pp * args.virtual_stages} "
                          f"chunks, more than {args.model}'s {num_layers} layers; give at most {num_layers // pp} "
                          "or a smaller --pp")
    if dp * pp < 2:
        raise ConfigError(f"--devices={args.devices} is invalid with --tp={args.tp}: need at least 2 TP groups")
    _check_experts(args, dp)
    if args.dp or args.pp:
        return [(dp, pp)]
    deepest = min(num_layers // args.virtual_stages, groups // 2)
    return [(dp, pp)] + [(groups // d, d) for d in range(pp + 1, deepest + 1)
                         if groups % d == 0 and (groups // d) % args.ep == 0]


def _check_experts(args, dp: int) -> None:
    """``--ep`` (parallel.ep) as the runtime takes it: a mixture of experts' experts over groups of
    ``ep`` pipelines, dividing the pipelines and the experts; no tensor parallelism with experts."""
    m = MODELS[args.model]
    if m.num_experts and args.tp > 1:
        raise ConfigError(f"--tp={args.tp} is invalid with {args.model}: the runtime splits no mixture of experts "
                          "over tensor-parallel ranks (parallel.tp with experts is refused); use --ep")
    if args.ep == 1:
        return
    if args.ep < 1 or not m.num_experts:
        raise ConfigError(f"--ep={args.ep} is invalid with {args.model}: expert parallelism needs a mixture of experts "
                          "(mixtral-8x7b, qwen3-30b-a3b, qwen3-235b-a22b) and ep >= 1")
    if m.num_experts % args.ep or dp % args.ep:
        raise ConfigError(f"--ep={args.ep} is invalid: must divide the pipelines (dp={dp}) and {args.model}'s "
                          f"{m.num_experts} experts")


def first_fit(args, layouts, model, memory, m: int):
    """(the initial plan, dp, pp) of the first layout whose plan fits ``--device-gib`` less the
    reserve (any, without a memory model), or the ConfigError naming what the least needing needs.
    With virtual stages the planner partitions the p x V chunks by cost alone and refuses a plan
    whose modelled peak (plan/memory.rank_bytes, chunk-aware) passes the limit: what that plan
    needs is its peak, unlimited."""
    m_cfg = MODELS[args.model]
    usable_gib = args.device_gib - args.reserve_gib if memory is not None else 0.0
    over = []  # (GiB a GPU with the reserve, dp, pp) of interleaved plans above the limit

    def plan_of(dp: int, pp: int, limit_mib: float) -> Plan:
        units = model_units(m_cfg)  # (a mixture of experts' experts each its own: model/units.py)
        numels = [-(-n // args.tp) for n in units.numels]
        return initial_plan(dp * pp, dp, pp, [float(c) for c in model.layer_costs], m, numels, chunk_numel=1 << 24,
                            stage_memory_limit=limit_mib, memory=memory,
                            units_per_micro_batch=1 if args.no_reshape else args.micro_batch_size,
                            virtual_stages=args.virtual_stages, unit_layers=units.expert_layers, ep=args.ep,
                            bucket_starts=size_starts(numels, args.bucket_numel, units.expert_layers))
    for dp, pp in layouts:
        try:
            return plan_of(dp, pp, 1024 * usable_gib), dp, pp
        except PlanError as exc:
            if memory is None:
                raise ConfigError(f"the initial layout: {exc}") from None
            if (dp, pp) == layouts[0]:
                failure = exc
            if args.virtual_stages > 1:
                try:
                    plan = plan_of(dp, pp, 0.0)
                    if memory.plan_recomputation:  # the least it needs: every block recomputed
                        plan = every_block(plan)
                    over.append((peak_gib(memory, plan) + args.reserve_gib, dp, pp))
                except PlanError:
                    pass
    # The layout that needs least (the deepest, mostly) is what the message names; where the plan
    # recomputes to fit (auto), its best partition with every block recomputed (plan/recompute.by_memory).
    least = (every_block_memory(memory, m_cfg.num_layers) if memory is not None and memory.plan_recomputation
             else memory)
    need, dp, pp = min(over or [(least_memory(m_cfg.num_layers, p, least.stage_memory(p, d, m)) / 1024
                                 + args.reserve_gib, d, p) for d, p in layouts])
    if need <= args.device_gib:  # not memory: the preferred layout failed for its own reason
        raise ConfigError(f"the initial layout: {failure}") from None
    experts = m_cfg.num_experts > 0  # (no tensor parallelism with experts: expert parallelism instead)
    other = (["more stages"] if len(layouts) == 1 else []) + (["--ep"] if experts else ["--tp"]) + (
        ["--checkpointing auto"] if args.checkpointing not in ("full", "auto") else []) + (
        ["--schedule 1f1b"] if args.schedule != "1f1b" else []) + (
        ["fewer sequences a micro-batch"] if args.micro_batch_size > 1 else [])
    tried = (f" (of the layouts tried, pp={', '.join(str(p) for _, p in layouts)}, the one that needs least)"
             if len(layouts) > 1 else "")
    ways = other[0] if len(other) == 1 else f"{', '.join(other[:-1])} or {other[-1]}"
    schedule = args.schedule + (f" over {args.virtual_stages} virtual stages" if args.virtual_stages > 1 else "")
    partition = ("its partition (by cost: the planner weighs no memory with virtual stages)" if over else
                 "its best partition" + (" with every block recomputed" if memory.plan_recomputation else ""))
    raise ConfigError(f"--device-gib={args.device_gib:g} is too small for dp={dp} x pp={pp}"
                      f"{f' x tp={args.tp}' if args.tp > 1 else ''}{tried} ({args.model}, {args.micro_batch_size} "
                      f"sequence{'s' if args.micro_batch_size > 1 else ''} a micro-batch, checkpointing "
                      f"{args.checkpointing}, {schedule}): {partition} needs {need:.1f} GiB a GPU with the "
                      f"{args.reserve_gib:g} GiB reserve; give --device-gib {math.ceil(need)} or more, or {ways}")


def peak_gib(memory: MemoryModel, plan: Plan) -> float:
    """The plan's largest modelled peak of a device, GiB (:func:`~elaswave.plan.memory.rank_bytes`:
    with virtual stages every chunk's layers and the interleaved schedule's in-flight activations)."""
    return max(rank_bytes(memory, plan, r)["total"] for r in plan.ranks) / 2 ** 30


def replan_peak_gib(memory: MemoryModel, plan: Plan, events, num_micro_batches: int) -> float | None:
    """The modelled peak of elaswave's re-plan after the first failure in ``events`` (its device
    lost), whatever the limit (None: no failure, or no layout left). With virtual stages the planner
    splits the survivors' p' x V chunks by cost alone and checks the plan after: a re-split pipeline
    over the limit stands by (the others take its micro-batches), and when the others then pass it
    too the re-plan is refused; this says what the unlimited re-plan needs. Where the planner
    recomputes to fit (auto) the limit is what it recomputes against, so the re-plan is taken within
    it: what it holds (an unlimited one would recompute nothing, and read as if it could not fit)."""
    lost = next((e.device for e in events if e.kind == "fail"), None)
    if lost is None:
        return None
    try:
        within = plan if memory.plan_recomputation else replace(plan, stage_memory_limit=0.0)
        return peak_gib(memory, replan(within, [r for r in plan.ranks if r != lost], 1, num_micro_batches))
    except PlanError:
        return None
