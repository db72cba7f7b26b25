"""Frequency (DVFS) planning (pure): the fastest step the power cap allows, and the least energy
at that step time.

A stage's compute time scales with its device's relative frequency ``f`` as
:meth:`PowerModel.speed` says (``1 / f`` when all of it is clock-bound), and its power as
``static + dynamic * f**exponent``. A plan is a level for every stage and a
micro-batch split (every pipeline at least one, as :mod:`microbatches` requires); it must keep the
power of all devices within the cap, and the step is the slowest pipeline.

Pricing. Pipeline ``d`` with ``m`` micro-batches and stage times ``u_s = t_s / speed(f_s)`` (forward
+ backward at the stage's level) is priced ``sum_s u_s + (m - 1) max_s u_s`` (:func:`pipeline_s`):
fill and drain from the real stage times, then the slowest stage sets the pace. That is the time
of the runtime's 1F1B order (:func:`~elaswave.pipeline.schedule.one_f_one_b_makespan`) when the
stages take as long as each other, and an upper bound on it otherwise (tests check it on random
pipelines). The price this replaced, ``(m + S - 1) max_s u_s``, made a lowered waiting stage look
free although it lengthens fill and drain, and a raised one useless although it shortens them.

Why search the step time. Fixing the step time ``T`` makes everything else local:

- a pipeline's *options* are level assignments of its stages, each with its power ``P``, its sum
  ``U`` and its slowest stage ``X``; given ``T`` an option takes up to ``(T - U) / X + 1``
  micro-batches. The least power for each micro-batch count is then a step function of the
  count; a *tier* is the most micro-batches at one power (pipelines with the same stage times in
  any order share their options and tiers);
- the least total power at ``T`` is the cheapest choice of one tier per pipeline whose
  micro-batches cover the batch: a covering knapsack, solved exactly by a DP over pipelines x
  micro-batches covered;
- that least power only falls as ``T`` grows, so bisecting ``T`` finds the smallest step whose
  least power fits the cap (to a relative 1e-10; the plan built from it is no slower), and the
  least power -- so the least energy, ``T x power`` -- among the plans that fast.

Options. A pipeline's stages with equal times are interchangeable, so an option is a count of
stages per level for each distinct time. Up to ``ENUMERATE_MAX`` such options they are all tried:
the plan is then exact (brute force over every level of every stage agrees, in tests). Above it
(a 48-stage pipeline has millions), for every slowest-stage bound ``B`` (a stage time over a level's speed)
every stage starts at the lowest level that meets ``B``, and stages are raised one level at a time,
the cheapest watts per second of fill saved first: the LP relaxation's chain, so each option on it
is the least power for its sum up to one stage's raise. Above ``CHAIN_MAX`` options in all (10^5
devices), a chain keeps only its uniform floors (every stage at least at level ``phi``).

Bounded at scale. The DP costs pipelines x micro-batches x tiers per step time: fine for hundreds
of devices, too slow at 10^5 (6,250 pipelines x 25,000 micro-batches). Above ``EXACT_MAX_WORK``
the tiers are chosen instead by the LP relaxation's greedy: every pipeline starts at its cheapest
tier, and upgrades along each pipeline kind's lower convex hull of (micro-batches, power) are
taken cheapest watt per micro-batch first, identical pipelines as one batch, the last batch only
as far as needed. The greedy exceeds the least power by at most one pipeline's upgrade, so the
step it finds is at most the exact one for a cap smaller by that much; a plan slower than every
device at nominal is never returned (it falls back to that one).

Given the tiers, the micro-batches are filled as :func:`microbatches.balance` does (each next one
where it finishes soonest, up to each pipeline's tier), and every pipeline then takes its least
power option that meets the resulting step, which can only lower the power.

A cap that even every device at its lowest level breaks cannot be met: the plan is then the
nominal one (every device at 1.0), as the callers have always received.
"""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from elaswave.plan import microbatches

