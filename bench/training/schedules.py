"""Pipeline schedules: ZB-H1's and interleaved 1F1B's (V = 2 model chunks a rank) step against
1F1B's, in emulated compute (measured and as modelled) or, with ``--real``, in real compute.

One pipeline of 4 stages (dp=1 x pp=4, one process per rank, gloo), 8 micro-batches a step; every
layer's forward and backward take a modelled time (``--emulate``: sleeps, so the 4 ranks do not
contend for this machine's cores and the step reflects the schedule). Each schedule runs
``--rounds`` times, interleaved; a run's step time is the median over its steps from step 2, the
table the median over rounds. Beside it, ``pipeline.schedule.makespan`` on the same stages (the
initial plan's layer ranges -- p x V chunks for the interleaved one --, each layer's modelled
time): what the schedule model predicts, and the compute bound (the busiest stage's work, m x its
forward + backward, under 1F1B's partition).

Neither figure has the optimizer step, the gradient reduction or the sends in it: the measured
step does, so the measured ratio is the model's diluted by those fixed costs.

``--real``: a small Llama (8 blocks, d_model 128, 8 sequences of 128 tokens a micro-batch), no
emulation, results in ``bench/results/schedules_real``. Its 4 ranks (one thread each) share this
box's 2 cores, so a step measures the total work of the ranks more than the schedule's overlap:
it shows whether W redoes B's work (ZB-H1 slower than 1F1B), not the bubble ZB-H1 saves.

``--sizes``: pp = 4 and 8, m = pp and 2 pp (16 blocks: at least one in each of the p x V chunks),
results in ``bench/results/schedules_sizes``. Beside the layers-only makespan, the simulator's
prediction of the same plan (``sim.model.step_time``) with the fixed costs measured in the same
rounds by the simulator's own calibration (``sim.calibrate.fit``) on a separate 1F1B baseline of
each pp (m = 3 pp / 2, a size not among the cases): a cost per micro-batch and stage (dispatch,
sends, receives, each sleep's overshoot) and one per step (the loss exchange, the gradient sums,
the optimizer). A 1F1B case of near-zero sleeps per pp shows the runtime's own per-step cost; its
compute phase is the ranks' real work queued on the cores, not the sleeps' dispatch, so it is
reported, not used.

    python bench/training/schedules.py [--rounds 3] [--real [--label TEXT]] [--sizes]
"""
from __future__ import annotations

import resource
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import bench_args, in_turn, try_job, write_results  # noqa: E402
from elaswave import config  # noqa: E402
from elaswave.model.contract import tie_pairs  # noqa: E402
from elaswave.model.registry import model_for  # noqa: E402
from elaswave.pipeline.emulate import layer_forward_s  # noqa: E402
from elaswave.pipeline.schedule import makespan, stage_schedule  # noqa: E402
from elaswave.plan.plan import initial_plan  # noqa: E402
from elaswave.sim.calibrate import fit  # noqa: E402
from elaswave.sim.model import ClusterModel, step_time  # noqa: E402

PP, M = 4, 8


def emulated_job(pp: int, m: int, num_blocks: int, block_ms: float, steps: int) -> list[str]:
    """One pipeline of ``pp`` stages, ``m`` micro-batches a step; a tiny model (d_model 16) whose
    real compute the sleeps hide."""
    return ["parallel.dp=1", f"parallel.pp={pp}", "emulate.enabled=true", f"emulate.block_forward_ms={block_ms}",
            "frequency.planning=false", "model.d_model=16", "model.num_heads=2", "model.seq_len=16",
            f"model.num_blocks={num_blocks}", "train.micro_batch_size=1", f"train.num_micro_batches={m}",
            f"train.steps={steps}"]


JOB = emulated_job(PP, M, 6, 20, 12)
REAL_JOB = ["parallel.dp=1", f"parallel.pp={PP}", "frequency.planning=false", "model.arch=llama",
            "model.d_model=128", "model.num_heads=4", "model.seq_len=128", "model.num_blocks=8", "model.dropout=0",
            "train.micro_batch_size=8", f"train.num_micro_batches={M}", "train.steps=10"]
