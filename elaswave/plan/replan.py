"""Re-planning when the membership changes: the plan for survivors of a loss and ranks joining, by
elaswave's policy or a baseline's (a pure function of the last plan and what changed).

Every rank computes the same plan from the same inputs; nothing here touches a process group.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

from elaswave.plan.chunks import reassign_owners, rebalance_owners
from elaswave.plan.deal import deal, detoured_step_s, step_s
from elaswave.plan.detours import covers, detour_routes
from elaswave.plan.errors import PlanError
from elaswave.plan.experts import place_holders
from elaswave.plan.frequency import PowerModel
from elaswave.plan.limit import limit_refusal, over_limit
from elaswave.plan.memory import by_cost
from elaswave.plan.partition import PartitionError
from elaswave.plan.plan import Plan
from elaswave.plan.rates import (priced_detoured_s, priced_step_s, range_cost, rank_rates, recompute_cost, split_factor,
                                 stage_times, timing)
from elaswave.plan.recompute import fit_recomputation
from elaswave.plan.resplit import place_joiners, split


def replan(prev: Plan, live: Sequence[int], epoch: int, num_micro_batches: int,
           speeds: Mapping[int, float] | None = None, policy: str = "elaswave",
           power: PowerModel | None = None, power_cap_w: float | None = None, detours: bool = True,
           rebalance: bool = False, schedule: str = "1f1b") -> Plan:
    """The plan for the ranks ``live``: survivors of ``prev`` and ranks joining now.

    elaswave: a pipeline that lost stages goes on with its survivors (in stage order) as a shorter
    pipeline, its layers re-partitioned over them (minimax on the layer costs); the global batch
    stays ``num_micro_batches``, spread over the pipelines by predicted step time, and with a
    ``power`` model each stage gets a frequency level (raise the bottleneck, slow what would wait)
    within ``power_cap_w``. When the survivors left in place with their micro-batches on detours
    (below) are predicted to be faster, that plan is taken instead (see :func:`_elaswave`; not
    with ``detours=False``).
    The baselines leave a broken pipeline's survivors where they were:
    drop_replica (TorchFT): its micro-batches are skipped and its survivors stand idle;
    reroute (ReCycle): its micro-batches keep their ids, and pass through the same stage of the
    complete pipelines (in turn) wherever their own stage is gone.

    Joining ranks (elaswave only) first fill pipelines that lost stages, back up to ``prev.depth``:
    where the survivors kept their stages of the whole layout (detours) the joiners take the
    missing ones, otherwise the pipeline is re-partitioned over survivors and joiners. The rest
    form new pipelines of ``depth`` stages (the last one shorter); micro-batches are then balanced
    over all pipelines as after a loss, and ZeRO chunks are evened out within each holder group a
    joiner is in.

    ``rebalance`` (elaswave): re-partition every pipeline by its ranks' measured speeds, so a slow
    rank (a straggler) gets fewer layers and its pipeline fewer micro-batches; see
    :func:`~elaswave.plan.rebalance.rebalance_gain`.

    ``speeds``: micro-batches per second each rank measured on its current stage, at its current
    frequency level (a joiner has none: it counts as the median rank). ``schedule``: the
    pipelines' (parallel.schedule), by whose timing a re-partition is weighed against detours."""
    live = tuple(sorted(live))
    if not live:
        raise PlanError(f"epoch {epoch}: no rank is left")
    alive, known = set(live), set(prev.ranks)
    joined = tuple(r for r in live if r not in known)
    if joined and policy != "elaswave":
        raise PlanError(f"epoch {epoch}: ranks {list(joined)} cannot join under elastic.policy={policy}, "
                        "which keeps the layout it lost ranks from; elastic.policy=elaswave re-plans for joins")
    pipelines, kept_ranges, kept = [], [], []
    for d, pipe in enumerate(prev.pipelines):
        survivors = tuple(r for r in pipe if r in alive)
        if survivors:
            pipelines.append(survivors)
            kept_ranges.append(tuple(rng for k, rng in enumerate(prev.layer_ranges[d]) if pipe[k % len(pipe)] in alive))
            kept.append(d)
    if joined:
        place_joiners(prev, epoch, joined, pipelines, kept_ranges, kept)
    teams = _teams(prev, kept)
    if num_micro_batches < len(pipelines):
        raise PlanError(f"epoch {epoch}: {num_micro_batches} micro-batches cannot feed {len(pipelines)} pipelines")
    if policy == "elaswave":
        return _elaswave(prev, epoch, pipelines, kept_ranges, kept, num_micro_batches, speeds or {}, power,
                         power_cap_w, detours and not rebalance, rebalance, schedule, teams)
    complete = [covers(rng, prev.num_layers) for rng in kept_ranges]
    if not any(complete):
        raise PlanError(f"epoch {epoch}: elastic.policy={policy} needs a pipeline that still holds every layer, "
                        f"and none does (survivors {list(live)}); elastic.policy=elaswave re-partitions instead")
    if policy == "drop_replica":
        # TorchFT keeps expert parallelism inside a replica group: a lost rank takes its whole
        # expert-parallel group's pipelines out with it (they cannot compute its experts).
        gone = {d for d, pipe in enumerate(prev.pipelines) if not alive.issuperset(pipe)}
        if prev.expert_holders:
            gone |= {prev.position(m)[0] for d in set(gone) for r in prev.pipelines[d] for m in prev.expert_group[r]}
        if not any(ok and d not in gone and prev.micro_batches[d] for d, ok in zip(kept, complete)):
            raise PlanError(f"epoch {epoch}: elastic.policy={policy} drops the expert-parallel groups of ranks "
                            f"{sorted(set(prev.ranks) - alive)}, and none is left")
        return _build(prev, epoch, pipelines, kept_ranges,
                      tuple(prev.micro_batches[d] if ok and d not in gone else () for d, ok in zip(kept, complete)),
                      teams=teams, standing_keep=False)
    mbs = tuple(prev.micro_batches[d] for d in kept)
    return _build(prev, epoch, pipelines, kept_ranges, mbs,
                  routes=detour_routes(prev, pipelines, kept_ranges, complete, mbs, epoch), teams=teams)