EXACT_MAX_WORK = 2_000_000
"""Above this many pipelines x micro-batches x tiers the DP gives way to the greedy (see above)."""
ENUMERATE_MAX = 4_096
"""A pipeline kind with up to this many level assignments (up to stage order) tries them all."""
CHAIN_MAX = 40_000
"""Above this many chained options over all kinds, chains keep only their uniform floors."""
_TOL = 1e-9


@dataclass(frozen=True)
class PowerModel:
    levels: tuple[float, ...] = (0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2)
    """Relative frequencies a device can be set to (1.0 = nominal, above it: boost)."""
    static_w: float = 0.3
    dynamic_w: float = 0.7
    exponent: float = 3.0
    """Power at frequency f is ``static_w + dynamic_w * f**exponent`` (1.0 at nominal with the defaults)."""
    clock_share: float = 1.0
    """The share of a stage's time at nominal that scales with its clock: at ``f`` it takes
    ``t * (clock_share / f + 1 - clock_share)``; the rest (memory-bound kernels, launches) does
    not move. 1.0 is what the emulated actuator does (``emulate.*`` divides by ``f``)."""

    def __post_init__(self) -> None:
        if not self.levels or any(f <= 0 for f in self.levels) or 1.0 not in self.levels:
            raise ValueError(f"frequency levels must be > 0 and include the nominal 1.0, got {list(self.levels)}")
        if self.static_w < 0 or self.dynamic_w < 0 or self.exponent <= 0:
            raise ValueError(f"power terms must be >= 0 and the exponent > 0, got static_w={self.static_w}, "
                             f"dynamic_w={self.dynamic_w}, exponent={self.exponent}")
        if not 0 < self.clock_share <= 1:
            raise ValueError(f"clock_share={self.clock_share} is invalid: the share of step time that scales with "
                             "the clock, in (0, 1]")

    def power(self, f: float) -> float:
        return self.static_w + self.dynamic_w * f ** self.exponent

    def speed(self, f: float) -> float:
        """How much faster than at nominal a stage runs at frequency ``f``."""
        return 1.0 / (self.clock_share / f + 1.0 - self.clock_share)


SOURCED = PowerModel(static_w=0.38, dynamic_w=0.62, exponent=3.5, clock_share=0.78)
"""Fitted to an A100 SXM's measured GPT-3 175B stage profile at 855-1410 MHz (Perseus, SOSP 2024,
its released data; docs/frequency_model.md, ``bench/sim/clock_fit.py`` refits it): power
``0.38 + 0.62 f^3.5`` of the power at the top clock, time ``0.78 / f + 0.22`` of its time."""

CLOCKS = {"boost": SOURCED, "sustained": replace(SOURCED, levels=(0.6, 0.7, 0.8, 0.9, 1.0))}
"""The simulator's frequency models (sources: docs/frequency_model.md). ``sustained``: nominal is
the top clock devices already hold under load (the fit's 1.0), so a plan can only lower waiting
stages: energy, never speed. ``boost``: levels up to 1.2x nominal when lowered stages pay for it
within the cap, for devices power-capped below their top clock -- the fitted curves carried past
1.0, where nothing was measured (power 1.55 at 1.2 is an extrapolation)."""


@dataclass(frozen=True)
class FrequencyPlan:
    levels: tuple[tuple[float, ...], ...]
    """levels[d][s]: the frequency of stage s of pipeline d."""
    micro_batches: tuple[tuple[int, ...], ...]
    step_s: float
    """Predicted step time: the slowest pipeline's :func:`pipeline_s` at its levels."""
    energy_j: float
    """Predicted energy of one step: every device at its power for the whole step."""
    solver: str = "nominal"
    """What chose the levels: ``exact`` (the covering knapsack's DP), ``greedy`` (its LP
    relaxation, above EXACT_MAX_WORK: within one upgrade of the least power), or ``nominal`` (no
    plan fits the cap, or the greedy one was no better than nominal clocks)."""


def pipeline_s(stage_s: Sequence[float], num_micro_batches: int) -> float:
    """The planner's price of one pipeline's 1F1B step (module docstring): the stages' times once
    (fill and drain) plus the slowest stage's for every further micro-batch."""
    return sum(stage_s) + (num_micro_batches - 1) * max(stage_s)


