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

    python bench/training/schedules.py [--rounds 3] [--real [--label TEXT]]
"""
from __future__ import annotations

import resource
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import bench_args, in_turn, try_job, write_results  # noqa: E402
from elaswave import config  # noqa: E402
from elaswave.model.contract import tie_pairs  # noqa: E402
from elaswave.model.registry import model_for  # noqa: E402
from elaswave.pipeline.emulate import layer_forward_s  # noqa: E402
from elaswave.pipeline.schedule import makespan, stage_schedule  # noqa: E402
from elaswave.plan.plan import initial_plan  # noqa: E402

PP, M = 4, 8
JOB = ["parallel.dp=1", f"parallel.pp={PP}", "emulate.enabled=true", "emulate.block_forward_ms=20",
       "frequency.planning=false", "model.d_model=16", "model.num_heads=2", "model.seq_len=16",
       "model.num_blocks=6", "train.micro_batch_size=1", f"train.num_micro_batches={M}", "train.steps=12"]
REAL_JOB = ["parallel.dp=1", f"parallel.pp={PP}", "frequency.planning=false", "model.arch=llama",
            "model.d_model=128", "model.num_heads=4", "model.seq_len=128", "model.num_blocks=8", "model.dropout=0",
            "train.micro_batch_size=8", f"train.num_micro_batches={M}", "train.steps=10"]
V = 2
SCHEDULES = {"1f1b": 1, "zb-h1": 1, "interleaved": V}
"""Each schedule and the model chunks a rank holds under it (parallel.virtual_stages)."""


def _sets(name: str) -> list[str]:
    return [f"parallel.schedule={name}", f"parallel.virtual_stages={SCHEDULES[name]}"]


def modelled() -> dict:
    """Each schedule's makespan on the initial plan's (virtual) stages, and the compute bound (seconds)."""
    cfg = config.load(None, JOB)
    model = model_for(cfg)
    forward = layer_forward_s(cfg, model)
    factor = cfg.emulate.backward_factor
    out = {}
    for name, v in SCHEDULES.items():
        plan = initial_plan(cfg.world_size, 1, PP, [c.flops_per_token for c in model.layer_costs()], M,
                            ties=tie_pairs(model), virtual_stages=v)
        stage_s = [sum(forward[a:b]) * (1 + factor) for a, b in plan.layer_ranges[0]]
        out[name] = makespan([stage_schedule(name, s, PP, range(M), v) for s in range(PP)], stage_s, factor)
        out[f"layer_ranges_{name}"] = [list(r) for r in plan.layer_ranges[0]]
        if v == 1:
            out["compute_bound"] = M * max(stage_s)
    return out


def main() -> None:
    ap = bench_args(__doc__, out="schedules")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each schedule, interleaved (medians of these)")
    ap.add_argument("--real", action="store_true", help="real compute on a small Llama (no emulation)")
    ap.add_argument("--label", default="", help="a note for the results' heading (e.g. which code ran)")
    args = ap.parse_args()
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