def _teams(prev: Plan, kept: Sequence[int | None]) -> tuple[int, ...]:
    """Each pipeline's expert-parallel team: its own in ``prev`` (``kept``: its index there); a new
    pipeline (None) fills a team that lost pipelines, the lowest first, then new teams of ``ep``
    (empty without expert parallelism)."""
    if prev.ep <= 1:
        return ()
    out = [prev.team(d) if d is not None else -1 for d in kept]
    size: dict[int, int] = {}
    for t in out:
        if t >= 0:
            size[t] = size.get(t, 0) + 1
    short = [t for t in sorted({prev.team(d) for d in range(len(prev.pipelines))}) for _ in range(prev.ep - size.get(t, 0))]
    fresh, new = 1 + max((prev.team(d) for d in range(len(prev.pipelines))), default=-1), 0
    for i in (i for i, t in enumerate(out) if t < 0):
        if short:
            out[i] = short.pop(0)
        else:
            out[i], new = fresh + new // prev.ep, new + 1
    return tuple(out)


def _build(prev: Plan, epoch: int, pipelines, ranges, mbs, freqs=(), routes=(), units=None, solver="",
           check: bool = True, teams: tuple[int, ...] = (), standing_keep: bool = True) -> Plan:
    """``units``: each micro-batch id's units (None: ``prev``'s, whose ids ``mbs`` then are);
    ``check``: refuse an interleaved plan over the memory limit (else the caller decides);
    ``teams``: each pipeline's expert-parallel team (:func:`_teams`); ``standing_keep``: a pipeline
    that runs nothing keeps the experts it held (plan/experts.place_holders)."""
    plan = Plan(epoch=epoch, num_layers=prev.num_layers, pipelines=tuple(pipelines), layer_ranges=tuple(ranges),
                micro_batches=tuple(mbs), layer_costs=prev.layer_costs, frequencies=tuple(freqs), routes=tuple(routes),
                layer_memory=prev.layer_memory, stage_memory_limit=prev.stage_memory_limit, memory=prev.memory,
                depth=prev.depth, ties=prev.ties, ranks_per_node=prev.ranks_per_node, snapshot_copies=prev.snapshot_copies,
                units_per_micro_batch=prev.units_per_micro_batch,
                micro_batch_units=prev.micro_batch_units if units is None else tuple(units),
                frequency_solver=solver if freqs else "", virtual_stages=prev.virtual_stages,
                bucket_starts=prev.bucket_starts, unit_layers=prev.unit_layers, ep=prev.ep,
                expert_loads=prev.expert_loads, teams=tuple(teams), expert_map=prev.expert_map)
    if prev.expert_holders:
        plan = replace(plan, expert_holders=place_holders(plan, prev.expert_holders, prev.expert_loads,
                                                          static=prev.expert_map == "static", standing_keep=standing_keep))
    owners = reassign_owners(prev.chunk_owners, plan.gradient_buckets())
    joined = set(plan.ranks) - set(prev.ranks)
    if joined:
        owners = rebalance_owners(owners, plan.gradient_buckets(), joined)
    plan = fit_recomputation(replace(plan, chunk_owners=owners))
    if check and (why := limit_refusal(plan)):
        raise PlanError(f"epoch {epoch}: {why}")
    return plan


