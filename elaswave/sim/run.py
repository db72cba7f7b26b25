"""``elaswave simulate``: build the modelled job, the trace and the policies; print a table or JSON."""
from __future__ import annotations

import functools
import json
import time
from dataclasses import asdict, replace

from elaswave.comm.config import ParallelConfig
from elaswave.config import CHECKPOINTING, is_checkpointing
from elaswave.errors import ConfigError
from elaswave.plan.frequency import CLOCKS
from elaswave.plan.memory import bytes_per_parameter
from elaswave.plan.plan import PlanError
from elaswave.sim import control, engine, layout, policies, trace, uncertainty
from elaswave.sim.engine import PolicyResult, simulate
from elaswave.sim.workload import HARDWARE, MODELS, Hardware, cluster, model_flops_per_micro_batch

DEVICE_GIB = 80.0  # every GPU preset's device (H100, A100 80 GB): what a plan must fit unless told otherwise


def add_arguments(ap) -> None:
    ap.add_argument("--devices", type=int, required=True,
                    help="GPUs in the job (each runs one stage, or a TP shard of one with --tp)")
    ap.add_argument("--dp", type=int, help="pipelines (default: chosen with --pp, or both chosen)")
    ap.add_argument("--pp", type=int, help="stages per pipeline")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor parallelism: GPUs of one node that split each stage's layers (Megatron's split with "
                         "sequence parallelism); dp x pp x tp = --devices; a GPU's failure takes its TP group")
    ap.add_argument("--ep", type=int, default=1,
                    help="expert parallelism (parallel.ep), a mixture of experts only: each MoE layer's experts spread "
                         "over groups of ep pipelines' GPUs of a stage, each held by its owners alone, tokens to them "
                         "and back by all-to-all (priced over the group's slowest link, not overlapped); must divide "
                         "dp and the experts")
    ap.add_argument("--gpus-per-node", type=int, default=Hardware().devices_per_node,
                    help="GPUs per node (default 8): the fast link, and what a TP group must fit in")
    ap.add_argument("--hardware", default="generic", choices=sorted(HARDWARE),
                    help="the device and links: generic (300 TFLOP/s at 40 %%, the default) or h100 (sourced: "
                         "elaswave/sim/workload.py)")
    ap.add_argument("--model", default="gpt-13b", choices=sorted(MODELS), help="a model preset (model.preset): its shape and costs")
    ap.add_argument("--schedule", default="1f1b",
                    help="the pipeline schedule every whole pipeline runs (parallel.schedule): 1f1b (default), zb-h1 "
                         "(zero bubble; its B and W priced at half a backward each, an assumption; every stage keeps up "
                         "to pp micro-batches' activations, as 1F1B's first stage does) or interleaved (Megatron's "
                         "interleaved 1F1B over --virtual-stages chunks a GPU). Detours run the routed schedule")
    ap.add_argument("--virtual-stages", type=int, default=1,
                    help="model chunks a GPU holds (parallel.virtual_stages): >= 2 with --schedule interleaved, "
                         "1 (the default) otherwise; pp x it must not exceed the model's layers")
    ap.add_argument("--bucket-numel", type=int, default=ParallelConfig.bucket_numel,
                    help="most values a GPU's gradient bucket holds (parallel.bucket_numel; default the runtime's, "
                         f"{ParallelConfig.bucket_numel:,}), each bucket summed and all-gathered on its own, and a "
                         "bucket's sum started within the backward that makes it whole; 0: a bucket a model chunk. "
                         "Its optimizer slots are padded as the runtime's 4,096-value chunks pad them (the "
                         "simulator plans with 2^24-value chunks)")
    ap.add_argument("--micro-batches", type=int, help="global batch in micro-batches (default 2 x pp per pipeline)")
    ap.add_argument("--micro-batch-size", type=int, default=1,
                    help="sequences per micro-batch (default 1); above 1 elaswave reshapes after a change: it deals "
                         "the global batch's sequences, not whole micro-batches (plan/microbatches.py)")
    ap.add_argument("--no-reshape", action="store_true",
                    help="elaswave deals whole micro-batches (the runtime without elastic.reshape)")
    ap.add_argument("--trace", help="a trace file (.jsonl or .csv: t_s, kind fail|join, device) or 'llama3': "
                                    "Poisson failures, one per 3 h across the job, repaired after 4 h")
    ap.add_argument("--hours", type=float, default=None, help="simulated time (default: 1 for a single failure, 24 for a trace)")
    ap.add_argument("--mtbf-h", type=float, help="synthetic trace: mean hours between failures of one device")
    ap.add_argument("--repair-h", type=float, default=4.0, help="synthetic trace: hours until a failed device is back")
    ap.add_argument("--node-failures", type=float, default=0.0, metavar="SHARE",
                    help="synthetic trace: the share of failures that take the GPU's whole node (--gpus-per-node) down "
                         "with it and back together (default 0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default=",".join(policies.POLICIES),
                    help=f"comma-separated, from {', '.join(policies.CHOICES)} (static_experts: with --ep, "
                         "elaswave with a static expert map)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="the gradient sums start when a GPU's schedule ends (parallel.overlap_grad_reduce=false), "
                         "not as each model chunk's gradients are whole, and the parameter all-gathers end before "
                         "the next step (parallel.overlap_param_gather=false), not during its first forwards")
    ap.add_argument("--no-dvfs", action="store_true",
                    help="no frequency planning: every device at nominal clocks (elaswave's rows are elaswave_no_dvfs)")
    ap.add_argument("--clocks", choices=sorted(CLOCKS), default=None,
                    help="frequency model (docs/frequency_model.md): boost (default; levels 0.6-1.2 of nominal within "
                         "the live devices' nominal power) or sustained (0.6-1.0: nominal is the top clock under load)")
    ap.add_argument("--clock-share", type=float, default=None,
                    help="the share of a stage's time that scales with its clock, in (0, 1] (default: the sourced "
                         f"model's {CLOCKS['boost'].clock_share:g}, docs/frequency_model.md)")
    ap.add_argument("--band", nargs="?", const="0.5,1", metavar="LO,HI",
                    help="also run every policy at the clock model's four corners (sustained and boost clocks, LO and "
                         "HI of step time scaling with the clock; default 0.5,1) and print each ratio's range (5x the time)")
    ap.add_argument("--calibration", metavar="FILE.json",
                    help="a calibration results file (bench/results/sim_calibration.json): every ratio and step time "
                         "also printed with its largest held-out prediction error")
    ap.add_argument("--device-gib", type=float, default=DEVICE_GIB,
                    help="device memory: every plan, first and after each failure, keeps each device's modelled peak "
                         "within it (elaswave/plan/memory.py, bf16, --micro-batch-size sequences; with --virtual-stages "
                         "a plan over it is refused, without a stand-by); without --dp and "
                         f"--pp the layout is the first that fits (default {DEVICE_GIB:g}: an H100/A100's; 0: no limit)")
    ap.add_argument("--reserve-gib", type=float, default=8.0,
                    help="with --device-gib: memory no plan may use, for the CUDA context, NCCL's buffers and the "
                         "allocator's fragmentation (default 8, an assumption: 10 %% of 80 GiB)")
    ap.add_argument("--checkpointing", default="none",
                    help="activation checkpointing (train.activation_checkpointing): none, full, selective, every_N or "
                         "auto (each rank recomputes the fewest blocks that fit --device-gib, chosen again at every "
                         "re-plan); less memory, and each backward runs again what is recomputed (a block's forward "
                         "with its TP collectives, or selective's attention core)")
    ap.add_argument("--spares", type=int, default=0,
                    help="every row: idle devices beside the layout; one takes a failed device's place after the "
                         "warm-spare join time (bench/results/join.md), the repaired device returns to the pool")
    ap.add_argument("--cold-spares", action="store_true",
                    help="the spares start their process on the failure (a cold replacement's join time)")
    ap.add_argument("--store", default="dedicated",
                    help=f"elaswave's rows, the control store's host ({', '.join(control.STORE_MODES)}): dedicated, a "
                         "host the trace never fails (default); floor, on the first training host, its loss a restart "
                         "from the last committed step; failover, there too, moved to a survivor on its loss")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--plot", metavar="FILE.png", help="also draw throughput over time, goodput and time lost per failure")


