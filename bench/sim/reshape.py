"""Recovery on fair terms at 96 and 16,384 devices: equal failure-free plans, reshaped micro-batches.

Every row of ``elaswave simulate`` starts from one failure-free plan (clocks planned for all, their
gain over nominal clocks its own column), so each ratio measures recovery alone. Three tables:

- **96 devices**, one failure in the middle of pipeline 0, gpt-175b at every layout from 2x48 to
  12x8, with clocks (the sourced model, and its band over the clock corners) and without:
  elaswave's throughput after the failure over each baseline's.
- **16,384 GPUs** in TP groups of 8 on layouts that fit 80 GiB, one failure, gpt-175b
  (256 x 8 x 8) and llama3-70b (128 x 16 x 8, 512 x 4 x 8), 1, 4 and 16
  sequences a micro-batch, each ratio with its band and the calibration error: elaswave dealing whole micro-batches or reshaped (sequences), beside
  drop_replica (TorchFT's policy: the batch shrinks), templates and reroute.
- **16,384 GPUs under the llama3 trace** (24 h, 3 seeds, the first two layouts), 16 sequences a micro-batch: the
  steady ratio after the first failure and the goodput, median (range).

    python bench/sim/reshape.py [--seeds 3]
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import RESULTS, bench_args, write_results  # noqa: E402
from bench.sim.simulator import simulate  # noqa: E402  `elaswave simulate --json` in this process

LAYOUTS_96 = ((2, 48), (3, 32), (4, 24), (6, 16), (12, 8))
BASELINES = ("templates", "reroute", "drop_replica", "restart")
BIG = (("gpt-175b", 256, 8), ("llama3-70b", 128, 16), ("llama3-70b", 512, 4))
"""16,384 GPUs as (model, dp, pp) with tp=8: layouts that fit 80 GiB (full checkpointing) at every size."""
TRACED = BIG[:2]
SIZES = (1, 4, 16)


CALIBRATION = str(RESULTS / "sim_calibration.json")
"""The emulated-compute calibration: each rank its own compute, as on GPUs (the real-compute one
shares 2 cores among 4 ranks, a contention the cluster model does not have)."""


def at_96() -> list[dict]:
    rows = []
    for dp, pp in LAYOUTS_96:
        # Memory unmodelled here (--device-gib 0): without TP gpt-175b fits no 96-device layout's 80 GiB.
        argv = ["--devices", "96", "--dp", str(dp), "--pp", str(pp), "--model", "gpt-175b", "--device-gib", "0"]
        doc = simulate([*argv, "--band", "--calibration", CALIBRATION])
        plain = simulate([*argv, "--no-dvfs"])["policies"]
        pol = doc["policies"]
        after = {n: p["throughput_after"] for n, p in pol.items()}
        rows.append({"dp": dp, "pp": pp, "clock_gain": doc["config"]["failure_free_clock_gain"],
                     "clock_gain_band": doc["config"]["failure_free_clock_gain_band"],
                     "calibration": doc["config"]["calibration"],
                     "before": {n: p["throughput_before"] for n, p in pol.items()},
                     "after_over_before": {n: p["throughput_after_over_before"] for n, p in pol.items()},
                     "elaswave_over": {b: after["elaswave"] / after[b] for b in BASELINES},
                     "elaswave_over_band": pol["elaswave"]["band"]["after_over"],
                     "no_clocks_over": {b: plain["elaswave_no_dvfs"]["throughput_after"] / plain[b]["throughput_after"]
                                        for b in BASELINES}})
        print(f"  96 {dp}x{pp}: elaswave/templates {rows[-1]['elaswave_over']['templates']:.3f} "
              f"{rows[-1]['elaswave_over_band']['templates']}", flush=True)
    return rows


def _big(layout: tuple[str, int, int], size: int, extra: list[str]) -> dict:
    model, dp, pp = layout
    return simulate(["--devices", "16384", "--dp", str(dp), "--pp", str(pp), "--tp", "8", "--model", model,
                     "--device-gib", "80", "--checkpointing", "full", "--micro-batch-size", str(size),
                     "--calibration", CALIBRATION, *extra])


def one_failure_16k() -> list[dict]:
    rows = []
    for layout in BIG:
        for size in SIZES:
            doc = _big(layout, size, ["--policies", "elaswave,drop_replica,templates,reroute", "--band"])
            pol = doc["policies"]
            row = {"model": layout[0], "dp": layout[1], "pp": layout[2], "size": size, "wall_s": doc["config"]["wall_s"],
                   "clock_gain": doc["config"]["failure_free_clock_gain"],
                   "clock_gain_band": doc["config"]["failure_free_clock_gain_band"],
                   "calibration": doc["config"]["calibration"],
                   "step_s": pol["elaswave"]["step_before_s"], "tokens_per_s": pol["elaswave"]["tokens_per_s_before"],
                   "after_over_before": {n: p["throughput_after_over_before"] for n, p in pol.items()},
                   "band": {n: p["band"]["after_over_before"] for n, p in pol.items()},
                   "plus_minus": {n: (p["plus_minus"] or {}).get("after_over_before") for n, p in pol.items()},
                   "batch_kept": {n: p["batch_after_over_before"] for n, p in pol.items()}}
            if size > 1:
                whole = _big(layout, size, ["--policies", "elaswave", "--no-reshape", "--band"])["policies"]["elaswave"]
                row["after_over_before"]["elaswave_whole"] = whole["throughput_after_over_before"]
                row["band"]["elaswave_whole"] = whole["band"]["after_over_before"]
            rows.append(row)
            print(f"  16k {layout} b={size}: {row['after_over_before']} {row['band']}", flush=True)
    return rows


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def trace_16k(seeds: int) -> list[dict]:
    rows = []
    for layout in TRACED:
        runs: dict[str, list[dict]] = {"elaswave": [], "elaswave_whole": [], "drop_replica": []}
        for seed in range(seeds):
            flags = ["--trace", "llama3", "--seed", str(seed), "--band"]
            pol = _big(layout, 16, [*flags, "--policies", "elaswave,drop_replica"])["policies"]
            whole = _big(layout, 16, [*flags, "--policies", "elaswave", "--no-reshape"])["policies"]
            runs["elaswave"].append(pol["elaswave"])
            runs["drop_replica"].append(pol["drop_replica"])
            runs["elaswave_whole"].append(whole["elaswave"])
        row = {"model": layout[0], "dp": layout[1], "pp": layout[2], "seeds": seeds, "runs": runs}
        for name, docs in runs.items():
            row[name] = {"after_over_before": spread([d["throughput_after_over_before"] for d in docs]),
                         "goodput": spread([d["goodput"] for d in docs]),
                         "goodput_band": [min(d["band"]["goodput"][0] for d in docs),
                                          max(d["band"]["goodput"][1] for d in docs)],
                         "failures": spread([d["failures"] for d in docs])}
        rows.append(row)
        print(f"  16k trace {layout}: " + ", ".join(f"{n} {row[n]['goodput']['median']:.4f}" for n in runs), flush=True)
    return rows


def fmt(s: dict, f: str = ".4f") -> str:
    lo, hi = format(s["min"], f), format(s["max"], f)
    return format(s["median"], f) + ("" if lo == hi else f" ({lo}-{hi})")


def span(b, f: str = ".3f") -> str:
    return "-" if not b else f"[{format(b[0], f)}-{format(b[1], f)}]"


def report(cmd: str, small: list[dict], big: list[dict], traced: list[dict], wall: float) -> list[str]:
    cal = small[0]["calibration"]
    md = ["# Recovery on fair terms: equal failure-free plans, reshaped micro-batches (simulated)", "",
          f"`{cmd}`; this machine, one process, {wall:.0f} s. Every policy starts from the same failure-free "
          "plan (with clocks planned: the frequency planner's levels on every device; `clock gain` is that plan "
          "over nominal clocks); after a change elaswave re-plans clocks, a baseline keeps each surviving stage's "
          "clock and runs a stage it rebuilt at nominal.", "",
          "Clocks: the sourced model (docs/frequency_model.md: fitted to an A100's measured stage times and power, "
          "0.78 of step time scaling with the clock), `boost` levels (up to 1.2x nominal within the devices' "
          "nominal power). **[lo-hi]**: the range over the clock model's corners -- `sustained` (no level above "
          "nominal) and `boost`, each at 50 % and 100 % of step time scaling with the clock -- and the sourced "
          "figure. **Calibration error**: the simulator's largest held-out error against real runs "
          f"({cal['source']}, emulated compute, {cal['runs']} runs): after/before +-{100 * cal['ratio']:.1f} %, step "
          f"times +-{100 * cal['step']:.1f} %, measured at 4-16 ranks and carried to every figure here as it is -- "
          "but for reroute's, priced at a lower bound no run checked.", "",
          "## 96 devices, gpt-175b, one failure (middle stage of pipeline 0)", "",
          "elaswave's throughput after the failure over each baseline's after the same failure (equal before). "
          "*with clocks*: elaswave re-plans them; *without*: every device at nominal, elaswave_no_dvfs. These "
          "layouts are priced without a memory limit (no TP: most would not fit 80 GiB).", "",
          "| layout | clock gain | elaswave after/before | over templates | over reroute | over drop_replica "
          "| over restart | without clocks: over templates | over reroute | over drop_replica | over restart |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in small:
        o, band, n = r["elaswave_over"], r["elaswave_over_band"], r["no_clocks_over"]
        md.append(f"| {r['dp']}x{r['pp']} | {r['clock_gain']:.3f} {span(r['clock_gain_band'])} | "
                  f"{r['after_over_before']['elaswave']:.3f} | "
                  + " | ".join(f"{o[b]:.3f} {span(band[b])}" for b in BASELINES) + " | "
                  + " | ".join(f"{n[b]:.3f}" for b in BASELINES) + " |")
    md += ["", "## 16,384 GPUs, tensor-parallel groups of 8, 80 GiB each: one failure, after / before", "",
           "Every layout fits 80 GiB per GPU in the memory model (bf16, full activation checkpointing, "
           "`--device-gib 80`; without TP, dp=1024 x pp=16 does not). `b`: sequences a micro-batch "
           "(2 x pp x dp micro-batches a step). *whole*: elaswave dealing whole micro-batches (`--no-reshape`); "
           "*reshaped*: dealing sequences. drop_replica keeps (dp-1)/dp of the batch; every other row keeps all "
           "of it. A GPU's failure takes its TP group. `step s` and `tokens/s`: the failure-free step (sourced "
           "clocks; +- the calibration's step error).", "",
           "| model | layout | b | step s | tokens/s | elaswave whole | elaswave reshaped | drop_replica | templates | reroute |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in big:
        a, band = r["after_over_before"], r["band"]
        whole = "elaswave_whole" if "elaswave_whole" in a else "elaswave"
        shaped = f"{a['elaswave']:.5f} {span(band['elaswave'], '.5f')}" if r["size"] > 1 else "- (b=1: nothing to reshape)"
        md.append(f"| {r['model']} | {r['dp']}x{r['pp']}x8 | {r['size']} | {r['step_s']:.3g} +-{r['step_s'] * r['calibration']['step']:.2g} | "
                  f"{r['tokens_per_s']:.3g} | {a[whole]:.5f} {span(band[whole], '.5f')} | {shaped} | "
                  + " | ".join(f"{a[n]:.5f} {span(band[n], '.5f')}" for n in ("drop_replica", "templates", "reroute")) + " |")
    md += ["", f"## 16,384 GPUs (TP groups of 8) under the llama3 trace (24 h, b=16), seeds 0-{traced[0]['seeds'] - 1}",
           "", "After / before: the steady rate after the first failure; goodput over the whole day. Median (range) "
               "over seeds with the sourced clocks; [lo-hi]: the goodput over every seed and clock corner.", "",
           "| model | layout | policy | after/before | goodput | goodput over clock corners | failures |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in traced:
        for name in ("elaswave", "elaswave_whole", "drop_replica"):
            s = r[name]
            md.append(f"| {r['model']} | {r['dp']}x{r['pp']}x8 | {name} | {fmt(s['after_over_before'], '.5f')} | {fmt(s['goodput'])} | "
                      f"{span(s['goodput_band'], '.4f')} | {fmt(s['failures'], '.0f')} |")
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