def plan_frequencies(stage_s: Sequence[Sequence[float]], num_micro_batches: int,
                     model: PowerModel = PowerModel(), power_cap_w: float | None = None) -> FrequencyPlan:
    """``stage_s[d][s]``: the compute time of one micro-batch on stage s of pipeline d at nominal
    frequency (forward + backward). ``power_cap_w``: the most all devices together may draw
    (default: every device at nominal)."""
    if not stage_s or any(not p for p in stage_s) or any(t <= 0 for p in stage_s for t in p):
        raise ValueError(f"need at least one pipeline, each with stages of time > 0, got {stage_s!r}")
    if num_micro_batches < len(stage_s):
        raise ValueError(
            f"{num_micro_batches} micro-batches cannot give each of {len(stage_s)} pipelines at least one")
    cap = model.power(1.0) * sum(len(p) for p in stage_s) if power_cap_w is None else power_cap_w
    levels = tuple(sorted(model.levels))
    speeds = tuple(model.speed(f) for f in levels)
    watts = tuple(model.power(f) for f in levels)
    kinds = _kinds(stage_s)
    options = _all_options(kinds, levels, speeds, watts)
    # A pipeline never takes more than what the others leave it, one each.
    most = num_micro_batches - len(stage_s) + 1
    work = sum(len(k.members) * min(most, len(o.power)) for k, o in zip(kinds, options)) * (num_micro_batches + 1)
    choose = _exact if work <= EXACT_MAX_WORK else _greedy
    found: dict[float, tuple[float, dict[int, int]] | None] = {}

    def least(step_s: float) -> tuple[float, dict[int, int]] | None:
        if step_s not in found:
            tiers = [o.tiers(step_s, most) for o in options]
            found[step_s] = None if not all(tiers) else choose(kinds, tiers, num_micro_batches)
        return found[step_s]

    def fits(step_s: float) -> bool:
        got = least(step_s)
        return got is not None and got[0] <= cap * (1 + _TOL)

    fast = _balanced_step(stage_s, num_micro_batches, speeds[-1])
    slow = _balanced_step(stage_s, num_micro_batches, speeds[0])
    if not fits(slow):
        # Not even every device at its lowest level fits: the nominal plan, as before.
        return nominal_plan(stage_s, num_micro_batches, model)
    lo, hi = fast, slow
    if fits(fast):
        hi = fast
    while hi > lo * (1 + 1e-10):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    plan = _build(stage_s, kinds, options, num_micro_batches, least(hi)[1], hi, levels, model)
    if choose is _greedy:  # its power can overshoot the least by one upgrade: never worse than nominal
        plain = nominal_plan(stage_s, num_micro_batches, model)
        if plain.step_s < plan.step_s * (1 - _TOL) and plain.energy_j / plain.step_s <= cap * (1 + _TOL):
            return plain
    return replace(plan, solver="exact" if choose is _exact else "greedy")


@dataclass(frozen=True)
class _Kind:
    """Pipelines with the same stage times (in any order): they share their options."""
    num_stages: int
    times: tuple[float, ...]
    counts: tuple[int, ...]
    members: tuple[int, ...]


def _kinds(stage_s: Sequence[Sequence[float]]) -> list[_Kind]:
    groups: dict[tuple, list[int]] = {}
    for d, p in enumerate(stage_s):
        times: dict[float, int] = {}
        for t in p:
            times[t] = times.get(t, 0) + 1
        groups.setdefault((len(p), tuple(sorted(times.items()))), []).append(d)
    return [_Kind(s, tuple(t for t, _ in items), tuple(c for _, c in items), tuple(members))
            for (s, items), members in groups.items()]


