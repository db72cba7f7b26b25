"""The simulator's answers at cluster scale, each from ``elaswave simulate`` (same planner code).

1. 96 devices (the paper's scale), gpt-175b and gpt-13b, one failure of a middle stage, for every
   dp x pp of 96 devices: after / before of every policy, and elaswave's throughput after the
   failure against each baseline's -- with the boost frequency model, the sustained one (no level
   above nominal) and without frequency planning (docs/frequency_model.md).
2. The planner's steady state: before any failure, elaswave's throughput with this frequency
   planner over the one before issue 19 (git 9942ffc, read from the repository's history) and over
   no frequency planning, all priced by today's simulator.
3. After / before <= 1: the largest after / before of every policy over those layouts, both models,
   failures of the first, middle and last stage of a pipeline, and a 24 h Poisson trace.
4. 16,384 devices, gpt-175b, dp=1024 x pp=16, 24 h of Poisson failures at about one per 3 h across
   the job (Llama 3's rate), repaired after 4 h: goodput of every policy, and the simulation's wall time.

    python bench/sim/simulator.py
"""
from __future__ import annotations

import contextlib
import io
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import RESULTS, ROOT, write_results  # noqa: E402
from elaswave import cli  # noqa: E402

# These are the layouts of the first measurements, memory unmodelled: without tensor parallelism
# gpt-175b fits no 80 GiB device at them (bench/sim/reshape.py has the layouts that fit).
NO_MEMORY_LIMIT = ["--device-gib", "0"]

LAYOUTS_96 = [(2, 48), (3, 32), (4, 24), (6, 16), (12, 8)]
MODELS_96 = ("gpt-175b", "gpt-13b")  # gpt-13b has 42 layers: no 2 x 48


def layouts(model: str) -> list[tuple[int, int]]:
    from elaswave.sim.workload import MODELS
    return [(dp, pp) for dp, pp in LAYOUTS_96 if pp <= MODELS[model].num_layers]
OLD_PLANNER = "9942ffc"  # the frequency planner before issue 19


def simulate(argv: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["simulate", "--json", *argv])
    if code != 0:
        raise RuntimeError(f"elaswave simulate {' '.join(argv)} exited {code}")
    return json.loads(out.getvalue())


def ratios(dp: int, pp: int, model: str, plot: list[str]) -> dict:
    """One failure on 96 devices, boost and sustained clocks: the table row."""
    row = {"model": model, "dp": dp, "pp": pp}
    for clocks in ("boost", "sustained"):
        pol = simulate(["--devices", "96", "--dp", str(dp), "--pp", str(pp), "--model", model, *NO_MEMORY_LIMIT,
                        "--clocks", clocks, *(plot if clocks == "boost" else [])])["policies"]
        after = {k: v["throughput_after"] for k, v in pol.items()}
        best = max(v for k, v in after.items() if not k.startswith("elaswave"))
        names = ("elaswave",) if clocks == "sustained" else ("elaswave", "elaswave_no_dvfs")
        for e in names:
            tag = e if clocks == "boost" else "elaswave_sustained"
            row[f"{tag}_after_over_before"] = pol[e]["throughput_after_over_before"]
            row.update({f"{tag}_over_{b}": after[e] / after[b] for b in ("reroute", "drop_replica")})
            row[f"{tag}_over_best_baseline"] = after[e] / best
        if clocks == "boost":
            row.update({f"{k}_after_over_before": v["throughput_after_over_before"] for k, v in pol.items()})
    return row


