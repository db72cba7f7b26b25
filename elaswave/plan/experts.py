"""Where each expert of a mixture-of-experts block computes and is held: its expert-parallel group
and owner (pure functions, no process groups).

The first plan lays pipelines out in teams of ``ep`` (:func:`team_layout`): a team's stage-``s``
ranks are consecutive, so on hosts of ``ep`` or more ranks each all-to-all stays inside one host
(Megatron orders expert parallelism inside data parallelism for the same reason); its pipeline
sends cross hosts instead, a micro-batch's activation once per stage, where every MoE block
exchanges its tokens twice each way. A stage's expert-parallel group is the stage's ranks of a
team's pipelines that run the same layers by stage (a re-split pipeline runs others: it is a group
of its own), and teams are kept through losses and joins, so a loss leaves the other groups as they
were. Members dealt fewer micro-batches than their group's others run *ghost* micro-batches after
theirs (:func:`ghost_counts`): no rows of their own, no messages down their pipeline, but every
exchange of the group, where they still compute their experts on the others' rows. Every member of
a group must issue the same exchanges in the same order, and with ghosts all run one schedule.

Within a group every expert of a block has one owner, which runs it on the tokens every member
routes to it (all-to-all) and holds it: an expert's holders are its owners, one in each group of
its stage (model/units.py), so a rank holds only ``1/ep`` of its experts' values, sums and
optimizer state. A rank whose pipeline reroutes, reshapes or runs no micro-batch exchanges nothing.

Placement is the minimax of the planner's layers applied to experts: each expert, heaviest first,
goes to the member with the least load so far (longest processing time first), by the router's
measured counts; without counts (the first epoch), experts are dealt in contiguous blocks,
Megatron's and DeepSpeed's layout. A re-plan keeps every expert where a member of its group
already holds it and places only the others (a lost owner's; a new group's) by load, so as little
as possible moves. The placement changes which rank computes an expert, never what it computes:
the bits do not depend on it.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence


def team_layout(dp: int, pp: int, ep: int) -> tuple[tuple[int, ...], ...]:
    """The first plan's pipelines: rank ``d * pp + s`` is stage ``s`` of pipeline ``d`` (a
    pipeline's stages neighbours), or with ``ep`` > 1 dividing ``dp``, rank
    ``((d // ep) * pp + s) * ep + d % ep``: a team of ``ep`` pipelines takes ``ep * pp`` consecutive
    ranks, each stage's ``ep`` of them side by side (its expert-parallel group, inside a host)."""
    g = ep if ep > 1 and dp % ep == 0 else 1
    return tuple(tuple(((d // g) * pp + s) * g + d % g for s in range(pp)) for d in range(dp))


def groups_of(pipelines: Sequence[int], ep: int) -> list[tuple[int, ...]]:
    """The expert-parallel groups of a stage: its pipelines in order, ``ep`` at a time."""
    if ep < 1:
        raise ValueError(f"parallel.ep={ep} must be >= 1")
    ordered = sorted(pipelines)
    return [tuple(ordered[i:i + ep]) for i in range(0, len(ordered), ep)]


def contiguous(num_experts: int, members: int) -> tuple[int, ...]:
    """Expert e -> the index of its owner among ``members``: blocks of consecutive experts, the
    first ``num_experts % members`` blocks one longer."""
    base, extra = divmod(num_experts, members)
    owners: list[int] = []
    for m in range(members):
        owners += [m] * (base + (m < extra))
    return tuple(owners)


def by_load(loads: Sequence[float], members: int) -> tuple[int, ...]:
    """Expert e -> the index of its owner among ``members``, minimising the busiest member's load:
    heaviest expert first, each to the member with the least load so far (ties: fewer experts,
    then the lower index), so every rank computes the same placement from the same counts."""
    owners = [0] * len(loads)
    total = [0.0] * members
    count = [0] * members
    for e in sorted(range(len(loads)), key=lambda e: (-loads[e], e)):
        m = min(range(members), key=lambda m: (total[m], count[m], m))
        owners[e] = m
        total[m] += loads[e]
        count[m] += 1
    return tuple(owners)


def place(num_experts: int, members: int, loads: Sequence[float] | None = None) -> tuple[int, ...]:
    """Expert -> owner index among ``members``: by the measured ``loads`` where some expert has
    one, else contiguous blocks."""
    if loads is not None and len(loads) != num_experts:
        raise ValueError(f"{len(loads)} expert loads for {num_experts} experts")
    if members == 1:
        return (0,) * num_experts
    if loads is None or not any(loads):
        return contiguous(num_experts, members)
    return by_load(loads, members)


def busiest_share(owners: Sequence[int], loads: Sequence[float], members: int) -> float:
    """The busiest member's share of the load over an even share (1.0: perfectly balanced)."""
    total = sum(loads)
    if not total:
        return 1.0
    per = [0.0] * members
    for e, m in enumerate(owners):
        per[m] += loads[e]
    return max(per) * members / total


def _schedule_of(plan, p: int) -> tuple:
    """What decides which pipelines exchange: their team and layers by stage (their micro-batch
    counts are evened by ghosts; the blocks they recompute made alike: :func:`unite_recomputation`)."""
    return plan.team(p), plan.layer_ranges[p]


def pipeline_groups(plan) -> list[tuple[int, ...]]:
    """The pipelines whose stages exchange together, each a tuple (one alone where ``plan.ep`` is 1,
    the plan reroutes or reshapes, or it runs no micro-batch)."""
    alone = plan.ep <= 1 or bool(plan.routes) or plan.units_per_micro_batch > 1
    out: list[tuple[int, ...]] = []
    by_schedule: dict[tuple, list[int]] = {}
    for p in range(len(plan.pipelines)):
        if alone or not plan.micro_batches[p]:
            out.append((p,))
        else:
            by_schedule.setdefault(_schedule_of(plan, p), []).append(p)
    for alike in by_schedule.values():
        out += groups_of(alike, plan.ep)
    return out


def expert_groups(plan) -> dict[int, tuple[int, ...]]:
    """Each rank -> the ranks of its expert-parallel group under ``plan`` (itself alone where its
    pipeline exchanges with none: :func:`pipeline_groups`)."""
    out: dict[int, tuple[int, ...]] = {}
    for group in pipeline_groups(plan):
        for s in range(len(plan.pipelines[group[0]])):
            members = tuple(plan.pipelines[p][s] for p in group)
            out.update({r: members for r in members})
    return out


def ghost_counts(plan) -> tuple[int, ...]:
    """Each pipeline's ghost micro-batches: how many fewer it runs than the most its group's run."""
    out = [0] * len(plan.pipelines)
    for group in pipeline_groups(plan):
        most = max(len(plan.micro_batches[p]) for p in group)
        for p in group:
            out[p] = most - len(plan.micro_batches[p])
    return tuple(out)


def place_holders(plan, prev_holders: Sequence[Sequence[int]] | None, loads: Sequence[float] = (),
                  static: bool = False, standing_keep: bool = True) -> tuple[tuple[int, ...], ...]:
    """Each expert unit's holders under ``plan`` (``plan.unit_layers``: their layers): its owner in
    every group of the ranks that hold its layer and run micro-batches, and a rank of a pipeline
    standing by wherever it held it in ``prev_holders``: such a rank computes nothing, but its
    experts' values and optimizer state stay where they are (its group's others take the orphans
    of a lost member, and no holder group shrinks, which would give each survivor a larger share of
    the state); a rank standing by that held none of a layer's experts takes none, unless no other
    rank holds the layer. An expert stays
    with a member that held it in ``prev_holders`` (the last plan's; None: a first plan), the
    lowest such rank; the others are placed by ``loads`` (tokens routed to each expert unit; empty
    or all zero: contiguous blocks in a first plan, else the fewest experts) among the members, a
    block's at a time, and then moved while that lowers the busiest member's load (a joiner
    takes its share). ``static`` (the static-expert-map baseline, ``Plan.expert_map``): the others
    all go to the group's first member, its backup, and nothing moves by load. Without
    ``standing_keep`` (the drop_replica baseline: TorchFT's dropped replica group is out, its state
    too) a pipeline that runs nothing holds no expert."""
    groups = expert_groups(plan)
    by_layer = {layer: [u - plan.num_layers for u in us] for layer, us in plan.experts_of_layer.items()}
    holders: list[set[int]] = [set() for _ in plan.unit_layers]
    done: set[tuple[int, ...]] = set()
    for rank in plan.ranks:
        group = groups[rank]
        if group in done or not plan.micro_batches[plan.position(rank)[0]]:
            continue
        done.add(group)
        layers = {i for start, end in plan.chunk_ranges(rank) for i in range(start, end)}
        for layer in sorted(layers & by_layer.keys()):
            ks = by_layer[layer]
            weights = [loads[k] for k in ks] if loads else []
            if prev_holders is None:
                owners = place(len(ks), len(group), weights if any(weights) else None)
            else:
                owners = _keep_and_place([[m for m in group if m in prev_holders[k]] for k in ks], group, weights,
                                         static)
            for k, m in zip(ks, owners):
                holders[k].add(group[m])
    standing = {r for d, pipe in enumerate(plan.pipelines) if not plan.micro_batches[d] and standing_keep for r in pipe}
    for k, layer in enumerate(plan.unit_layers):
        if prev_holders is not None:
            holders[k].update(r for r in prev_holders[k] if r in standing and r in plan.holders(layer))
        if not holders[k]:  # (every pipeline holding it stands by, and the one that held it is lost)
            holders[k].update(plan.holders(layer))
    return tuple(tuple(sorted(h)) for h in holders)


def _keep_and_place(held: Sequence[Sequence[int]], group: Sequence[int], weights: Sequence[float],
                    static: bool = False) -> list[int]:
    """Expert -> owner index in ``group``: the lowest member already holding it (``held``), else
    the member least loaded so far, heaviest orphan first (by ``weights``; without any: one each,
    so by count); then, while moving one of the busiest member's experts to the least loaded
    lowers the busier of the two, the move that lowers it most (one the receiver held before,
    then the last expert): a joiner gets its share, a load-balanced placement stays."""
    n, w = len(group), [float(x) for x in weights] if any(weights) else [1.0] * len(held)
    owners = [group.index(min(h)) if h else -1 for h in held]
    if static:  # (the baseline: a fixed backup, the first member, takes every orphan)
        return [0 if m < 0 else m for m in owners]
    load, count = [0.0] * n, [0] * n
    for e, m in enumerate(owners):
        if m >= 0:
            load[m] += w[e]
            count[m] += 1
    for e in sorted((e for e, m in enumerate(owners) if m < 0), key=lambda e: (-w[e], e)):
        m = min(range(n), key=lambda m: (load[m], count[m], m))
        owners[e] = m
        load[m] += w[e]
        count[m] += 1
    for _ in range(len(held) * n):  # (each move lowers the sum of squared loads: it ends)
        src = max(range(n), key=lambda m: (load[m], count[m], -m))
        dst = min(range(n), key=lambda m: (load[m], count[m], m))
        if src == dst:
            break
        e = min((e for e, m in enumerate(owners) if m == src),
                key=lambda e: (max(load[src] - w[e], load[dst] + w[e]), group[dst] not in held[e], -e))
        if not max(load[src] - w[e], load[dst] + w[e]) < load[src]:
            break
        owners[e] = dst
        load[src], load[dst] = load[src] - w[e], load[dst] + w[e]
        count[src], count[dst] = count[src] - 1, count[dst] + 1
    return owners


def owner_imbalance(plan) -> dict[tuple[tuple[int, ...], int], float]:
    """(group, layer) -> its busiest member's experts of the layer over an even share: what that
    member computes over a balanced placement's, a balanced router sending each expert as many
    tokens (every member waits for it in the combine). Plans with ``expert_holders`` only."""
    counts: dict[tuple[tuple[int, ...], int], dict[int, int]] = {}
    per_layer: dict[int, int] = {}
    groups = plan.expert_group
    for k, layer in enumerate(plan.unit_layers):
        per_layer[layer] = per_layer.get(layer, 0) + 1
        for h in plan.expert_holders[k] if plan.expert_holders else ():
            held = counts.setdefault((groups[h], layer), {})
            held[h] = held.get(h, 0) + 1
    return {key: max(held.values()) * len(key[0]) / per_layer[key[1]] for key, held in counts.items()}


def unite_recomputation(plan):
    """``plan`` with each expert-parallel group recomputing the union of its members' blocks: a
    recomputed MoE block runs its exchanges again in the backward, which every member must join
    (recomputing more only lowers memory)."""
    if plan.ep <= 1 or not plan.recomputed or not plan.unit_layers:
        return plan
    groups = expert_groups(plan)
    chosen = [list(pipe) for pipe in plan.recomputed]
    for d, pipe in enumerate(plan.pipelines):
        for s, rank in enumerate(pipe):
            union = set()
            for m in groups[rank]:
                e, t = plan.position(m)
                union.update(plan.recomputed[e][t])
            chosen[d][s] = tuple(sorted(union))
    return replace(plan, recomputed=tuple(tuple(p) for p in chosen))