class _Options:
    """One kind's level assignments, cheapest first: ``shares[k][j][i]`` stages of time
    ``times[j]`` at level ``i``; their power, sum of stage times and slowest stage as arrays."""

    def __init__(self, kind: _Kind, levels: Sequence[float], speeds: Sequence[float], watts: Sequence[float],
                 shares: np.ndarray):
        # shares: (options, distinct times, levels) stage counts; each recovery plans on every
        # rank at once, so this is arrays, not a loop per option (repeats are harmless: equal
        # options make equal tiers).
        per_stage = np.asarray(kind.times)[:, None] / np.asarray(speeds)[None, :]
        power = (shares * np.asarray(watts)).sum(axis=(1, 2))
        total = (shares * per_stage).sum(axis=(1, 2))
        peak = np.where(shares > 0, per_stage, 0.0).max(axis=(1, 2))
        order = np.lexsort((peak, total, power))
        self.power, self.total, self.peak, self.shares = power[order], total[order], peak[order], shares[order]
        self.kind, self.levels = kind, tuple(levels)

    def tiers(self, step_s: float, most: int) -> list[tuple[int, float]]:
        """(micro-batches, power) pairs, both increasing: the most micro-batches one pipeline of
        this kind takes within ``step_s`` for each power it can draw; empty if not even one fits."""
        takes = np.floor((step_s * (1 + _TOL) - self.total) / self.peak) + 1
        takes = np.minimum(takes, most)
        before = np.maximum.accumulate(np.concatenate(([0.0], takes[:-1])))
        out: list[tuple[int, float]] = []
        for i in np.flatnonzero(takes > np.maximum(before, 0.0)):
            m, w = int(takes[i]), float(self.power[i])
            while out and out[-1][1] >= w:  # as dear and fewer micro-batches: never worth it
                out.pop()
            out.append((m, w))
        return out

    def cheapest(self, num_micro_batches: int, within_s: float) -> int:
        """The least power option that runs ``num_micro_batches`` within ``within_s``."""
        ok = self.total + (num_micro_batches - 1) * self.peak <= within_s * (1 + _TOL)
        return int(np.argmax(ok))

    def stage_levels(self, k: int, stage_s: Sequence[float]) -> tuple[float, ...]:
        """Option ``k`` laid on a pipeline's stages in order (of equal stages, the first ones get
        the higher levels)."""
        queue = {t: [i for i in reversed(range(len(self.levels))) for _ in range(int(counts[i]))]
                 for t, counts in zip(self.kind.times, self.shares[k])}
        return tuple(self.levels[queue[t].pop(0)] for t in stage_s)


def _all_options(kinds: Sequence[_Kind], levels: Sequence[float], speeds: Sequence[float],
                 watts: Sequence[float]) -> list[_Options]:
    full = {i for i, k in enumerate(kinds) if _assignments(k, len(levels)) <= ENUMERATE_MAX}
    chained = sum(len(k.times) * len(levels) * k.num_stages * (len(levels) - 1)
                  for i, k in enumerate(kinds) if i not in full)
    out = []
    for i, k in enumerate(kinds):
        if i in full:
            groups = [np.array(_multisets(c, len(levels))) for c in k.counts]
            pick = np.indices([len(g) for g in groups]).reshape(len(groups), -1)
            shares = np.stack([g[at] for g, at in zip(groups, pick)], axis=1)
        else:
            shares = np.array(_chains(k, speeds, watts, floors_only=chained > CHAIN_MAX))
        out.append(_Options(k, levels, speeds, watts, shares))
    return out


def _assignments(kind: _Kind, num_levels: int) -> int:
    return math.prod(math.comb(c + num_levels - 1, num_levels - 1) for c in kind.counts)


def _multisets(count: int, num_levels: int) -> list[tuple[int, ...]]:
    out = []
    for combo in itertools.combinations_with_replacement(range(num_levels), count):
        counts = [0] * num_levels
        for i in combo:
            counts[i] += 1
        out.append(tuple(counts))
    return out