def planner_gain(dp: int, pp: int, model: str) -> dict | None:
    """Before any failure: throughput with this planner / the old one / none, priced alike."""
    import subprocess
    import sys
    import types
    from dataclasses import replace

    from elaswave.plan.plan import initial_plan
    from elaswave.plan.replan import replan
    from elaswave.sim.model import step_time
    from elaswave.sim.workload import MODELS, cluster, layer_numels
    try:
        source = subprocess.run(["git", "show", f"{OLD_PLANNER}:elaswave/plan/frequency.py"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None  # no history (a source tarball): the comparison is left out
    old = types.ModuleType("old_frequency")
    sys.modules[old.__name__] = old  # dataclasses look their module up
    exec(compile(source, "old_frequency.py", "exec"), old.__dict__)
    shape = MODELS[model]
    cm = cluster(shape)
    m = 2 * pp * dp
    plan = initial_plan(96, dp, pp, list(cm.layer_forward_s), m, layer_numels(shape), chunk_numel=1 << 24)
    new = replan(plan, list(plan.ranks), 1, m, policy="elaswave", power=cm.power, power_cap_w=96 * cm.power.power(1.0))
    stage_s = [[sum(cm.layer_forward_s[i:j]) * 3 for i, j in rng] for rng in plan.layer_ranges]
    fp = old.plan_frequencies(stage_s, m, old.PowerModel(), 96 * cm.power.power(1.0))
    was = replace(plan, frequencies=fp.levels, micro_batches=fp.micro_batches)
    rate = {k: p.num_micro_batches / step_time(p, cm).step_s for k, p in (("new", new), ("old", was), ("none", plan))}
    return {"model": model, "dp": dp, "pp": pp, "new_over_old": rate["new"] / rate["old"],
            "new_over_no_dvfs": rate["new"] / rate["none"], "old_over_no_dvfs": rate["old"] / rate["none"]}


def worst_after_over_before() -> dict:
    """The largest after / before per policy over layouts, models, victims and a Poisson trace."""
    from elaswave.plan.plan import initial_plan
    from elaswave.sim import policies, trace
    from elaswave.sim.engine import simulate as replay
    from elaswave.sim.workload import MODELS, cluster, layer_numels
    worst: dict[str, dict] = {}
    for model in MODELS_96:
        cm = cluster(MODELS[model])
        for dp, pp in layouts(model):
            m = 2 * pp * dp
            plan = initial_plan(96, dp, pp, list(cm.layer_forward_s), m, layer_numels(MODELS[model]), chunk_numel=1 << 24)
            traces = {f"stage {s}": trace.single_failure(plan.pipelines[0][s], 360.0) for s in sorted({0, pp // 2, pp - 1})}
            traces["poisson"] = trace.poisson(96, 3.0 * 96, 24, 4.0, 1)
            for where, events in traces.items():
                for name in policies.POLICIES:
                    res = replay(events, policies.make(name, plan, m, cm, policies.BaselineCosts()), cm, 24 * 3600)
                    x = res.throughput_after_over_before
                    if x is not None and x > worst.get(name, {"after_over_before": 0.0})["after_over_before"]:
                        worst[name] = {"after_over_before": x, "model": model, "dp": dp, "pp": pp, "trace": where}
            print(f"  after/before sweep: {model} {dp} x {pp} done", flush=True)
    return worst


def main() -> None:
    rows, gains = [], []
    for model in MODELS_96:
        for dp, pp in layouts(model):
            plot = ["--plot", str(RESULTS / "simulator_96.png")] if (model, dp, pp) == ("gpt-175b", 2, 48) else []
            rows.append(ratios(dp, pp, model, plot))
            gain = planner_gain(dp, pp, model)
            if gain:
                gains.append(gain)
            r = rows[-1]
            print(f"  {model} 96 devices {dp} x {pp}: after/before {r['elaswave_after_over_before']:.3f}; elaswave/best "
                  f"baseline {r['elaswave_over_best_baseline']:.2f} (sustained {r['elaswave_sustained_over_best_baseline']:.2f}, "
                  f"no DVFS {r['elaswave_no_dvfs_over_best_baseline']:.2f})", flush=True)
    worst = worst_after_over_before()
    began = time.perf_counter()
    big = simulate(["--devices", "16384", "--dp", "1024", "--pp", "16", "--model", "gpt-175b", "--trace", "llama3",
                    *NO_MEMORY_LIMIT])
    wall = time.perf_counter() - began
    simulate(["--devices", "16384", "--dp", "1024", "--pp", "16", "--model", "gpt-175b", "--trace", "llama3",
              *NO_MEMORY_LIMIT, "--plot", str(RESULTS / "simulator_16384.png")])
    result = {"paper_scale_96": rows, "planner_gain": gains, "worst_after_over_before": worst,
              "llama3_16384": {**big, "wall_s": wall}}
    write_results(RESULTS / "simulator", result, report(rows, gains, worst, big, wall))


def report(rows, gains, worst, big, wall) -> list[str]:
    md = ["Simulator (`elaswave simulate`, analytic per step, the runtime's planner), this machine, one process.", "",
          "**96 devices, one failure of a middle stage.** After / before per policy (each policy's own before: "
          "elaswave's with frequency planning within the live devices' nominal power, the others at nominal "
          "clocks; systems that run the routed list schedule after a failure -- reroute, and elaswave when it "
          "takes detours -- priced on every device with the better of it and 1F1B), then elaswave's throughput after the failure against the baselines' (reroute, drop_replica, "
          "the best of reroute, drop_replica, restart and templates) with the boost frequency model, the "
          "sustained one (no level above nominal) and without frequency planning:", "",
          "| model | dp x pp | elaswave | no DVFS | reroute | drop_replica | templates | restart "
          "| boost: / reroute | / drop | / best | sustained: / reroute | / drop | / best "
          "| no DVFS: / reroute | / drop | / best |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cells = [f"{r[k]:.3f}" for k in ("elaswave_after_over_before", "elaswave_no_dvfs_after_over_before",
                                          "reroute_after_over_before", "drop_replica_after_over_before",
                                          "templates_after_over_before", "restart_after_over_before")]
        cells += [f"{r[f'{e}_over_{b}']:.2f}" for e in ("elaswave", "elaswave_sustained", "elaswave_no_dvfs")
                  for b in ("reroute", "drop_replica", "best_baseline")]
        md.append(f"| {r['model']} | {r['dp']} x {r['pp']} | " + " | ".join(cells) + " |")
    md += ["", "Plot of the gpt-175b 2 x 48 case: `simulator_96.png`.", ""]
    if gains:
        md += [f"**The planner's steady state** (before any failure, 96 devices, boost model): throughput with "
               f"this planner over the planner before issue 19 (git {OLD_PLANNER}) and over no frequency planning, "
               "every plan priced by today's simulator:", "",
               "| model | dp x pp | new / old planner | new / no DVFS | old / no DVFS |", "| --- | --- | --- | --- | --- |"]
        md += [f"| {g['model']} | {g['dp']} x {g['pp']} | {g['new_over_old']:.3f} | {g['new_over_no_dvfs']:.3f} | "
               f"{g['old_over_no_dvfs']:.3f} |" for g in gains]
        md.append("")
    md += ["**After / before at most 1**: the largest after / before of each policy over both models, the five "
           "layouts, failures of a pipeline's first, middle and last stage and a 24 h Poisson trace (its first "
           "change):", "", "| policy | largest after / before | where |", "| --- | --- | --- |"]
    md += [f"| {n} | {w['after_over_before']:.4f} | {w['model']} {w['dp']} x {w['pp']}, {w['trace']} |"
           for n, w in worst.items()]
    c = big["config"]
    md += ["", f"**16,384 devices (dp={c['dp']} x pp={c['pp']}), gpt-175b, {c['hours']:g} h, {c['failures']} failures and "
               f"{c['joins']} repairs (Poisson, ~1 per 3 h across the job, 4 h repair)**; simulated in {wall:.1f} s:", "",
           "| policy | goodput | MTTR s | time lost per failure s | after / before (first failure) |",
           "| --- | --- | --- | --- | --- |"]
    for name, p in big["policies"].items():
        md.append(f"| {name} | {p['goodput']:.4f} | {p['mttr_s']:.1f} | {p['time_lost_per_failure_s']:.1f} | "
                  f"{p['throughput_after_over_before']:.3f} |")
    md += ["", "Plot: `simulator_16384.png`."]
    return md


if __name__ == "__main__":
    main()