V = 2
SCHEDULES = {"1f1b": 1, "zb-h1": 1, "interleaved": V}
"""Each schedule and the model chunks a rank holds under it (parallel.virtual_stages)."""


def _sets(name: str) -> list[str]:
    return [f"parallel.schedule={name}", f"parallel.virtual_stages={SCHEDULES[name]}"]


def modelled(job: list[str] = JOB, pp: int = PP, m: int = M) -> dict:
    """Each schedule's makespan on the initial plan's (virtual) stages, and the compute bound (seconds)."""
    cfg = config.load(None, job)
    model = model_for(cfg)
    forward = layer_forward_s(cfg, model)
    factor = cfg.emulate.backward_factor
    out = {}
    for name, v in SCHEDULES.items():
        plan = initial_plan(cfg.world_size, 1, pp, [c.flops_per_token for c in model.layer_costs()], m,
                            ties=tie_pairs(model), virtual_stages=v)
        stage_s = [sum(forward[a:b]) * (1 + factor) for a, b in plan.layer_ranges[0]]
        out[name] = makespan([stage_schedule(name, s, pp, range(m), v) for s in range(pp)], stage_s, factor)
        out[f"layer_ranges_{name}"] = [list(r) for r in plan.layer_ranges[0]]
        if v == 1:
            out["compute_bound"] = m * max(stage_s)
    return out


def main() -> None:
    ap = bench_args(__doc__, out="schedules")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each schedule, interleaved (medians of these)")
    ap.add_argument("--real", action="store_true", help="real compute on a small Llama (no emulation)")
    ap.add_argument("--label", default="", help="a note for the results' heading (e.g. which code ran)")
    ap.add_argument("--sizes", action="store_true", help="pp = 4 and 8, m = pp and 2 pp, against the simulator")
    args = ap.parse_args()
    if args.sizes:
        if args.out == ap.get_default("out"):
            args.out += "_sizes"
        run_sizes(args)
        return
    if args.real and args.out == ap.get_default("out"):
        args.out += "_real"
    job = REAL_JOB if args.real else JOB
    runs: dict[str, list[float]] = {name: [] for name in SCHEDULES}
    cpu_s: dict[str, list[float]] = {name: [] for name in SCHEDULES}
    """Each run's CPU seconds, all its processes (start-up included): the total work, which the
    other load on the box stretches less than the step time."""
    failed: dict[str, list[str]] = {name: [] for name in SCHEDULES}
    for k in range(args.rounds):
        for name in in_turn(k, list(SCHEDULES)):
            cpu = _children_cpu_s()
            run = try_job("run", [*job, *_sets(name)], deterministic=False, timeout_s=300)
            if run["exit_code"]:  # a finding, left out of the medians
                failed[name].append(run["error"])
                print(f"  round {k}: {name}: FAILED {run['error']}", flush=True)
                continue
            runs[name].append(statistics.median(r["step_time_s"] for r in run["steps"][2:]))
            cpu_s[name].append(_children_cpu_s() - cpu)
            print(f"  round {k}: {name}: step {runs[name][-1]:.3f} s, cpu {cpu_s[name][-1]:.1f} s", flush=True)
    measured = {name: statistics.median(v) for name, v in runs.items()}
    if args.real:
        write_real(args, job, runs, cpu_s, failed, measured)
        return
    model = modelled()
    result = {"job": JOB, "rounds": args.rounds, "runs": runs, "failed": failed, "measured_step_s": measured,
              "modelled_s": model, **{f"{kind}_{name.replace('-', '_')}_over_1f1b": figures[name] / figures["1f1b"]
                                      for kind, figures in (("measured", measured), ("modelled", model))
                                      for name in SCHEDULES if name != "1f1b"}}
    left_out = {name: len(f) for name, f in failed.items() if f}
    md = [f"Pipeline schedules, emulated compute, dp=1 x pp={PP}, {M} micro-batches (one process per rank on a "
          f"2-core CPU box, gloo; stages {model['layer_ranges_1f1b']}, interleaved V={V}: "
          f"{model['layer_ranges_interleaved']}); medians of {args.rounds} rounds, the schedules in turn"
          + (f" (failed runs, left out: {left_out})." if left_out else "."), "",
          "| schedule | measured step s | modelled (makespan) s | measured / compute bound |",
          "| --- | --- | --- | --- |"]
    bound = model["compute_bound"]
    for name in SCHEDULES:
        md.append(f"| {name} | {measured[name]:.3f} | {model[name]:.3f} | {measured[name] / bound:.3f} |")
    md += [""] + [f"{name} / 1f1b: measured {measured[name] / measured['1f1b']:.3f}, modelled "
                  f"{model[name] / model['1f1b']:.3f}." for name in SCHEDULES if name != "1f1b"]
    md += [f"Compute bound {bound:.3f} s."]
    write_results(args.out, result, md)