def _memory(args, micro_batches: int):
    """The runtime's memory model of the job (bf16, ``--micro-batch-size`` sequences a micro-batch)."""
    from elaswave.sim.memory import tp_shard
    if args.device_gib < 0:
        raise ConfigError(f"--device-gib={args.device_gib} is invalid: must be >= 0 (0: no limit)")
    if not 0 <= args.reserve_gib < args.device_gib:
        raise ConfigError(f"--reserve-gib={args.reserve_gib:g} is invalid with --device-gib={args.device_gib:g}: the "
                          "reserve is a part of the device's memory, >= 0 and below it")
    # Its ZeRO chunks are 2^24 values, a planning grain: slots pad as the runtime's chunks do.
    return replace(tp_shard(_job_memory(args.model, args.micro_batch_size, micro_batches, args.checkpointing,
                                        args.schedule, args.virtual_stages), args.tp),
                   slot_chunk_numel=ParallelConfig.chunk_numel, expert_share=1.0 / args.ep)


@functools.lru_cache(maxsize=16)
def _job_memory(model: str, micro_batch_size: int, micro_batches: int, checkpointing: str, schedule: str,
                virtual_stages: int = 1):
    # Measuring a model's activations runs its layers on the meta device: seconds a call, and a
    # sweep or a program that simulates many layouts asks for the same few models again.
    from elaswave.sim.memory import job_memory
    return job_memory([f"model.preset={model}", "train.precision=bf16", f"train.micro_batch_size={micro_batch_size}",
                       f"train.num_micro_batches={micro_batches}", f"train.activation_checkpointing={checkpointing}",
                       f"parallel.chunk_numel={1 << 24}", f"parallel.schedule={schedule}",
                       f"parallel.virtual_stages={virtual_stages}"])[2]


