"""Pictures of a simulation: throughput over time per policy, goodput, time lost per failure."""
from __future__ import annotations

from typing import Mapping

from elaswave.errors import ConfigError
from elaswave.sim.engine import PolicyResult


def plot(results: Mapping[str, PolicyResult], title: str, duration_s: float, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(f"--plot {path} needs matplotlib (pip install matplotlib)") from None
    fig, (ax_t, ax_g, ax_l) = plt.subplots(1, 3, figsize=(15, 4.2), gridspec_kw={"width_ratios": [2.2, 1, 1]})
    hours = duration_s / 3600
    for name, r in results.items():
        full = r.timeline[0][1] or 1.0
        xs = [t / 3600 for t, _ in r.timeline] + [hours]
        ys = [v / full for _, v in r.timeline] + [r.timeline[-1][1] / full]
        ax_t.plot(xs, ys, drawstyle="steps-post", label=name, linewidth=1.4)
    ax_t.set(xlabel="hours", ylabel="throughput / failure-free", title="Throughput over time", xlim=(0, hours))
    ax_t.set_ylim(bottom=0)
    ax_t.legend(loc="lower left", fontsize=8)
    names = list(results)
    goodput = [results[n].goodput for n in names]
    ax_g.bar(names, goodput, color="tab:blue")
    ax_g.set(title="Goodput", ylim=(min(0.9, min(goodput) - 0.02), max(1.0, max(goodput)) + 0.01))
    lost = [results[n].time_lost_per_failure_s or 0.0 for n in names]
    ax_l.bar(names, lost, color="tab:red")
    ax_l.set(title="Time lost per failure (s)", yscale="log" if max(lost) > 50 * max(min(lost), 1e-9) else "linear")
    for ax in (ax_g, ax_l):
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
