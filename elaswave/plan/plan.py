"""The plan of an epoch: a pure function of (live ranks, job shape, cost profile).

Every rank computes the same plan from the same inputs; nothing here touches a process group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from elaswave.plan import microbatches
from elaswave.plan.partition import partition


@dataclass(frozen=True)
class Plan:
    epoch: int
    num_layers: int
    pipelines: tuple[tuple[int, ...], ...]
    """pipelines[d][s] = the rank that is stage s of pipeline d."""
    layer_ranges: tuple[tuple[tuple[int, int], ...], ...]
    """layer_ranges[d][s] = (start, end) layers of stage s of pipeline d."""
    micro_batches: tuple[tuple[int, ...], ...]
    """micro_batches[d] = ids of the micro-batches pipeline d runs each step."""

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(r for p in self.pipelines for r in p))

    def position(self, rank: int) -> tuple[int, int]:
        """(pipeline, stage) of ``rank``."""
        for d, pipe in enumerate(self.pipelines):
            if rank in pipe:
                return d, pipe.index(rank)
        raise KeyError(f"rank {rank} is not in the plan of epoch {self.epoch} (ranks {self.ranks})")

    def layers_of(self, rank: int) -> tuple[int, int]:
        d, s = self.position(rank)
        return self.layer_ranges[d][s]

    def holders(self, layer: int) -> tuple[int, ...]:
        """The holder group of a layer: the rank of each pipeline that holds it, sorted."""
        out = []
        for d, pipe in enumerate(self.pipelines):
            for s, (i, j) in enumerate(self.layer_ranges[d]):
                if i <= layer < j:
                    out.append(pipe[s])
        return tuple(sorted(out))

    def holder_groups(self) -> dict[tuple[int, ...], tuple[int, ...]]:
        """Distinct holder sets -> the layers they hold together (one gradient bucket each)."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for layer in range(self.num_layers):
            groups.setdefault(self.holders(layer), []).append(layer)
        return {h: tuple(ls) for h, ls in sorted(groups.items())}


def initial_plan(world_size: int, dp: int, pp: int, layer_costs: Sequence[float], num_micro_batches: int) -> Plan:
    """Rank ``d * pp + s`` is stage ``s`` of pipeline ``d``: a pipeline's stages are neighbours."""
    if dp * pp != world_size:
        raise ValueError(f"dp={dp} x pp={pp} = {dp * pp} must equal the world size {world_size}")
    ranges = tuple(partition(layer_costs, pp))
    pipelines = tuple(tuple(d * pp + s for s in range(pp)) for d in range(dp))
    return Plan(
        epoch=0,
        num_layers=len(layer_costs),
        pipelines=pipelines,
        layer_ranges=tuple(ranges for _ in range(dp)),
        micro_batches=tuple(microbatches.assign(num_micro_batches, [1.0] * dp)),
    )
