"""Where this rank's mixture-of-experts blocks compute their experts in an epoch: all here, or
spread over an expert-parallel group of the stage's pipelines (``parallel.ep``, expert/exchange.py).

The plan decides both (plan/experts.py): the groups, cut among the pipelines that run one schedule
so that every member issues the same exchanges, and each expert's owner in each group, which alone
holds and computes it. A rank whose pipeline runs a schedule nobody else does is a group of its
own: it holds every expert of its layers and computes them here, which gives the same bits. The
router's counts of each epoch go into the reports of the recovery or join that ends it, and the
re-plan places experts by their sum (``Plan.expert_loads``, also the records' balance).
"""
from __future__ import annotations

from elaswave.expert.exchange import AllToAll, Local
from elaswave.model.moe import SparseMoE, take_counts
from elaswave.plan.experts import busiest_share


def moe_blocks(stage) -> list[tuple[object, SparseMoE]]:
    """(flat layer, block) for each MoE block this stage holds, in layer order."""
    return [(layer, m) for layer in stage.layers for m in layer.module.modules() if isinstance(m, SparseMoE)]


def counts_of(stage) -> list[float] | None:
    """The router's assignments to each expert unit (model/units.py order) by this rank's training
    forwards since the last call, its own blocks' (zeros elsewhere); None without experts. Each
    rank posts them in a recovery's report, and the re-plan places experts by their sum."""
    blocks = moe_blocks(stage)
    m = getattr(stage.model, "cfg", None)
    if not getattr(m, "num_experts", 0):
        return None
    out = [0.0] * len(stage.units.experts)
    for layer, block in blocks:
        first = stage.units.of_layer(layer.index)[1] - stage.units.num_layers
        for e, n in enumerate(take_counts(block).tolist()):
            out[first + e] += n
    return out


def attach(cfg, plan, rank: int, stage, accumulator, world, comm, built: dict) -> dict:
    """Set each MoE block's exchange for the epoch; returns what the step record says of it.
    ``built``: the epoch's holder groups by members (one with the same members serves)."""
    blocks = moe_blocks(stage)
    m = getattr(stage.model, "cfg", None)
    if not getattr(m, "num_experts", 0):
        return {"exchanges": [], "record": {}}
    members = plan.expert_group[rank]
    group = None
    if len(members) > 1:
        group = (world if members == world.members else built.get(members) or
                 comm.adopt(comm.build(members, plan.epoch, kind="experts"), members, plan.epoch))
    shares, exchanges = [], []
    for layer, block in blocks:
        units = stage.units.of_layer(layer.index)[1:]  # expert e's (this rank folds and runs only its own)
        fold = None
        if cfg.train.deterministic:  # each expert's gradient, one member's rows at a time, into its unit's sum
            fold = lambda e, units=units: accumulator.fold_part(units[e])  # noqa: E731
        if group is None:
            block.exchange = Local(fold) if fold is not None else None
            continue
        # Each expert's owner in this group: its one holder here (the plan placed it: plan/experts.py).
        owners = [group.members.index(next(r for r in plan.holders(u) if r in members)) for u in units]
        counts = [plan.expert_loads[u - plan.num_layers] for u in units] if plan.expert_loads else [0.0]
        block.exchange = AllToAll(group, owners, fold)
        block.exchange.clock = stage  # its waits are not the rank's compute (its measured speed)
        exchanges.append(block.exchange)
        if any(counts):
            shares.append(busiest_share(owners, counts, group.size))
    # The busiest member's share of the last epoch's tokens (the plan's loads) over an even share;
    # the ghost micro-batches each pipeline runs to match its group (plan/experts.py).
    return {"exchanges": exchanges,
            "record": {"expert_group": list(members), "expert_busiest_share": max(shares) if shares else None,
                       "ghost_micro_batches": [len(g) for g in plan.ghosts]}}