def _elaswave(prev: Plan, epoch: int, pipelines, kept_ranges, kept, num_micro_batches: int,
              speeds: Mapping[int, float], power: PowerModel | None, power_cap_w: float | None,
              detours: bool, rebalance: bool = False, schedule: str = "1f1b", teams: tuple[int, ...] = ()) -> Plan:
    """Re-partition every pipeline that no longer holds every layer, balance (and plan frequencies);
    or, when predicted faster, stand its survivors by, or leave them in place and send its
    micro-batches through the complete pipelines' same stage (detours), which win where many pipelines
    share the loss: a re-split pipeline's bottleneck is a layer heavier, so other pipelines take a whole
    micro-batch more each (+1/(m+S-1) of the step), while a host absorbs one guest."""
    rate = rank_rates(prev, speeds, [r for p in pipelines for r in p], power)
    ranges, standby, why = [], [], []
    for d, survivors, rng in zip(kept, pipelines, kept_ranges):
        if covers(rng, prev.num_layers) and not rebalance:
            ranges.append(rng)
            continue
        try:
            ranges.append(split(prev, len(survivors), len(pipelines), num_micro_batches,
                                [rate[r] for r in survivors] if rebalance else None))
        except PartitionError as exc:
            # Survivors that cannot hold the model stand by: they keep their layers and ZeRO chunks,
            # get no micro-batches (the others take them: the batch is kept), and a join completes them.
            ranges.append(rng)
            if not covers(rng, prev.num_layers):
                standby.append(len(ranges) - 1)
                which = f"pipeline {d} is left with" if d is not None else "a new pipeline has"
                why.append(f"{which} ranks {list(survivors)}: {exc}")

    extra: dict[int, float] = {}  # each rank's recomputation, in layer cost, as the last plan built chose it
    timed = lambda d: step_s(d[6], d[4], d[5], *timing(schedule, prev.virtual_stages))  # noqa: E731 (a deal's step)
    nominal_ok = power is None or power_cap_w is None or power.power(1.0) * sum(map(len, pipelines)) <= power_cap_w * (1 + 1e-9)

    def dealt(levels: bool = True):
        run = [i for i in range(len(pipelines)) if i not in standby]
        if not run:
            raise PlanError(f"epoch {epoch}: no pipeline can hold the model: {'; '.join(why)}")
        if len(run) > num_micro_batches:
            raise PlanError(f"epoch {epoch}: {num_micro_batches} micro-batches cannot feed {len(run)} pipelines")
        stage_s = [stage_times(prev, pipelines[k], ranges[k], rate, extra) for k in run]
        mbs, freqs, units, sizes, at_levels, solver = deal(stage_s, num_micro_batches, prev.units_per_micro_batch,
                                                            power if levels else None, power_cap_w)
        run_mbs = mbs
        if standby:
            at = dict(zip(run, range(len(run))))
            mbs = tuple(mbs[at[k]] if k in at else () for k in range(len(pipelines)))
            freqs = tuple(freqs[at[k]] if k in at else (1.0,) * len(pipelines[k]) for k in range(len(pipelines))) if freqs else ()
        return mbs, freqs, units, solver, run_mbs, sizes, at_levels

    def settled():
        """The deal and its plan, dealt and built again with the recomputation that plan chose counted."""
        extra.clear()
        for _ in range(2):
            d = dealt()
            built = _build(prev, epoch, pipelines, ranges, d[0], d[1], units=d[2], solver=d[3], check=False, teams=teams)
            # The clock planner times 1F1B: levels the schedule's own timing finds slower give way to
            # nominal -- under interleaved 1F1B each chunk priced alone with what it recomputes (its
            # rank's chunks as even shares read levels as no slower that were: 0.929 against 0.934).
            if d[1] and nominal_ok:
                n = dealt(False)
                if prev.virtual_stages > 1:
                    plain = _build(prev, epoch, pipelines, ranges, n[0], n[1], units=n[2], solver=n[3], check=False,
                                   teams=teams)
                    at_levels = {r: rate[r] * power.speed(built.frequency(r)) for r in built.ranks}
                    if priced_step_s(plain, rate, schedule) < priced_step_s(built, at_levels, schedule) * (1 - 1e-3):
                        d, built = n, plain
                elif timed(n) < timed(d) * (1 - 1e-3):
                    d, built = n, _build(prev, epoch, pipelines, ranges, n[0], n[1], units=n[2], solver=n[3],
                                         check=False, teams=teams)
            if not built.recomputed or extra:
                break
            extra.update(recompute_cost(built, schedule))
        return d, built
    (mbs, freqs, units, solver, run_mbs, sizes, at_levels), built = settled()
    # Or the re-split pipelines stand by, as a restart on whole pipelines would leave them: faster where a
    # re-split rank holds a layer more than its peers (and recomputes more) while the lost share of the batch
    # is a micro-batch or two over many pipelines (Llama 3 405B at 16,384 GPUs). Priced by plan.rates.
    resplit = [i for i, pipe in enumerate(pipelines) if i not in standby and ranges[i] is not kept_ranges[i]
               and not covers(kept_ranges[i], prev.num_layers)]
    if resplit and len(resplit) + len(standby) < len(pipelines):
        chosen = list(ranges), list(standby), (mbs, freqs, units, solver, run_mbs, sizes, at_levels), built, dict(extra)
        for i in resplit:
            ranges[i] = kept_ranges[i]
        standby.extend(resplit)
        (mbs, freqs, units, solver, run_mbs, sizes, at_levels), built = settled()
        if limit_refusal(built) or not priced_step_s(built, rate, schedule) < priced_step_s(chosen[3], rate, schedule) * (1 - 1e-3):
            ranges[:], standby[:], (mbs, freqs, units, solver, run_mbs, sizes, at_levels), built, kept_extra = chosen
            extra.clear()
            extra.update(kept_extra)
    complete = [covers(rng, prev.num_layers) for rng in kept_ranges]
    # (Detours between interleaved pipelines of experts held across ranks: not tested, not taken.)
    if detours and (prev.virtual_stages == 1 or not prev.expert_holders) and any(complete) and not all(complete):
        kept_mbs = tuple(prev.micro_batches[d] if d is not None else () for d in kept)
        try:
            routes = detour_routes(prev, pipelines, kept_ranges, complete, kept_mbs, epoch)
        except PlanError:
            routes = None
        if routes is not None and sum(map(len, kept_mbs)) == num_micro_batches:
            detoured = _build(prev, epoch, pipelines, kept_ranges, kept_mbs, routes=routes, teams=teams, check=False)
            # Priced with what it recomputes itself: a host keeps its guests' activations too, and may
            # recompute more to fit them.
            if prev.virtual_stages > 1:  # each chunk timed as the simulator times it, both plans alike
                price, other = priced_detoured_s(detoured, rate), priced_step_s(built, rate, schedule)
            else:
                own = recompute_cost(detoured, schedule)
                cost = {r: range_cost(prev, i, j) for pipe, rng in zip(pipelines, kept_ranges) for r, (i, j) in zip(pipe, rng)}
                forward = {r: (c + own.get(r, 0.0)) / rate[r] for r, c in cost.items()}
                price = detoured_step_s(pipelines, kept_mbs, routes, forward, schedule=schedule,
                                        backward_factor=split_factor(cost, own))
                theirs = {r: range_cost(built, i, j) for pipe, rng in zip(built.pipelines, built.layer_ranges)
                         for r, (i, j) in zip(pipe, rng)}
                other = step_s(at_levels, run_mbs, sizes, schedule, backward_factor=split_factor(theirs, extra))
            if not limit_refusal(detoured) and price < other * (1 - 1e-3):
                return detoured
    plan = built
    # A partition by cost (interleaved, or recomputing to fit): a re-split pipeline over the limit stands
    # by, as one that no partition fits does (its survivors keep their layers; the others take its batch).
    # With experts held by their owners a pipeline alone in its expert-parallel groups (a re-split one)
    # holds every expert of its layers, and one in a smaller group than ``ep`` (its team lost pipelines)
    # a larger share of them: over the limit it stands by too, keeping only the experts it held
    # (plan/experts.py), the whole team if need be (the batch is kept by the other teams, whose
    # groups are untouched).
    def over_now() -> list[int]:
        ranks = set(over_limit(plan))
        return [i for i, pipe in enumerate(pipelines) if i not in standby and set(pipe) & ranks and (
            ranges[i] is not kept_ranges[i] and not covers(kept_ranges[i], prev.num_layers)
            or prev.expert_holders and len(plan.expert_group[pipe[0]]) < prev.ep)]
    while over := over_now():
        for i in over:
            ranges[i] = kept_ranges[i]
            standby.append(i)
            held = (f"as {prev.virtual_stages} interleaved chunks each" if prev.virtual_stages > 1 else
                    "recomputing every block" if by_cost(1, prev.memory) else "of their layers' experts, their groups short of parallel.ep")
            why.append(f"ranks {list(pipelines[i])} hold too much {held}")
        _, plan = settled()
    if refusal := limit_refusal(plan):  # an intact pipeline over the limit: nothing stands it by
        raise PlanError(f"epoch {epoch}: {refusal}")
    return plan
