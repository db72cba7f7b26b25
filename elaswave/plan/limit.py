"""Whether a plan fits its memory limit (``parallel.stage_memory_mb``), and what to say when it
does not: the checks after a partition by cost alone (:func:`~elaswave.plan.memory.by_cost`) or
with experts held by their owners, which the partition's own memory terms do not see."""
from __future__ import annotations

from elaswave.plan.memory import MIB, by_cost, rank_bytes


def over_limit(plan) -> dict[int, float]:
    """Where the partition is by cost alone (:func:`by_cost`), or experts are held by their owners
    (which the partition's memory terms do not see: a rank alone in its expert-parallel group
    holds every expert of its layers, plan/experts.py): each rank whose modelled peak passes the
    plan's limit, with its MiB (none without a limit, or where the partition weighed it all)."""
    experts = bool(getattr(plan, "expert_holders", ()))
    if not (by_cost(plan.virtual_stages, plan.memory) or experts) or not plan.stage_memory_limit or plan.memory is None:
        return {}
    need = {rank: rank_bytes(plan.memory, plan, rank)["total"] / MIB for rank in plan.ranks}
    return {rank: mib for rank, mib in need.items() if mib > plan.stage_memory_limit}


def _mib(x: float) -> str:
    """MiB in words: whole from 100 on, else to 4 significant digits (a test's 5.5 MiB limit is not "6")."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.4g}"


def limit_refusal(plan) -> str | None:
    """:func:`over_limit`'s first rank in words; None when every rank fits."""
    over = over_limit(plan)
    if not over:
        return None
    rank = min(over)
    if not by_cost(plan.virtual_stages, plan.memory):  # experts held by their owners (over_limit)
        return (f"rank {rank} would hold {_mib(over[rank])} MiB at its peak with the experts the plan gives it, over "
                f"the limit of {_mib(plan.stage_memory_limit)} MiB (an expert's state is shared by one rank of each "
                "expert-parallel group of its stage, and a rank alone in its group holds every expert of its "
                "layers); more stages, a larger limit, or parallel.ep=1")
    if plan.virtual_stages == 1:  # the plan recomputes: every block of the rank's already is
        return (f"rank {rank} would hold {_mib(over[rank])} MiB at its peak with every block it runs recomputed, "
                f"over the limit of {_mib(plan.stage_memory_limit)} MiB; more stages, or a larger limit")
    return (f"rank {rank} would hold {_mib(over[rank])} MiB at its peak under interleaved 1F1B "
            f"({plan.virtual_stages} chunks{', every block it runs recomputed' if plan.memory.plan_recomputation else ''}), "
            f"over the limit of {_mib(plan.stage_memory_limit)} MiB; parallel.virtual_stages=1 partitions by memory")