def _events(args, plan, duration_s: float) -> list[trace.Event]:
    """The plan's devices' events: a GPU trace seen by TP groups, or one failure of a plan device."""
    nodes = {"node_share": args.node_failures, "per_node": args.gpus_per_node}
    if args.node_failures and not (args.trace == "llama3" or args.mtbf_h):
        raise trace.TraceError(f"--node-failures={args.node_failures} is invalid without a synthetic trace "
                               "(--trace llama3 or --mtbf-h): a trace file says itself which devices fail together")
    if args.trace == "llama3":
        gpus = trace.poisson(args.devices, 3.0 * args.devices, duration_s / 3600, args.repair_h, args.seed, **nodes)
    elif args.trace:
        gpus = trace.load(args.trace, args.devices)
    elif args.mtbf_h:
        gpus = trace.poisson(args.devices, args.mtbf_h, duration_s / 3600, args.repair_h, args.seed, **nodes)
    else:
        gpus = None
    if gpus is not None:
        trace.check(gpus, args.devices)
        return trace.groups(gpus, args.tp)
    # One failure: the middle stage of the first pipeline, a tenth into the run.
    pipe = plan.pipelines[0]
    return trace.single_failure(pipe[len(pipe) // 2], duration_s / 10)


def run(args) -> int:
    began = time.perf_counter()
    if args.devices < 2:
        raise ConfigError(f"--devices={args.devices} is invalid: need at least 2")
    if args.bucket_numel < 0:
        raise ConfigError(f"--bucket-numel={args.bucket_numel} is invalid: must be >= 0 (0: a bucket a model chunk)")
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in names if p not in policies.CHOICES]
    if bad or not names:
        raise ConfigError(f"--policies={args.policies} is invalid: choose from {', '.join(policies.CHOICES)}")
    if args.no_dvfs and args.clocks:
        raise ConfigError(f"--clocks={args.clocks} is invalid with --no-dvfs: without frequency planning every "
                          "device stays at nominal; drop one of them")
    if args.no_dvfs:
        if args.policies != ",".join(policies.POLICIES) and "elaswave" in names:
            raise ConfigError(f"--policies={args.policies} is invalid with --no-dvfs: policy elaswave plans frequencies; "
                              "name elaswave_no_dvfs, or drop --no-dvfs")
        names = list(dict.fromkeys(n for n in names if n != "elaswave"))
    layout.check_schedule(args)
    if not is_checkpointing(args.checkpointing):
        raise ConfigError(f"--checkpointing={args.checkpointing} is invalid: choose {CHECKPOINTING}")
    ctl = _control(args, names)
    layouts = layout.layouts(args)
    dp, pp = layouts[0]
    m_cfg = MODELS[args.model]
    m = args.micro_batches or 2 * pp * dp  # the same for every candidate layout: dp x pp is the groups
    if m < dp:
        raise ConfigError(f"--micro-batches={m} is invalid: need at least one per pipeline ({dp})")
    if args.micro_batch_size < 1:
        raise ConfigError(f"--micro-batch-size={args.micro_batch_size} is invalid: sequences per micro-batch, >= 1")
    if args.no_reshape and args.micro_batch_size == 1:
        raise ConfigError("--no-reshape is invalid with --micro-batch-size=1: a micro-batch of one sequence is "
                          "never reshaped; give a larger --micro-batch-size")
    if args.clock_share is not None and not 0 < args.clock_share <= 1:
        raise ConfigError(f"--clock-share={args.clock_share} is invalid: the share of step time that scales with the "
                          "clock, in (0, 1]")
    if args.no_dvfs and (args.band or args.clock_share is not None):
        raise ConfigError(f"--{'band' if args.band else 'clock-share'} is invalid with --no-dvfs: every device stays "
                          "at nominal, so no clock changes anything; drop one of them")
    try:
        calibration = uncertainty.calibration_error(args.calibration) if args.calibration else None
        shares = uncertainty.parse_shares(args.band) if args.band else None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    power = CLOCKS[args.clocks or "boost"]
    if args.clock_share is not None:
        power = replace(power, clock_share=args.clock_share)
    hw = replace(HARDWARE[args.hardware], devices_per_node=args.gpus_per_node)
    model = replace(cluster(m_cfg, args.micro_batch_size, hw, args.tp, args.schedule, args.checkpointing, args.ep),
                    power=power,
                    overlap_grad_reduce=not args.no_overlap, overlap_param_gather=not args.no_overlap)
    memory = _memory(args, m) if args.device_gib else None
    plan, dp, pp = layout.first_fit(args, layouts, model, memory, m)
    single = not (args.trace or args.mtbf_h)
    duration_s = 3600.0 * (args.hours if args.hours is not None else (1.0 if single else 24.0))
    try:
        events = _events(args, plan, duration_s)
    except trace.TraceError as exc:
        raise ConfigError(str(exc)) from None
    try:
        trace.check(events, dp * pp)
    except trace.TraceError as exc:
        seen = f" (as its TP groups of {args.tp} GPUs see it: a group is down while any of its GPUs is)" if args.tp > 1 else ""
        raise ConfigError(f"{exc}{seen}") from None
    costs = policies.BaselineCosts()

    def rows(power):
        """Every policy on the trace with ``power``'s clocks: (results, failure-free plan, its clock gain)."""
        clocked = replace(model, power=power)
        start = policies.failure_free(plan, m, None if args.no_dvfs else power)
        gain = engine.priced(plan, clocked)[1] / engine.priced(start, clocked)[1]
        out: dict[str, PolicyResult] = {}
        for name in names:
            try:
                row = ctl if name.startswith("elaswave") else replace(ctl, store="dedicated")
                out[name] = simulate(events, policies.make(name, plan, m, clocked, costs, row, start), clocked, duration_s)
            except PlanError as exc:
                raise ConfigError(f"policy {name}: {exc}") from None
        return out, start, gain

    results, start, clock_gain = rows(model.power)
    corners = [rows(uncertainty.corner_power(c, s)) for c, s in uncertainty.corners(shares)] if shares else []
    bands = _bands(results, corners)
    gain_band = uncertainty.band([clock_gain] + [c[2] for c in corners]) if corners else None
    # Interleaved: a re-plan over the memory limit is refused, with no stand-by; say what it needs.
    after_gib = (layout.replan_peak_gib(memory, plan, events, m)
                 if memory is not None and args.virtual_stages > 1 else None)
    wall = time.perf_counter() - began
    # The failure-free plan as MFU counts it (every row starts from the same plan).
    step_s = m / next(iter(results.values())).throughput_before
    gpus = dp * pp * args.tp
    tflops = m * model_flops_per_micro_batch(m_cfg, args.micro_batch_size) / step_s / gpus / 1e12
    failure_free = {"step_s": step_s, "model_tflops_per_gpu": tflops, "mfu": tflops / hw.device_tflops}
    config = {"hardware": {"name": args.hardware, **asdict(hw)}, "failure_free": failure_free,
              "devices": args.devices, "dp": dp, "pp": pp, "preferred_layout": list(layouts[0]), "tp": args.tp, "ep": args.ep,
              "gpus_per_node": args.gpus_per_node,
              "model": args.model, "micro_batches": m, "pipeline_schedule": args.schedule,
              "overlap_grad_reduce": not args.no_overlap, "overlap_param_gather": not args.no_overlap,
              "virtual_stages": args.virtual_stages,
              "peak_gib": layout.peak_gib(memory, plan) if memory is not None else None,
              "peak_gib_after_first_failure": after_gib,
              "micro_batch_size": args.micro_batch_size, "reshape": not args.no_reshape and args.micro_batch_size > 1,
              "device_gib": args.device_gib, "reserve_gib": args.reserve_gib if args.device_gib else None,
              "bytes_per_parameter": bytes_per_parameter(memory, dp) if memory is not None else None,
              "checkpointing": args.checkpointing, "dvfs": not args.no_dvfs,
              "clocks": None if args.no_dvfs else args.clocks or "boost",
              "clock_share": None if args.no_dvfs else model.power.clock_share, "seq_len": m_cfg.seq_len,
              "failure_free_clock_gain": clock_gain, "failure_free_clock_gain_band": gain_band,
              "band_corners": [list(c) for c in uncertainty.corners(shares)] if corners else None,
              "calibration": asdict(calibration) if calibration else None,
              "schedules": {n: policies.make_class(n).schedule for n in names}, "frequency_solver": start.frequency_solver or None,
              "hours": duration_s / 3600, "failures": sum(e.kind == "fail" for e in events),
              "joins": sum(e.kind == "join" for e in events), "trace": args.trace or ("poisson" if args.mtbf_h else "single"),
              "node_failures": args.node_failures,
              "spares": ctl.spares, "warm_spares": ctl.warm, "store": ctl.store,
              "costs": asdict(costs), "control_costs": asdict(ctl.costs), "wall_s": wall}
    if args.plot:
        from elaswave.sim.plots import plot

        plot(results, f"{args.devices} devices (dp={dp} x pp={pp}), {args.model}, {config['failures']} failures, "
                      f"{config['joins']} repairs over {config['hours']:g} h", duration_s, args.plot)
    if args.json:
        best = _best_baseline_after(results)
        tokens = args.micro_batch_size * m_cfg.seq_len
        docs = {n: {**r.to_doc(), "after_over_best_baseline_after":
                    r.throughput_after / best if best and r.throughput_after is not None else None,
                    **_absolute(r, m, tokens), "band": bands.get(n), "plus_minus": _plus_minus(r, m, tokens, calibration)}
                for n, r in results.items()}
        print(json.dumps({"config": config, "policies": docs}))
        return 0
    print(f"elaswave simulate: {args.devices} devices (dp={dp} x pp={pp}{f' x tp={args.tp}' if args.tp > 1 else ''}), {args.model}, {m} micro-batches of "
          f"{args.micro_batch_size} per step{' (reshaped after a change)' if config['reshape'] else ''}, "
          f"{config['hours']:g} h, {config['failures']} failures, {config['joins']} joins; {wall:.1f} s")
    chunks = f", {args.virtual_stages} virtual stages" if args.virtual_stages > 1 else ""
    print(f"failure-free ({args.schedule}{chunks}): step {step_s:.2f} s, {tflops:.0f} model TFLOP/s per GPU, MFU {100 * tflops / hw.device_tflops:.1f} % "
          f"of {hw.device_tflops:g} ({args.hardware} hardware, {hw.efficiency:g} of the peak in a layer's compute)")
    if not args.no_dvfs:
        solver = {"exact": "the exact DP", "greedy": "the greedy LP relaxation (within one level's upgrade of the "
                  "least power)"}.get(start.frequency_solver, "none: nominal clocks")
        print(f"failure-free clock plan ({config['clocks']} clocks, {model.power.clock_share:g} of step time scaling "
              f"with the clock, levels by {solver}): {clock_gain:.3f}x the throughput at nominal clocks"
              f"{_span(gain_band)}; every row starts from it, a baseline keeps each stage's clock after a change")
    if memory is not None:
        peak = config["peak_gib"]
        after = "" if after_gib is None else (
            f" (the first failure's re-plan holds {after_gib:.1f} GiB, recomputing to fit)" if memory.plan_recomputation
            else f" (the first failure's re-plan needs {after_gib:.1f} GiB without a limit)")
        kept = ("every re-plan keeps within the rest or stands survivors by" if args.virtual_stages == 1 else
                "the planner splits interleaved chunks by cost and checks the plan against the rest: after a loss a "
                "re-split pipeline over it stands by, and with the others over it too the job stalls until a repair"
                + after)
        said = " (the default for GPU presets; --device-gib)" if args.device_gib == DEVICE_GIB else ""
        moved = (f"; pp={pp}: the first layout that fits, from pp={layouts[0][1]} to deeper pipelines"
                 if (dp, pp) != layouts[0] else "")
        print(f"memory: modelled peak {peak:.1f} GiB of {args.device_gib:g}{said} per GPU, {args.reserve_gib:g} GiB of it "
              f"kept in reserve (bf16, checkpointing {args.checkpointing}, {args.schedule}); {kept}{moved}")
        per_param = sum(bytes_per_parameter(memory, dp).values())
        print(f"static bytes per parameter: {per_param:.2f} (Megatron's distributed optimizer: {6 + 12 / dp:.2f} at "
              f"dp={dp}); what each is for: docs/memory.md")
    best = _best_baseline_after(results)
    if ctl.spares or ctl.store != "dedicated":
        print(f"{ctl.spares} {'warm' if ctl.warm else 'cold'} spares a row (join {ctl.join_s:g} s), store {ctl.store} "
              "(elaswave's rows); ETTR all: over the layout's and the idle spares' devices")
    tokens = args.micro_batch_size * m_cfg.seq_len
    print(f"{'policy':<18}{'after/before':>14}{'batch kept':>12}{'after/best baseline':>21}{'step s after':>14}"
          f"{'tokens/s after':>16}{'ETTR':>8}{'ETTR all':>10}{'MTTR s':>9}{'lost s/failure':>16}{'store losses':>14}{'stalls':>8}")
    for n, r in results.items():
        ratio = "-" if r.throughput_after_over_before is None else f"{r.throughput_after_over_before:.3f}"
        vs = "-" if not best or r.throughput_after is None else f"{r.throughput_after / best:.3f}"
        mttr = "-" if r.mttr_s is None else f"{r.mttr_s:.1f}"
        lost = "-" if r.time_lost_per_failure_s is None else f"{r.time_lost_per_failure_s:.1f}"
        batch = "-" if r.batch_after_over_before is None else f"{r.batch_after_over_before:.4f}"
        fig = _absolute(r, m, tokens)
        step = "-" if fig["step_after_s"] is None else f"{fig['step_after_s']:.2f}"
        rate = "-" if fig["tokens_per_s_after"] is None else f"{fig['tokens_per_s_after']:.4g}"
        print(f"{n:<18}{ratio:>14}{batch:>12}{vs:>21}{step:>14}{rate:>16}{r.ettr:>8.4f}{r.ettr_all_devices:>10.4f}{mttr:>9}"
              f"{lost:>16}{r.store_losses:>14}{r.stalls:>8}")
    if corners:
        print(f"band over the clock model's corners (sustained and boost clocks x {shares[0]:g} and {shares[1]:g} of step "
              "time scaling with the clock, and the row above):")
        for n in results:
            b = bands.get(n) or {}
            print(f"  {n:<16} after/before{_span(b.get('after_over_before'))}  after/best baseline"
                  f"{_span(b.get('after_over_best_baseline_after'))}  goodput{_span(b.get('goodput'))}")
    if calibration is not None:
        print(f"calibration error ({calibration.source}, {calibration.runs} held-out runs): after/before +-"
              f"{100 * calibration.ratio:.1f} %, step times +-{100 * calibration.step:.1f} %, as measured at 4-16 ranks; "
              "not for reroute, whose lower bound was never checked against a run")
    if "reroute" in results:
        print("reroute (ReCycle): its schedule is not modelled; priced at its routes' lower bound (the busiest "
              "device's own and rerouted work plus its fill and drain), relative to the same bound before the failure")
    if "reroute_runtime" in results:
        print("reroute_runtime: the same routes priced by the schedule elaswave's runtime runs for elastic.policy=reroute")
    if any(r.stalls for r in results.values()):
        print("stalls: failures after which the policy had no layout to train on until a repair "
              "(e.g. no pipeline left whole for reroute and drop_replica)")
    return 0


def _control(args, names: list[str]) -> control.Control:
    """The control-plane options from the flags: spares for every row, the store for elaswave's."""
    if args.spares < 0:
        raise ConfigError(f"--spares={args.spares} is invalid: a count of idle devices, >= 0")
    if args.store not in control.STORE_MODES:
        raise ConfigError(f"--store={args.store} is invalid: choose from {', '.join(control.STORE_MODES)}")
    if args.store != "dedicated" and not any(n.startswith("elaswave") for n in names):
        raise ConfigError(f"--store={args.store} is invalid with --policies={args.policies}: only elaswave's rows "
                          "model the store's host; add elaswave")
    if args.cold_spares and not args.spares:
        raise ConfigError("--cold-spares is invalid with --spares=0: give the number of spares")
    return control.Control(spares=args.spares, warm=not args.cold_spares, store=args.store)


def _absolute(r: PolicyResult, micro_batches: int, tokens_per_micro_batch: int) -> dict:
    """Step seconds and tokens per second before and after the first change, beside the ratios
    (the step after trains the batch the policy kept)."""
    after = r.throughput_after
    kept = r.batch_after_over_before if r.batch_after_over_before is not None else 1.0
    return {"step_before_s": micro_batches / r.throughput_before,
            "step_after_s": None if not after else micro_batches * kept / after,
            "tokens_per_s_before": r.throughput_before * tokens_per_micro_batch,
            "tokens_per_s_after": None if after is None else after * tokens_per_micro_batch}


def _plus_minus(r: PolicyResult, micro_batches: int, tokens: int, cal) -> dict | None:
    """Each figure's +- from the calibration's largest held-out relative error (None: no
    calibration, or a policy priced at its lower bound: the calibration checked the schedules the
    runtime runs, not the bound)."""
    if cal is None or policies.make_class(r.policy).schedule == "lower_bound":
        return None
    fig = _absolute(r, micro_batches, tokens)
    ratio = r.throughput_after_over_before
    return {"after_over_before": None if ratio is None else ratio * cal.ratio,
            **{k: None if v is None else v * cal.step for k, v in fig.items()}}


def _bands(results: dict[str, PolicyResult], corners) -> dict:
    """Each row's ratios over the clock corners and the printed model (empty without corners)."""
    if not corners:
        return {}
    every = [results] + [c[0] for c in corners]
    out = {}
    for n in results:
        ratio = [rs[n].throughput_after_over_before for rs in every]
        vs = [rs[n].throughput_after / b if (b := _best_baseline_after(rs)) and rs[n].throughput_after is not None
              else None for rs in every]
        out[n] = {"after_over_before": uncertainty.band(ratio),
                  "after_over_best_baseline_after": uncertainty.band(vs),
                  "goodput": uncertainty.band(rs[n].goodput for rs in every)}
        if n.startswith("elaswave"):  # over each baseline, corner by corner
            out[n]["after_over"] = {b: uncertainty.band(_over(rs[n], rs[b]) for rs in every)
                                    for b in results if not b.startswith("elaswave")}
    return out


def _over(r: PolicyResult, baseline: PolicyResult) -> float | None:
    if r.throughput_after is None or not baseline.throughput_after:
        return None
    return r.throughput_after / baseline.throughput_after


def _span(b) -> str:
    return "" if not b else f" [{b[0]:.3f}-{b[1]:.3f}]"


def _best_baseline_after(results: dict[str, PolicyResult]) -> float | None:
    """The highest throughput after the first change among the baselines run (not elaswave's rows)."""
    afters = [r.throughput_after for n, r in results.items()
              if not n.startswith("elaswave") and r.throughput_after is not None]
    return max(afters) if afters else None