# -- --sizes: pp = 4 and 8, m = pp and 2 pp, against the simulator with measured fixed costs --------------
SIZES = ((4, 4), (4, 8), (8, 8), (8, 16))
"""(pp, m) of each case."""
SIZES_BLOCKS, SIZES_BLOCK_MS, SIZES_STEPS = 16, 10.0, 10
"""16 blocks: at least one in each chunk at pp = 8, V = 2. 10 ms a block: a step of 0.7-1.7 s, 89-97 % of
it the layers' sleeps, while 8 ranks' real work (~0.6 core-seconds a step of 16 micro-batches, the
near-zero case shows) leaves the 2 cores mostly idle."""
TINY_MS = 0.01
"""A near-zero sleep: what is left of the step is the runtime's own work."""


def _size_runs() -> list[tuple[str, int, int, str]]:
    """A round's runs, (kind, pp, m, schedule): every case; per pp a 1F1B ``baseline`` at m = 3 pp / 2
    (the fixed costs are calibrated on it, so no case predicted is the one fitted) and a 1F1B ``tiny``
    one at m = 2 pp (near-zero sleeps)."""
    runs = [("case", pp, m, name) for pp, m in SIZES for name in SCHEDULES]
    for pp in sorted({pp for pp, _ in SIZES}):
        runs += [("baseline", pp, 3 * pp // 2, "1f1b"), ("tiny", pp, 2 * pp, "1f1b")]
    return runs


def _size_job(kind: str, pp: int, m: int, name: str) -> list[str]:
    return [*emulated_job(pp, m, SIZES_BLOCKS, TINY_MS if kind == "tiny" else SIZES_BLOCK_MS, SIZES_STEPS),
            *_sets(name)]


def _key(kind: str, pp: int, m: int, name: str) -> str:
    return f"{kind} pp={pp} m={m} {name}"


def predicted(job: list[str], pp: int, m: int, per_micro_batch_stage_s: float = 0.0,
              per_step_s: float = 0.0) -> dict[str, float]:
    """The simulator's step (``sim.model.step_time``) for each schedule on the plan the runtime
    makes (p x V chunks, interleaved): the layers' modelled times, plus a fixed cost per micro-batch
    and (virtual) stage and one per step. With both 0 it is the makespan of :func:`modelled`."""
    cfg = config.load(None, job)
    model = model_for(cfg)
    costs = [c.flops_per_token for c in model.layer_costs()]
    cluster = ClusterModel(tuple(layer_forward_s(cfg, model)), cfg.emulate.backward_factor,
                           per_microbatch_stage_s=per_micro_batch_stage_s, step_overhead_s=per_step_s)
    out = {}
    for name, v in SCHEDULES.items():
        plan = initial_plan(cfg.world_size, 1, pp, costs, m, ties=tie_pairs(model), virtual_stages=v)
        out[name] = step_time(plan, replace(cluster, pipeline_schedule=name)).step_s
    return out


def run_sizes(args) -> None:
    runs = _size_runs()
    step_s: dict[str, list[float]] = {_key(*r): [] for r in runs}
    compute_s: dict[str, list[float]] = {_key(*r): [] for r in runs}
    fitted: dict[int, list[tuple[float, float]]] = {pp: [] for pp, _ in SIZES}
    """Per pp, each round's baseline fit: (cost per micro-batch and stage, cost per step)."""
    failed: dict[str, list[str]] = {}
    for k in range(args.rounds):
        for run in in_turn(k, runs):
            key, job = _key(*run), _size_job(*run)
            out = try_job("run", job, deterministic=False, timeout_s=300)
            if out["exit_code"]:  # a finding, left out of the medians
                failed.setdefault(key, []).append(out["error"])
                print(f"  round {k}: {key}: FAILED {out['error']}", flush=True)
                continue
            steady = out["steps"][2:]
            step_s[key].append(statistics.median(r["step_time_s"] for r in steady))
            compute_s[key].append(statistics.median(r["phases_s"]["compute"] for r in steady))
            if run[0] == "baseline":  # the simulator's own calibration, on this run's records
                cal = fit([{"event": "job", "config": config.load(None, job).to_dict()}, *out["steps"]])
                fitted[run[1]].append((cal.per_microbatch_stage_s, cal.step_overhead_s))
            print(f"  round {k}: {key}: step {step_s[key][-1]:.4f} s, compute {compute_s[key][-1]:.4f} s",
                  flush=True)
    med = {key: statistics.median(v) for key, v in step_s.items() if v}
    med_compute = {key: statistics.median(v) for key, v in compute_s.items() if v}
    fixed = {pp: tuple(statistics.median(f[i] for f in fits) for i in (0, 1)) if fits else (0.0, 0.0)
             for pp, fits in fitted.items()}
    tiny = {}
    for pp in fixed:
        key = _key("tiny", pp, 2 * pp, "1f1b")
        if key in med:  # the step, what follows its compute phase, and that phase per 1F1B slot
            tiny[pp] = {"step_s": med[key], "after_compute_s": med[key] - med_compute[key],
                        "compute_per_slot_s": med_compute[key] / (3 * pp - 1)}
    cases = []
    for pp, m in SIZES:
        job = emulated_job(pp, m, SIZES_BLOCKS, SIZES_BLOCK_MS, SIZES_STEPS)
        layers, pred = predicted(job, pp, m), predicted(job, pp, m, *fixed[pp])
        bound = modelled(job, pp, m)["compute_bound"]
        for name in SCHEDULES:
            got = med.get(_key("case", pp, m, name))
            cases.append({"pp": pp, "m": m, "schedule": name, "measured_step_s": got, "compute_bound_s": bound,
                          "layers_only_s": layers[name], "predicted_s": pred[name],
                          "measured_over_predicted": got / pred[name] if got else None,
                          "measured_over_1f1b": got / med[_key("case", pp, m, "1f1b")] if got and
                          _key("case", pp, m, "1f1b") in med else None,
                          "predicted_over_1f1b": pred[name] / pred["1f1b"],
                          "layers_only_over_1f1b": layers[name] / layers["1f1b"]})
    result = {"jobs": {_key(*r): _size_job(*r) for r in runs}, "rounds": args.rounds, "step_s": step_s,
              "compute_s": compute_s, "failed": failed, "fixed_costs_s": {pp: {"per_micro_batch_stage": f[0],
              "per_step": f[1]} for pp, f in fixed.items()}, "fits": fitted, "tiny": tiny, "cases": cases}
    write_results(args.out, result, sizes_md(args.rounds, cases, fixed, tiny, failed))


def sizes_md(rounds: int, cases: list[dict], fixed: dict, tiny: dict, failed: dict) -> list[str]:
    left_out = {key: len(f) for key, f in failed.items()}
    md = [f"Pipeline schedules, emulated compute, dp=1 x pp in (4, 8), m = pp and 2 pp, {SIZES_BLOCKS} blocks of "
          f"{SIZES_BLOCK_MS:g} ms forward (backward 2x), interleaved V={V}; one process per rank on a 2-core CPU box, "
          f"gloo; medians of {rounds} rounds, every run in turn"
          + (f" (failed runs, left out: {left_out})." if left_out else "."),
          "Predicted: the simulator's step (`sim.model.step_time`) on the same plan, with the fixed costs the "
          "simulator's calibration (`sim.calibrate.fit`) measured on a separate 1F1B baseline of each pp "
          "(m = 3 pp / 2) in the same rounds; layers only: the same without them (`schedule.makespan`).", "",
          "| pp | m | schedule | measured step s | compute bound s | measured / bound | layers only s | predicted s "
          "| measured / predicted | within 5 % |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in cases:
        got, ratio = c["measured_step_s"], c["measured_over_predicted"]
        md.append(f"| {c['pp']} | {c['m']} | {c['schedule']} | " + (f"{got:.4f}" if got else "failed")
                  + f" | {c['compute_bound_s']:.3f} | " + (f"{got / c['compute_bound_s']:.3f}" if got else "-")
                  + f" | {c['layers_only_s']:.4f} | {c['predicted_s']:.4f} | " + (f"{ratio:.3f}" if ratio else "-")
                  + f" | {'yes' if ratio and abs(ratio - 1) <= 0.05 else 'no'} |")
    md += ["", "| pp | m | schedule / 1f1b | measured | predicted | layers only |",
           "| --- | --- | --- | --- | --- | --- |"]
    for c in cases:
        if c["schedule"] != "1f1b":
            got = c["measured_over_1f1b"]
            md.append(f"| {c['pp']} | {c['m']} | {c['schedule']} | " + (f"{got:.3f}" if got else "-")
                      + f" | {c['predicted_over_1f1b']:.3f} | {c['layers_only_over_1f1b']:.3f} |")
    md.append("")
    for pp, (per_mb, per_step) in fixed.items():
        md.append(f"Fixed costs at pp={pp} (1F1B baseline, m={3 * pp // 2}): {1e3 * per_mb:.2f} ms per micro-batch "
                  f"and stage, {1e3 * per_step:.1f} ms per step after the compute phase."
                  + (f" Near-zero sleeps ({TINY_MS:g} ms a block, m={2 * pp}): step {1e3 * tiny[pp]['step_s']:.1f} ms, "
                     f"of it {1e3 * tiny[pp]['after_compute_s']:.1f} ms after the compute phase; the compute phase "
                     f"{1e3 * tiny[pp]['compute_per_slot_s']:.2f} ms per 1F1B slot (the ranks' real work on 2 cores)."
                     if pp in tiny else ""))
    return md


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def write_real(args, job: list[str], runs: dict, cpu_s: dict, failed: dict, measured: dict) -> None:
    cpu = {name: statistics.median(v) for name, v in cpu_s.items()}
    ratio = {name: measured[name] / measured["1f1b"] for name in SCHEDULES if name != "1f1b"}
    cpu_ratio = {name: cpu[name] / cpu["1f1b"] for name in SCHEDULES if name != "1f1b"}
    result = {"job": job, "label": args.label, "rounds": args.rounds, "runs": runs, "cpu_s": cpu_s,
              "failed": failed, "measured_step_s": measured, "measured_over_1f1b": ratio, "cpu_over_1f1b": cpu_ratio}
    left_out = {name: len(f) for name, f in failed.items() if f}
    md = [f"Pipeline schedules, real compute (no emulation){': ' + args.label if args.label else ''}. Llama, "
          f"dp=1 x pp={PP}, {M} micro-batches; 4 ranks of one thread on a shared 2-core CPU box, gloo: the step "
          f"measures the ranks' total work more than overlap. Medians of {args.rounds} interleaved rounds"
          + (f" (failed runs, left out: {left_out})." if left_out else "."), "",
          "| schedule | measured step s | rounds | run's CPU s (all ranks, start-up included) |",
          "| --- | --- | --- | --- |"]
    for name in SCHEDULES:
        md.append(f"| {name} | {measured[name]:.3f} | {', '.join(f'{s:.3f}' for s in runs[name])} | {cpu[name]:.1f} |")
    md += [""] + [f"{name} / 1f1b: step {ratio[name]:.3f}, CPU {cpu_ratio[name]:.3f}." for name in ratio]
    md += [f"Job: `{' '.join(job)}`."]
    write_results(args.out, result, md)


if __name__ == "__main__":
    main()
