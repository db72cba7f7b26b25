"""``elaswave simulate``: build the modelled job, the trace and the policies; print a table or JSON."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, replace

from elaswave.errors import ConfigError
from elaswave.plan.frequency import CLOCKS
from elaswave.plan.memory import rank_bytes
from elaswave.plan.plan import PlanError, initial_plan
from elaswave.sim import control, engine, policies, trace
from elaswave.sim.engine import PolicyResult, simulate
from elaswave.sim.workload import MODELS, choose_layout, cluster, layer_numels


def add_arguments(ap) -> None:
    ap.add_argument("--devices", type=int, required=True, help="devices in the job (each runs one stage)")
    ap.add_argument("--dp", type=int, help="pipelines (default: chosen with --pp, or both chosen)")
    ap.add_argument("--pp", type=int, help="stages per pipeline")
    ap.add_argument("--model", default="gpt-13b", choices=sorted(MODELS), help="a model preset (model.preset): its shape and costs")
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
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default=",".join(policies.POLICIES),
                    help=f"comma-separated, from {', '.join(policies.POLICIES)}")
    ap.add_argument("--no-dvfs", action="store_true",
                    help="no frequency planning: every device at nominal clocks (elaswave's rows are elaswave_no_dvfs)")
    ap.add_argument("--clocks", choices=sorted(CLOCKS), default=None,
                    help="frequency model (docs/frequency_model.md): boost (default; levels 0.6-1.2 of nominal within "
                         "the live devices' nominal power) or sustained (0.6-1.0: nominal is the top clock under load)")
    ap.add_argument("--device-gib", type=float, default=0.0,
                    help="device memory: every plan, first and after each failure, keeps each device's modelled peak "
                         "within it (elaswave/plan/memory.py, bf16, --micro-batch-size sequences); 0: no limit")
    ap.add_argument("--checkpointing", default="none", help="activation checkpointing with --device-gib: none, full or every_N")
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


def _layout(args) -> tuple[int, int]:
    num_layers = MODELS[args.model].num_layers
    if args.dp and args.pp:
        dp, pp = args.dp, args.pp
    elif args.pp:
        dp, pp = args.devices // args.pp, args.pp
    elif args.dp:
        dp, pp = args.dp, args.devices // args.dp
    else:
        dp, pp = choose_layout(args.devices, num_layers)
    if dp < 1 or pp < 1 or dp * pp != args.devices:
        raise ConfigError(f"--dp={args.dp} --pp={args.pp} is invalid for --devices={args.devices}: dp x pp must "
                          "equal the devices")
    if pp > num_layers:
        raise ConfigError(f"--pp={pp} is invalid: {args.model} has {num_layers} layers")
    return dp, pp


def _memory(args, micro_batches: int):
    """The runtime's memory model of the job (bf16, ``--micro-batch-size`` sequences a micro-batch)."""
    from elaswave.sim.memory import job_memory
    if args.device_gib < 0:
        raise ConfigError(f"--device-gib={args.device_gib} is invalid: must be >= 0 (0: no limit)")
    return job_memory([f"model.preset={args.model}", "train.precision=bf16", f"train.micro_batch_size={args.micro_batch_size}",
                       f"train.num_micro_batches={micro_batches}", f"train.activation_checkpointing={args.checkpointing}",
                       f"parallel.chunk_numel={1 << 24}"])[2]