def _chains(kind: _Kind, speeds: Sequence[float], watts: Sequence[float], floors_only: bool) -> list[tuple]:
    """Per slowest-stage bound: the lowest levels meeting it, then raises one stage one level at a
    time, cheapest watts per second saved first (or, ``floors_only``, every stage at least at each
    level in turn)."""
    top = len(speeds) - 1
    out = []
    for bound in sorted({t / f for t in kind.times for f in speeds}):
        base = [next((i for i, f in enumerate(speeds) if t / f <= bound * (1 + _TOL)), None) for t in kind.times]
        if None in base:
            continue
        if floors_only:
            for floor in range(len(speeds)):
                out.append(tuple(_at(c, max(b, floor), len(speeds)) for c, b in zip(kind.counts, base)))
            continue
        counts = [list(_at(c, b, len(speeds))) for c, b in zip(kind.counts, base)]
        out.append(tuple(tuple(c) for c in counts))
        while True:
            best = None
            for j, (t, row) in enumerate(zip(kind.times, counts)):
                i = next(i for i, n in enumerate(row) if n)
                if i < top:
                    rate = (watts[i + 1] - watts[i]) / (t / speeds[i] - t / speeds[i + 1])
                    if best is None or rate < best[0]:
                        best = (rate, j, i)
            if best is None:
                break
            _, j, i = best
            counts[j][i] -= 1
            counts[j][i + 1] += 1
            out.append(tuple(tuple(c) for c in counts))
    return out


def _at(count: int, level: int, num_levels: int) -> tuple[int, ...]:
    return tuple(count if i == level else 0 for i in range(num_levels))


def _exact(kinds: Sequence[_Kind], tiers: Sequence[list[tuple[int, float]]],
           num_micro_batches: int) -> tuple[float, dict[int, int]] | None:
    """The least power of one tier per pipeline that covers the batch: a DP over pipelines, the
    state being the micro-batches covered so far (capped at the batch)."""
    size = num_micro_batches + 1
    least = np.full(size, np.inf)
    least[0] = 0.0
    trail = []
    for kind, rows in zip(kinds, tiers):
        for d in kind.members:
            nxt, took, came = np.full(size, np.inf), np.zeros(size, dtype=np.int64), np.zeros(size, dtype=np.int64)
            for m, v in rows:
                # Covered c -> c + m, those past the batch all to the batch.
                reach = least[:size - m] + v
                better = reach < nxt[m:]
                nxt[m:][better], took[m:][better] = reach[better], m
                came[m:][better] = np.flatnonzero(better)
                over = least[size - m:] + v
                j = int(np.argmin(over))
                if over[j] < nxt[-1]:
                    nxt[-1], took[-1], came[-1] = over[j], m, size - m + j
            least = nxt
            trail.append((d, took, came))
    if not math.isfinite(least[-1]):
        return None
    caps, at = {}, num_micro_batches
    for d, took, came in reversed(trail):
        caps[d], at = int(took[at]), int(came[at])
    return float(least[-1]), caps


