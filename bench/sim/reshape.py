"""Recovery on fair terms at 96 and 16,384 devices: equal failure-free plans, reshaped micro-batches.

Every row of ``elaswave simulate`` starts from one failure-free plan (clocks planned for all, their
gain over nominal clocks its own column), so each ratio measures recovery alone. Three tables:

- **96 devices**, one failure in the middle of pipeline 0, gpt-175b at every layout from 2x48 to
  12x8, boost and sustained clocks: elaswave's throughput after the failure over each baseline's.
- **16,384 devices**, one failure, gpt-175b and llama3-70b at dp=1024 x pp=16, 1, 4 and 16
  sequences a micro-batch: elaswave dealing whole micro-batches or reshaped (sequences), beside
  drop_replica (TorchFT's policy: the batch shrinks), templates and reroute.
- **16,384 devices under the llama3 trace** (24 h, 3 seeds), 16 sequences a micro-batch: the
  steady ratio after the first failure and the goodput, median (range).

    python bench/sim/reshape.py [--seeds 3]
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import bench_args, write_results  # noqa: E402
from bench.sim.simulator import simulate  # noqa: E402  `elaswave simulate --json` in this process

LAYOUTS_96 = ((2, 48), (3, 32), (4, 24), (6, 16), (12, 8))
BASELINES = ("templates", "reroute", "drop_replica", "restart")
BIG = ("gpt-175b", "llama3-70b")
SIZES = (1, 4, 16)


def at_96() -> list[dict]:
    rows = []
    for dp, pp in LAYOUTS_96:
        for clocks in ("boost", "sustained"):
            doc = simulate(["--devices", "96", "--dp", str(dp), "--pp", str(pp), "--model", "gpt-175b",
                            "--clocks", clocks])
            pol = doc["policies"]
            after = {n: p["throughput_after"] for n, p in pol.items()}
            rows.append({"dp": dp, "pp": pp, "clocks": clocks, "clock_gain": doc["config"]["failure_free_clock_gain"],
                         "before": {n: p["throughput_before"] for n, p in pol.items()},
                         "after_over_before": {n: p["throughput_after_over_before"] for n, p in pol.items()},
                         "elaswave_over": {b: after["elaswave"] / after[b] for b in BASELINES},
                         "no_dvfs_over_templates": after["elaswave_no_dvfs"] / after["templates"]})
            print(f"  96 {dp}x{pp} {clocks}: elaswave/templates {rows[-1]['elaswave_over']['templates']:.3f}", flush=True)
    return rows


def _big(model: str, size: int, clocks: str, extra: list[str]) -> dict:
    return simulate(["--devices", "16384", "--dp", "1024", "--pp", "16", "--model", model, "--clocks", clocks,
                     "--micro-batch-size", str(size), *extra])


def one_failure_16k() -> list[dict]:
    rows = []
    for model in BIG:
        for clocks in ("sustained", "boost"):
            for size in SIZES:
                doc = _big(model, size, clocks, ["--policies", "elaswave,drop_replica,templates,reroute"])
                pol = doc["policies"]
                row = {"model": model, "clocks": clocks, "size": size, "wall_s": doc["config"]["wall_s"],
                       "clock_gain": doc["config"]["failure_free_clock_gain"],
                       "step_s": doc["config"]["micro_batches"] / pol["elaswave"]["throughput_before"],
                       "after_over_before": {n: p["throughput_after_over_before"] for n, p in pol.items()},
                       "batch_kept": {n: p["batch_after_over_before"] for n, p in pol.items()}}
                if size > 1:
                    whole = _big(model, size, clocks, ["--policies", "elaswave", "--no-reshape"])["policies"]["elaswave"]
                    row["after_over_before"]["elaswave_whole"] = whole["throughput_after_over_before"]
                rows.append(row)
                print(f"  16k {model} {clocks} b={size}: {row['after_over_before']}", flush=True)
    return rows


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def trace_16k(seeds: int) -> list[dict]:
    rows = []
    for model in BIG:
        runs: dict[str, list[dict]] = {"elaswave": [], "elaswave_whole": [], "drop_replica": []}
        for seed in range(seeds):
            flags = ["--trace", "llama3", "--seed", str(seed)]
            pol = _big(model, 16, "sustained", [*flags, "--policies", "elaswave,drop_replica"])["policies"]
            whole = _big(model, 16, "sustained", [*flags, "--policies", "elaswave", "--no-reshape"])["policies"]
            runs["elaswave"].append(pol["elaswave"])
            runs["drop_replica"].append(pol["drop_replica"])
            runs["elaswave_whole"].append(whole["elaswave"])
        row = {"model": model, "seeds": seeds, "runs": runs}
        for name, docs in runs.items():
            row[name] = {"after_over_before": spread([d["throughput_after_over_before"] for d in docs]),
                         "goodput": spread([d["goodput"] for d in docs]),
                         "failures": spread([d["failures"] for d in docs])}
        rows.append(row)
        print(f"  16k trace {model}: " + ", ".join(f"{n} {row[n]['goodput']['median']:.4f}" for n in runs), flush=True)
    return rows


def fmt(s: dict, f: str = ".4f") -> str:
    lo, hi = format(s["min"], f), format(s["max"], f)
    return format(s["median"], f) + ("" if lo == hi else f" ({lo}-{hi})")


def report(cmd: str, small: list[dict], big: list[dict], traced: list[dict], wall: float) -> list[str]:
    md = ["# Recovery on fair terms: equal failure-free plans, reshaped micro-batches (simulated)", "",
          f"`{cmd}`; this machine, one process, {wall:.0f} s. Every policy starts from the same failure-free "
          "plan (with clocks planned: the frequency planner's levels on every device; `clock gain` is that plan "
          "over nominal clocks); after a change elaswave re-plans clocks, a baseline keeps each surviving stage's "
          "clock and runs a stage it rebuilt at nominal. Clocks: `boost` (levels up to 1.2x nominal within the "
          "devices' nominal power) or `sustained` (none above nominal; docs/frequency_model.md). The clock model "
          "is assumed, not fitted to a GPU.", "",
          "## 96 devices, gpt-175b, one failure (middle stage of pipeline 0)", "",
          "elaswave's throughput after the failure over each baseline's after the same failure (equal before).", "",
          "| layout | clocks | clock gain | elaswave after/before | over templates | over reroute | over drop_replica "
          "| over restart | elaswave_no_dvfs over templates |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in small:
        o = r["elaswave_over"]
        md.append(f"| {r['dp']}x{r['pp']} | {r['clocks']} | {r['clock_gain']:.3f} | "
                  f"{r['after_over_before']['elaswave']:.3f} | {o['templates']:.3f} | {o['reroute']:.3f} | "
                  f"{o['drop_replica']:.3f} | {o['restart']:.3f} | {r['no_dvfs_over_templates']:.3f} |")
    md += ["", "## 16,384 devices (dp=1024 x pp=16), one failure: after / before", "",
           "`b`: sequences a micro-batch (2 x pp = 32 micro-batches a pipeline). *whole*: elaswave dealing whole "
           "micro-batches (`--no-reshape`); *reshaped*: dealing sequences. drop_replica keeps 1023/1024 of the "
           "batch; every other row keeps all of it.", "",
           "| model | clocks | b | step s | elaswave whole | elaswave reshaped | drop_replica | templates | reroute |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in big:
        a = r["after_over_before"]
        whole = f"{a['elaswave_whole']:.5f}" if "elaswave_whole" in a else f"{a['elaswave']:.5f}"
        shaped = f"{a['elaswave']:.5f}" if r["size"] > 1 else "- (b=1: nothing to reshape)"
        md.append(f"| {r['model']} | {r['clocks']} | {r['size']} | {r['step_s']:.0f} | {whole} | {shaped} | "
                  f"{a['drop_replica']:.5f} | {a['templates']:.5f} | {a['reroute']:.5f} |")
    md += ["", f"## 16,384 devices under the llama3 trace (24 h, sustained clocks, b=16), seeds 0-{traced[0]['seeds'] - 1}",
           "", "After / before: the steady rate after the first failure; goodput over the whole day. Median (range).", "",
           "| model | policy | after/before | goodput | failures |", "| --- | --- | --- | --- | --- |"]
    for r in traced:
        for name in ("elaswave", "elaswave_whole", "drop_replica"):
            s = r[name]
            md.append(f"| {r['model']} | {name} | {fmt(s['after_over_before'], '.5f')} | {fmt(s['goodput'])} | "
                      f"{fmt(s['failures'], '.0f')} |")
    md += ["", "A reshaped micro-batch of u sequences is priced u/b of a whole one's stage time (the cluster model "
               "is linear in sequences, no fixed cost per micro-batch): on a GPU a small micro-batch runs at lower "
               "efficiency, so the reshaped rows are an upper bound of what reshaping buys there."]
    return md


def main() -> None:
    ap = bench_args(__doc__, out="reshape")
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    began = time.perf_counter()
    small, big, traced = at_96(), one_failure_16k(), trace_16k(args.seeds)
    wall = time.perf_counter() - began
    cmd = f"python bench/sim/reshape.py --seeds {args.seeds}"
    write_results(args.out, {"command": cmd, "wall_s": wall, "at_96": small, "one_failure_16k": big,
                             "trace_16k": traced}, report(cmd, small, big, traced, wall))


if __name__ == "__main__":
    main()
