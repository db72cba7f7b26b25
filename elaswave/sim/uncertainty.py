"""How far a simulated figure can be trusted (pure): the band the clock model's unknowns span, and
the error the simulator made predicting real runs.

The clock band. Two things about clocks are not known for a cluster the simulator has not seen:
whether its devices hold their top clock under load (``sustained``: a plan can only lower
waiting stages) or run power-capped below it (``boost``), and what share of a stage's time
scales with the clock (memory-bound kernels do not). Every headline ratio is therefore also
computed at the four corners -- each clock model at 50 % and at 100 % clock scaling, or the
range given -- and shown as the range they span (:func:`corners`); the printed figure is the sourced model's
(docs/frequency_model.md).

The calibration error. ``bench/sim/calibration.py`` runs real jobs, fits the model on one and
predicts the others; its results file holds, per run, each quantity's relative error. The
largest held-out error of the after/before ratio and of the step times is what a figure carries
as ``+-``: an error seen at 4-16 ranks, carried to 16,384 devices as it is (nothing measured
says how it grows).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from elaswave.plan.frequency import CLOCKS, PowerModel

SHARES = (0.5, 1.0)
"""The default range of the share of step time that scales with the clock."""


def corners(shares: tuple[float, float] = SHARES) -> tuple[tuple[str, float], ...]:
    """(clock model, share of step time that scales with the clock) at the band's corners."""
    return tuple((clocks, share) for clocks in ("sustained", "boost") for share in shares)


def parse_shares(text: str) -> tuple[float, float]:
    """``LO,HI`` with 0 < LO < HI <= 1; ValueError naming the value otherwise."""
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        lo = hi = None
    if lo is None or not 0 < lo < hi <= 1:
        raise ValueError(f"--band={text} is invalid: the range of the share of step time that scales with the clock, "
                         "LO,HI with 0 < LO < HI <= 1 (default 0.5,1)")
    return lo, hi


def corner_power(clocks: str, share: float) -> PowerModel:
    return replace(CLOCKS[clocks], clock_share=share)


def band(values) -> tuple[float, float] | None:
    got = [v for v in values if v is not None]
    return (min(got), max(got)) if got else None


@dataclass(frozen=True)
class HeldOutErrors:
    ratio: float
    """The largest held-out relative error of the predicted after/before ratio."""
    step: float
    """The largest held-out relative error of a predicted step time (before or after the change)."""
    source: str
    runs: int
    """Held-out runs the errors come from."""


def calibration_error(path: str) -> HeldOutErrors:
    """The held-out errors in a calibration results file (``bench/results/sim_calibration*.json``):
    rows fitted on (``fit``, ``(fit)``) and link runs are left out. Raises ValueError naming what
    is wrong with the file."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--calibration={path} cannot be read as a calibration results file: {exc}") from None
    runs = doc.get("summary") or doc.get("runs") if isinstance(doc, dict) else None
    if not isinstance(runs, dict):
        raise ValueError(f"--calibration={path} has no 'runs' or 'summary' of predicted runs (written by "
                         "bench/sim/calibration.py)")
    held = {n: q for n, q in runs.items() if isinstance(q, dict) and "fit" not in n and not n.startswith("link")}
    ratio = [abs(q["after_over_before"]["error"]) for q in held.values() if "after_over_before" in q]
    step = [abs(q[k]["error"]) for q in held.values() for k in ("step_before_s", "step_after_s") if k in q]
    if not ratio or not step:
        raise ValueError(f"--calibration={path} holds no held-out after_over_before and step-time errors")
    return HeldOutErrors(max(ratio), max(step), str(path), len(held))