def _greedy(kinds: Sequence[_Kind], tiers: Sequence[list[tuple[int, float]]],
            num_micro_batches: int) -> tuple[float, dict[int, int]] | None:
    """The LP relaxation's greedy (module docstring): cheapest tier first, then hull upgrades by
    watts per micro-batch, a kind's pipelines as one batch, the last batch cut to what is needed."""
    need, power, hulls, events = num_micro_batches, 0.0, [], []
    for k, (kind, rows) in enumerate(zip(kinds, tiers)):
        need -= len(kind.members) * rows[0][0]
        power += len(kind.members) * rows[0][1]
        hull = _lower_hull(rows)
        hulls.append(hull)
        events += [((v1 - v0) / (m1 - m0), k, j) for j, ((m0, v0), (m1, v1)) in enumerate(zip(hull, hull[1:]))]
    at = [[len(kind.members)] + [0] * (len(h) - 1) for kind, h in zip(kinds, hulls)]
    for _, k, j in sorted(events):
        if need <= 0:
            break
        (m0, v0), (m1, v1) = hulls[k][j], hulls[k][j + 1]
        moved = min(at[k][j], -(-need // (m1 - m0)))
        at[k][j] -= moved
        at[k][j + 1] += moved
        need -= moved * (m1 - m0)
        power += moved * (v1 - v0)
    if need > 0:
        return None
    caps = {}
    for kind, hull, counts in zip(kinds, hulls, at):
        members = iter(kind.members)
        for (m, _), n in zip(hull, counts):
            for _ in range(n):
                caps[next(members)] = m
    return power, caps


def _lower_hull(points: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    hull: list[tuple[int, float]] = []
    for p in points:
        while len(hull) >= 2 and ((hull[-1][0] - hull[-2][0]) * (p[1] - hull[-2][1])
                                  - (hull[-1][1] - hull[-2][1]) * (p[0] - hull[-2][0])) <= 0:
            hull.pop()
        hull.append(p)
    return hull


def _balanced_step(stage_s: Sequence[Sequence[float]], num_micro_batches: int, speed: float) -> float:
    """Every stage at the level of ``speed``, the micro-batches balanced: the step."""
    times = [[t / speed for t in p] for p in stage_s]
    mbs = microbatches.balance(num_micro_batches, [max(p) for p in times], [len(p) for p in times],
                               [sum(p) - max(p) for p in times])
    return max(pipeline_s(p, len(m)) for p, m in zip(times, mbs))


def _build(stage_s: Sequence[Sequence[float]], kinds: Sequence[_Kind], options: Sequence[_Options],
           num_micro_batches: int, caps: dict[int, int], step_s: float, levels: Sequence[float],
           model: PowerModel) -> FrequencyPlan:
    """Fill the micro-batches up to each pipeline's tier (each next one where it finishes soonest,
    ties to the lower index), then give every pipeline its cheapest option for the resulting step."""
    of = {d: o for k, o in zip(kinds, options) for d in k.members}
    picked: dict[tuple, int] = {}  # at 10^5 devices most pipelines are alike

    def pick(d: int, m: int, within_s: float) -> int:
        key = (id(of[d]), m, within_s)
        if key not in picked:
            picked[key] = of[d].cheapest(m, within_s)
        return picked[key]

    tier = [pick(d, caps[d], step_s) for d in range(len(stage_s))]
    total = [float(of[d].total[k]) for d, k in enumerate(tier)]
    peak = [float(of[d].peak[k]) for d, k in enumerate(tier)]
    counts = [1] * len(stage_s)
    heap = [(total[d] + peak[d], d) for d in range(len(stage_s)) if caps[d] > 1]
    heapq.heapify(heap)
    for _ in range(num_micro_batches - len(counts)):
        _, d = heapq.heappop(heap)
        counts[d] += 1
        if counts[d] < caps[d]:
            heapq.heappush(heap, (total[d] + counts[d] * peak[d], d))
    within = max(t + (m - 1) * x for t, x, m in zip(total, peak, counts))
    freqs = tuple(of[d].stage_levels(pick(d, m, within), p) for d, (p, m) in enumerate(zip(stage_s, counts)))
    step = max(pipeline_s([t / model.speed(f) for t, f in zip(p, fs)], m) for p, fs, m in zip(stage_s, freqs, counts))
    mbs, start = [], 0
    for c in counts:
        mbs.append(tuple(range(start, start + c)))
        start += c
    power = sum(model.power(f) for fs in freqs for f in fs)
    return FrequencyPlan(freqs, tuple(mbs), step, step * power)


def nominal_plan(stage_s: Sequence[Sequence[float]], num_micro_batches: int,
                 model: PowerModel = PowerModel()) -> FrequencyPlan:
    """The same micro-batch balance with every device left at nominal frequency (1.0): the
    baseline a frequency plan is compared with."""
    mbs = microbatches.balance(num_micro_batches, [max(p) for p in stage_s], [len(p) for p in stage_s],
                               [sum(p) - max(p) for p in stage_s])
    step = max(pipeline_s(p, len(m)) for m, p in zip(mbs, stage_s))
    levels = tuple(tuple(1.0 for _ in p) for p in stage_s)
    return FrequencyPlan(levels, tuple(mbs), step, step * model.power(1.0) * sum(len(p) for p in stage_s))
