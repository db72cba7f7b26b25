"""Where this rank's mixture-of-experts blocks compute their experts in an epoch: all here, or
spread over an expert-parallel group of the stage's pipelines (``parallel.ep``, expert/exchange.py).

A group's members exchange tokens in every forward and backward of every MoE block, so they must
run the same schedule: the same layers, the same number of micro-batches (none reshaped), the
same blocks recomputed, no detours (the reroute baseline's routed schedule). Every rank decides
from the plan alone, so all members decide alike: groups are cut among the pipelines that run one
schedule, and a rank whose pipeline runs one nobody else does computes its experts locally this
epoch (the parameters are on every data-parallel rank), which gives the same bits. Placement is by the
router's counts over the last epoch, summed over the job (plan/experts.py).
"""
from __future__ import annotations

import torch

from elaswave.expert.exchange import AllToAll, Local
from elaswave.model.moe import SparseMoE, take_counts
from elaswave.plan.experts import busiest_share, groups_of, place


def moe_blocks(stage) -> list[tuple[object, SparseMoE]]:
    """(flat layer, block) for each MoE block this stage holds, in layer order."""
    return [(layer, m) for layer in stage.layers for m in layer.module.modules() if isinstance(m, SparseMoE)]


def _schedule_of(plan, p: int) -> tuple:
    """What decides pipeline ``p``'s schedule: its layers by stage, micro-batch count, recomputation."""
    return (plan.layer_ranges[p], len(plan.micro_batches[p]),
            tuple(tuple(sorted(r)) for r in plan.recomputed[p]) if plan.recomputed else ())


def group_of(plan, rank: int, ep: int) -> tuple[int, ...]:
    """The global ranks of ``rank``'s expert-parallel group this epoch: its stage's ranks in the
    pipelines that run its pipeline's schedule, ``ep`` pipelines at a time (after a loss that dealt
    3, 3 and 2 micro-batches, the two pipelines of 3 form a group); itself alone where none other
    does (see the module's docstring)."""
    d, s = plan.position(rank)
    if ep <= 1 or plan.routes or plan.units_per_micro_batch > 1 or not plan.micro_batches[d]:
        return (rank,)
    alike = [p for p in range(len(plan.pipelines)) if _schedule_of(plan, p) == _schedule_of(plan, d)]
    mine = next(g for g in groups_of(alike, ep) if d in g)
    return tuple(plan.pipelines[p][s] for p in mine)


def loads_of(world, held: list[SparseMoE], blocks: int, num_experts: int, device) -> torch.Tensor:
    """Every rank's tokens' routing counts since the last call, summed over the job: [blocks, E]
    (every rank takes part, those without an MoE block with zeros)."""
    mine = torch.zeros(blocks, num_experts, dtype=torch.float64)
    for block in held:
        mine[block.ordinal] += take_counts(block)
    total = mine.to(device)
    world.all_reduce(total, "expert loads")
    return total.cpu()


def attach(cfg, plan, rank: int, stage, accumulator, world, comm, device, built: dict) -> dict:
    """Set each MoE block's exchange for the epoch; returns what the step record says of it.
    ``built``: the epoch's holder groups by members (one with the same members serves)."""
    blocks = moe_blocks(stage)
    m = getattr(stage.model, "cfg", None)
    if not getattr(m, "num_experts", 0):
        return {"exchanges": [], "record": {}}
    ep = cfg.parallel.ep
    members = group_of(plan, rank, ep)
    loads = (loads_of(world, [b for _, b in blocks], m.moe_blocks_before(m.num_blocks),
                      m.num_experts, device) if ep > 1 else None)
    group = None
    if len(members) > 1:
        group = (world if members == world.members else built.get(members) or
                 comm.adopt(comm.build(members, plan.epoch, kind="experts"), members, plan.epoch))
    shares, exchanges = [], []
    for layer, block in blocks:
        fold = None
        if cfg.train.deterministic:  # each expert's gradient, one member's rows at a time, into its unit's sum
            units = [u.index for u in stage.followers[layer.index]]
            fold = lambda e, units=units: accumulator.fold_part(units[e])  # noqa: E731
        if group is None:
            block.exchange = Local(fold) if fold is not None else None
            continue
        counts = loads[block.ordinal].tolist()
        owners = place(m.num_experts, group.size, counts if any(counts) else None)
        block.exchange = AllToAll(group, owners, fold)
        block.exchange.clock = stage  # its waits are not the rank's compute (its measured speed)
        exchanges.append(block.exchange)
        if any(counts):
            shares.append(busiest_share(owners, counts, group.size))
    # The busiest member's share of the last epoch's tokens over an even share, by this placement.
    return {"exchanges": exchanges, "record": {"expert_group": list(members),
                                               "expert_busiest_share": max(shares) if shares else None}}