def _events(args, plan, duration_s: float) -> list[trace.Event]:
    if args.trace == "llama3":
        return trace.poisson(args.devices, 3.0 * args.devices, duration_s / 3600, args.repair_h, args.seed)
    if args.trace:
        return trace.load(args.trace, args.devices)
    if args.mtbf_h:
        return trace.poisson(args.devices, args.mtbf_h, duration_s / 3600, args.repair_h, args.seed)
    # One failure: the middle stage of the first pipeline, a tenth into the run.
    pipe = plan.pipelines[0]
    return trace.single_failure(pipe[len(pipe) // 2], duration_s / 10)


def run(args) -> int:
    began = time.perf_counter()
    if args.devices < 2:
        raise ConfigError(f"--devices={args.devices} is invalid: need at least 2")
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in names if p not in policies.POLICIES]
    if bad or not names:
        raise ConfigError(f"--policies={args.policies} is invalid: choose from {', '.join(policies.POLICIES)}")
    if args.no_dvfs and args.clocks:
        raise ConfigError(f"--clocks={args.clocks} is invalid with --no-dvfs: without frequency planning every "
                          "device stays at nominal; drop one of them")
    if args.no_dvfs:
        if args.policies != ",".join(policies.POLICIES) and "elaswave" in names:
            raise ConfigError(f"--policies={args.policies} is invalid with --no-dvfs: policy elaswave plans frequencies; "
                              "name elaswave_no_dvfs, or drop --no-dvfs")
        names = list(dict.fromkeys(n for n in names if n != "elaswave"))
    ctl = _control(args, names)
    dp, pp = _layout(args)
    m_cfg = MODELS[args.model]
    m = args.micro_batches or 2 * pp * dp
    if m < dp:
        raise ConfigError(f"--micro-batches={m} is invalid: need at least one per pipeline ({dp})")
    if args.micro_batch_size < 1:
        raise ConfigError(f"--micro-batch-size={args.micro_batch_size} is invalid: sequences per micro-batch, >= 1")
    if args.no_reshape and args.micro_batch_size == 1:
        raise ConfigError("--no-reshape is invalid with --micro-batch-size=1: a micro-batch of one sequence is "
                          "never reshaped; give a larger --micro-batch-size")
    model = replace(cluster(m_cfg, args.micro_batch_size), power=CLOCKS[args.clocks or "boost"])
    memory = _memory(args, m) if args.device_gib else None
    try:
        plan = initial_plan(args.devices, dp, pp, [float(c) for c in model.layer_forward_s], m,
                            layer_numels(m_cfg), chunk_numel=1 << 24, stage_memory_limit=1024 * args.device_gib,
                            memory=memory, units_per_micro_batch=1 if args.no_reshape else args.micro_batch_size)
    except PlanError as exc:
        raise ConfigError(f"--device-gib={args.device_gib:g}: {exc} (MiB)") from None
    single = not (args.trace or args.mtbf_h)
    duration_s = 3600.0 * (args.hours if args.hours is not None else (1.0 if single else 24.0))
    try:
        events = _events(args, plan, duration_s)
        trace.check(events, args.devices)
    except trace.TraceError as exc:
        raise ConfigError(str(exc)) from None
    costs = policies.BaselineCosts()
    start = policies.failure_free(plan, m, None if args.no_dvfs else model.power)
    clock_gain = engine.priced(plan, model)[1] / engine.priced(start, model)[1]
    results: dict[str, PolicyResult] = {}
    for name in names:
        try:
            row = ctl if name.startswith("elaswave") else replace(ctl, store="dedicated")
            policy = policies.make(name, plan, m, model, costs, row, start)
            results[name] = simulate(events, policy, model, duration_s)
        except PlanError as exc:
            raise ConfigError(f"policy {name}: {exc}") from None
    wall = time.perf_counter() - began
    config = {"devices": args.devices, "dp": dp, "pp": pp, "model": args.model, "micro_batches": m,
              "micro_batch_size": args.micro_batch_size, "reshape": not args.no_reshape and args.micro_batch_size > 1,
              "device_gib": args.device_gib, "checkpointing": args.checkpointing, "dvfs": not args.no_dvfs,
              "clocks": None if args.no_dvfs else args.clocks or "boost",
              "failure_free_clock_gain": clock_gain, "frequency_solver": start.frequency_solver or None,
              "hours": duration_s / 3600, "failures": sum(e.kind == "fail" for e in events),
              "joins": sum(e.kind == "join" for e in events), "trace": args.trace or ("poisson" if args.mtbf_h else "single"),
              "spares": ctl.spares, "warm_spares": ctl.warm, "store": ctl.store,
              "costs": asdict(costs), "control_costs": asdict(ctl.costs), "wall_s": wall}
    if args.plot:
        from elaswave.sim.plots import plot

        plot(results, f"{args.devices} devices (dp={dp} x pp={pp}), {args.model}, {config['failures']} failures, "
                      f"{config['joins']} repairs over {config['hours']:g} h", duration_s, args.plot)
    if args.json:
        best = _best_baseline_after(results)
        docs = {n: {**r.to_doc(), "after_over_best_baseline_after":
                    r.throughput_after / best if best and r.throughput_after is not None else None}
                for n, r in results.items()}
        print(json.dumps({"config": config, "policies": docs}))
        return 0
    print(f"elaswave simulate: {args.devices} devices (dp={dp} x pp={pp}), {args.model}, {m} micro-batches of "
          f"{args.micro_batch_size} per step{' (reshaped after a change)' if config['reshape'] else ''}, "
          f"{config['hours']:g} h, {config['failures']} failures, {config['joins']} joins; {wall:.1f} s")
    if not args.no_dvfs:
        solver = {"exact": "the exact DP", "greedy": "the greedy LP relaxation (within one level's upgrade of the "
                  "least power)"}.get(start.frequency_solver, "none: nominal clocks")
        print(f"failure-free clock plan ({config['clocks']} clocks, levels by {solver}): {clock_gain:.3f}x the "
              "throughput at nominal clocks; every row starts from it, a baseline keeps each stage's clock after a change")
    if memory is not None:
        peak = max(rank_bytes(memory, plan, r)["total"] for r in plan.ranks) / 2 ** 30
        print(f"memory: modelled peak {peak:.1f} GiB of {args.device_gib:g} per device "
              f"(bf16, checkpointing {args.checkpointing}); every re-plan keeps within it or stands survivors by")
    best = _best_baseline_after(results)
    if ctl.spares or ctl.store != "dedicated":
        print(f"{ctl.spares} {'warm' if ctl.warm else 'cold'} spares a row (join {ctl.join_s:g} s), store {ctl.store} "
              "(elaswave's rows); ETTR all: over the layout's and the idle spares' devices")
    print(f"{'policy':<18}{'after/before':>14}{'batch kept':>12}{'after/best baseline':>21}{'ETTR':>8}{'ETTR all':>10}{'MTTR s':>9}"
          f"{'lost s/failure':>16}{'store losses':>14}{'stalls':>8}")
    for n, r in results.items():
        ratio = "-" if r.throughput_after_over_before is None else f"{r.throughput_after_over_before:.3f}"
        vs = "-" if not best or r.throughput_after is None else f"{r.throughput_after / best:.3f}"
        mttr = "-" if r.mttr_s is None else f"{r.mttr_s:.1f}"
        lost = "-" if r.time_lost_per_failure_s is None else f"{r.time_lost_per_failure_s:.1f}"
        batch = "-" if r.batch_after_over_before is None else f"{r.batch_after_over_before:.4f}"
        print(f"{n:<18}{ratio:>14}{batch:>12}{vs:>21}{r.ettr:>8.4f}{r.ettr_all_devices:>10.4f}{mttr:>9}{lost:>16}"
              f"{r.store_losses:>14}{r.stalls:>8}")
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


def _best_baseline_after(results: dict[str, PolicyResult]) -> float | None:
    """The highest throughput after the first change among the baselines run (not elaswave's rows)."""
    afters = [r.throughput_after for n, r in results.items()
              if not n.startswith("elaswave") and r.throughput_after is not None]
    return max(afters) if afters else None
