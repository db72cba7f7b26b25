"""What a re-plan moves (pure): the state a rank newly holds or owns, priced over its link."""
from __future__ import annotations

from elaswave.plan.plan import Plan
from elaswave.sim.model import ClusterModel


def migration_s(before: Plan, after: Plan, model: ClusterModel) -> float:
    """State that moves in a re-plan, as disjoint transfers in parallel: the slowest receiver's
    bytes over its link. A rank receives the ZeRO state (3x the parameters) of chunks it newly owns
    and the parameters of units it newly holds (its layers', in any of its model chunks, and its
    experts')."""
    if not model.layer_param_bytes:
        return 0.0
    incoming: dict[int, float] = {}
    for r in after.ranks:
        new = held_units(after, r) - held_units(before, r)
        if new:
            incoming[r] = sum(model.layer_param_bytes[unit] for unit in new)
    for layer, (old_row, new_row) in enumerate(zip(before.chunk_owners, after.chunk_owners)):
        per_chunk = 3 * model.layer_param_bytes[layer] / max(1, len(new_row))
        for o, n in zip(old_row, new_row):
            if o != n:
                incoming[n] = incoming.get(n, 0.0) + per_chunk
    worst = max(incoming.values(), default=0.0)
    return worst / model.inter_node_bytes_per_s if worst else 0.0


def held_units(plan: Plan, rank: int) -> frozenset[int]:
    """The units ``rank`` holds under ``plan``: its layers' own and the experts the plan gives it
    (model/units.py, plan/experts.py)."""
    layers = held_layers(plan, rank)
    experts = plan.experts_held(rank)
    if experts is None:
        experts = frozenset(u for u in range(plan.num_layers, plan.num_units) if plan.layer_of(u) in layers)
    return layers | experts


def held_layers(plan: Plan, rank: int) -> frozenset[int]:
    """The layers ``rank`` runs under ``plan``, its model chunks' together (none: not in the plan)."""
    try:
        return frozenset(layer for i, j in plan.chunk_ranges(rank) for layer in range(i, j))
    except KeyError:
        return frozenset()
