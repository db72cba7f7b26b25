"""The simulator's clock model refitted from published measurements (docs/frequency_model.md).

The points: one pipeline stage of GPT-3 175B (bf16) on an NVIDIA A100 SXM, its forward and backward
time and energy at fixed SM clocks from 1410 MHz (the top) down to 855 MHz, every 45 MHz --
Perseus (Chung et al., SOSP 2024), released data ``sosp24_data/emulation/stage_profile/
gpt3-175b+a100_sxm_bf16.csv`` in github.com/ml-energy/zeus (every stage of that profile has the
same rows). Forward and backward are summed, as a stage's micro-batch is.

The fit, relative to the top clock (f = MHz / 1410):
- time  ``t(f) / t(1) = share / f + 1 - share``   (least squares in ``share``);
- power ``P(f) / P(1) = static + (1 - static) f^k`` (least squares in ``static`` for each k on a
  grid, the best k kept).

    python bench/sim/clock_fit.py     # -> results/clock_fit.{json,md}; compares with plan/frequency.SOURCED
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import RESULTS, write_results  # noqa: E402

TOP_MHZ = 1410
SOURCE = ("Perseus (SOSP 2024) released data, github.com/ml-energy/zeus "
          "sosp24_data/emulation/stage_profile/gpt3-175b+a100_sxm_bf16.csv, stage 0")
POINTS = (  # MHz, forward ms, forward J, backward ms, backward J
    (1410, 50.16, 23.81, 92.95, 44.58), (1365, 50.45, 23.50, 93.47, 43.54), (1320, 51.58, 22.50, 95.29, 41.45),
    (1275, 52.96, 21.25, 97.82, 38.98), (1230, 54.82, 19.82, 100.76, 37.10), (1185, 56.73, 19.00, 104.08, 35.30),
    (1140, 58.89, 18.36, 107.82, 34.11), (1095, 61.17, 17.76, 111.56, 32.93), (1050, 63.68, 17.58, 115.91, 32.58),
    (1005, 66.49, 17.78, 120.92, 33.12), (960, 69.45, 17.86, 125.97, 33.27), (915, 72.70, 17.91, 131.52, 33.10),
    (870, 76.54, 18.06, 138.71, 33.33), (855, 77.73, 18.24, 140.57, 33.64),
)


def measured() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(relative clock, relative time, relative power) of a stage's forward + backward."""
    pts = np.array(POINTS, dtype=float)
    f = pts[:, 0] / TOP_MHZ
    t = (pts[:, 1] + pts[:, 3]) / 1000
    watts = (pts[:, 2] + pts[:, 4]) / t
    top = int(np.argmax(f))
    return f, t / t[top], watts / watts[top]


def fit() -> dict:
    f, t, p = measured()
    x = 1 / f - 1
    share = float(x @ (t - 1) / (x @ x))
    best = None
    for k in np.arange(1.0, 6.0001, 0.05):
        y = f ** k - 1
        dynamic = float(y @ (p - 1) / (y @ y))
        err = float(((1 + dynamic * y - p) ** 2).sum())
        if best is None or err < best[0]:
            best = (err, float(k), dynamic)
    _, k, dynamic = best
    t_fit = share / f + 1 - share
    p_fit = 1 - dynamic + dynamic * f ** k
    return {"clock_share": share, "static_w": 1 - dynamic, "dynamic_w": dynamic, "exponent": k,
            "time_max_abs_error": float(np.abs(t_fit - t).max()), "power_max_abs_error": float(np.abs(p_fit - p).max()),
            "points": [{"relative_clock": float(a), "relative_time": float(b), "relative_power": float(c)}
                       for a, b, c in zip(f, t, p)]}


def main() -> int:
    from elaswave.plan.frequency import SOURCED

    got = fit()
    used = {k: getattr(SOURCED, k) for k in ("clock_share", "static_w", "dynamic_w", "exponent")}
    md = [f"Clock model refitted from {SOURCE}: {len(POINTS)} clocks from {POINTS[-1][0]} to {TOP_MHZ} MHz.", "",
          "| term | fitted | the simulator's (plan/frequency.SOURCED) |", "| --- | --- | --- |"]
    md += [f"| {k} | {got[k]:.3f} | {v:g} |" for k, v in used.items()]
    md += ["", f"Largest misfit over the points: time {got['time_max_abs_error']:.3f}, power "
               f"{got['power_max_abs_error']:.3f} (of the top clock's).", "",
           "| clock (of 1410 MHz) | time (of the top clock's) | power (of the top clock's) |", "| --- | --- | --- |"]
    md += [f"| {p['relative_clock']:.3f} | {p['relative_time']:.3f} | {p['relative_power']:.3f} |" for p in got["points"]]
    write_results(RESULTS / "clock_fit", {"source": SOURCE, "fit": got, "simulator": used}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
