"""The plan of an epoch: a pure function of (live ranks, job shape, cost profile, previous plan),
and the first one (re-plans: plan/replan.py).

Every rank computes the same plan from the same inputs; nothing here touches a process group.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import cached_property
from itertools import accumulate
from typing import Sequence

from elaswave.plan import microbatches
from elaswave.plan.buckets import gradient_buckets
from elaswave.plan.chunks import Owners, chunks_by_rank, round_robin_owners, slot_chunks
from elaswave.plan.detours import covers
from elaswave.plan.limit import limit_refusal
from elaswave.plan.memory import MemoryModel, by_cost, stages_memory
from elaswave.plan.recompute import by_memory, fit_recomputation
from elaswave.plan.errors import PlanError  # noqa: F401 (where callers import it from)
from elaswave.plan.experts import expert_groups, ghost_counts, owner_imbalance, place_holders, team_layout
from elaswave.plan.partition import PartitionError, partition


@dataclass(frozen=True)
class Plan:
    epoch: int
    num_layers: int
    pipelines: tuple[tuple[int, ...], ...]
    """pipelines[d][s] = the rank that is stage s of pipeline d."""
    layer_ranges: tuple[tuple[tuple[int, int], ...], ...]
    """layer_ranges[d][k] = (start, end) layers of (virtual) stage k of pipeline d."""
    micro_batches: tuple[tuple[int, ...], ...]
    """micro_batches[d] = ids of the micro-batches pipeline d runs each step."""
    chunk_owners: Owners = ()
    """chunk_owners[layer][c] = the rank owning ZeRO chunk c of the layer."""
    layer_costs: tuple[float, ...] = ()
    """Each layer's relative compute cost (forward + backward): what stages are balanced by."""
    frequencies: tuple[tuple[float, ...], ...] = ()
    """frequencies[d][s] = the frequency level of stage s of pipeline d (empty: nominal, 1.0)."""
    layer_memory: tuple[float, ...] = ()
    """Each layer's memory on the stage that holds it (summed over a stage's layers), unless
    ``memory`` models it; and the most one stage may hold (0: no limit, MiB with ``memory``): a
    partition keeps within it or says why it cannot."""
    stage_memory_limit: float = 0.0
    memory: MemoryModel | None = None
    """The job's memory model (elaswave.plan.memory): what stage_memory_limit is checked against."""
    routes: tuple[tuple[int, tuple[int, ...]], ...] = ()
    """(micro-batch, ranks by stage) for micro-batches that do not run down their own pipeline:
    the reroute baseline sends a broken pipeline's micro-batches through other pipelines' stages."""
    depth: int = 0
    """Stages of a whole pipeline (the configured ``pp``): joining ranks fill broken pipelines up
    to it, then form new pipelines of it (0: the deepest pipeline's)."""
    ties: tuple[tuple[int, int], ...] = ()
    """(owner, user) layer pairs of tied parameters: a rank holding the user holds the owner's
    tensor too, so the owner's holder group (one gradient sum, one optimizer state) includes it."""
    ranks_per_node: int = 0
    """Ranks per host, numbered host-major as torchrun and the launcher number them (0: one host).
    Snapshots then go to a rank on another host wherever there is one, so that losing a whole
    host leaves every lost rank's snapshot alive."""
    snapshot_copies: int = 1
    """Peers that keep each rank's per-step snapshot (``elastic.snapshot_copies``): the next ones on
    the ring, fewer while the epoch has fewer other ranks."""
    units_per_micro_batch: int = 1
    """Units -- sample groups that are never split -- in a configured micro-batch. Above 1 elaswave
    reshapes: it deals the global batch's units, not whole micro-batches (plan.microbatches)."""
    micro_batch_units: tuple[int, ...] = ()
    """micro_batch_units[id] = the units micro-batch ``id`` holds (empty: units_per_micro_batch each)."""
    frequency_solver: str = ""
    """What chose ``frequencies`` (:class:`~elaswave.plan.frequency.FrequencyPlan`'s ``solver``; empty: none)."""
    recomputed: tuple[tuple[tuple[int, ...], ...], ...] = ()
    """recomputed[d][s] = the blocks stage s of pipeline d recomputes to fit the memory limit, beside
    the configured ones (train.activation_checkpointing=auto: plan/recompute.py; empty: none)."""
    bucket_starts: tuple[int, ...] = ()
    """Layers where a gradient bucket is cut by size (plan/buckets.size_starts; empty: at chunks only)."""
    unit_layers: tuple[int, ...] = ()
    """The layer of each unit after the layers (model/units.py: a mixture of experts' experts,
    unit ``num_layers + k``). ``chunk_owners`` has a row per unit."""
    ep: int = 1
    """Pipelines of a stage whose ranks share their experts (parallel.ep; plan/experts.py)."""
    expert_holders: tuple[tuple[int, ...], ...] = ()
    """expert_holders[k] = the holders of unit ``num_layers + k``: its owner in each expert-parallel
    group of its stage (plan/experts.place_holders; empty: its layer's holders, every one)."""
    expert_loads: tuple[float, ...] = ()
    """Tokens the router sent each expert unit in the last epoch, summed over the reports of the
    change that made this plan: what it placed experts by (empty: not measured)."""
    expert_map: str = "load"
    """How a re-plan places a lost owner's experts: ``load`` (elaswave: by the router's counts, then
    evened out) or ``static`` (the simulator's static-expert-map baseline: all to one backup member)."""
    teams: tuple[int, ...] = ()
    """teams[d] = the expert-parallel team of pipeline d: the ``ep`` pipelines laid out together
    (their stages' groups inside a host), kept through losses; a joiners' pipeline fills a team
    that lost one, else starts a new one (empty: pipeline index // ep). Only a team's pipelines
    exchange tokens (plan/experts.py)."""
    virtual_stages: int = 1
    """Model chunks a rank holds (parallel.virtual_stages, interleaved 1F1B): layer_ranges[d] then
    has ``len(pipelines[d]) * virtual_stages`` ranges, virtual stage ``k`` on rank
    ``pipelines[d][k % len(pipelines[d])]`` (Megatron's layout), on survivors as before a loss."""

    def to_doc(self) -> dict:
        """JSON-ready: a joining rank reads the plan it joins from the store."""
        doc = {f.name: getattr(self, f.name) for f in fields(self)}
        doc["memory"] = self.memory.to_doc() if self.memory is not None else None
        return doc

    @staticmethod
    def from_doc(doc: dict) -> "Plan":
        def tuples(x):
            return tuple(tuples(v) for v in x) if isinstance(x, list) else x
        out = {k: tuples(v) for k, v in doc.items()}
        out["memory"] = MemoryModel.from_doc(doc["memory"]) if doc.get("memory") else None
        return Plan(**out)

    # Lookups are indexed once per plan (cached on the frozen instance): a plan for 10^5 ranks is
    # queried by every rank, so nothing here may scan all pipelines per call.
    def recomputed_of(self, rank: int) -> frozenset[int]:
        """The blocks ``rank`` recomputes by the plan's choice (:attr:`recomputed`)."""
        d, s = self.position(rank) if self.recomputed else (0, 0)
        return frozenset(self.recomputed[d][s]) if self.recomputed else frozenset()

    @cached_property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(r for p in self.pipelines for r in p))

    @cached_property
    def _where(self) -> dict[int, tuple[int, int]]:  # rank -> (pipeline, stage)
        return {r: (d, s) for d, pipe in enumerate(self.pipelines) for s, r in enumerate(pipe)}

    @cached_property
    def _ring(self) -> tuple[tuple[int, ...], dict[int, int]]:
        """The snapshot ring and each rank's place on it: by local index, then host, so that
        neighbours on the ring are on different hosts while any two hosts have ranks left."""
        per = self.ranks_per_node
        ring = tuple(sorted(self.ranks, key=lambda r: (r % per, r // per))) if per > 0 else self.ranks
        return ring, {r: i for i, r in enumerate(ring)}

    @property
    def num_units(self) -> int:
        return self.num_layers + len(self.unit_layers)

    def layer_of(self, unit: int) -> int:
        """The layer a unit is part of (itself, for a layer's own unit)."""
        return unit if unit < self.num_layers else self.unit_layers[unit - self.num_layers]

    @cached_property
    def _holders(self) -> tuple[tuple[int, ...], ...]:
        out: list[list[int]] = [[] for _ in range(self.num_layers)]
        for pipe, ranges in zip(self.pipelines, self.layer_ranges):
            for k, (i, j) in enumerate(ranges):
                for layer in range(i, j):
                    out[layer].append(pipe[k % len(pipe)])
        for owner, user in self.ties:
            out[owner].extend(out[user])
        out += self.expert_holders or [out[layer] for layer in self.unit_layers]
        return tuple(tuple(sorted(set(h))) for h in out)

    def experts_held(self, rank: int) -> frozenset[int] | None:
        """The expert units ``rank`` holds (None: every one of its layers', as without ``expert_holders``)."""
        return self._experts_by_rank.get(rank, frozenset()) if self.expert_holders else None

    @cached_property
    def _experts_by_rank(self) -> dict[int, frozenset[int]]:
        out: dict[int, set[int]] = {}
        for u in range(self.num_layers, self.num_units):
            for r in self._holders[u]:
                out.setdefault(r, set()).add(u)
        return {r: frozenset(us) for r, us in out.items()}

    @cached_property
    def experts_of_layer(self) -> dict[int, tuple[int, ...]]:
        """Layer -> its expert units (``num_layers + k``), in order."""
        out: dict[int, list[int]] = {}
        for k, layer in enumerate(self.unit_layers):
            out.setdefault(layer, []).append(self.num_layers + k)
        return {layer: tuple(us) for layer, us in out.items()}

    @cached_property
    def expert_group(self) -> dict[int, tuple[int, ...]]:
        """Each rank's expert-parallel group (plan/experts.expert_groups)."""
        return expert_groups(self)

    @cached_property
    def expert_imbalance(self) -> dict[tuple[tuple[int, ...], int], float]:
        """(group, layer) -> the busiest member's share of the layer's experts over an even share
        (plan/experts.owner_imbalance)."""
        return owner_imbalance(self)

    def team(self, d: int) -> int:
        """Pipeline ``d``'s expert-parallel team (:attr:`teams`)."""
        return self.teams[d] if self.teams else d // max(1, self.ep)

    @cached_property
    def ghosts(self) -> tuple[tuple[int, ...], ...]:
        """ghosts[d] = the ids of the ghost micro-batches pipeline d runs after its own: it has
        fewer than its expert-parallel group's others, and joins their exchanges with no rows
        (plan/experts.ghost_counts). Numbered after every real id, so they never name one."""
        counts = ghost_counts(self)
        base = 1 + max((mb for m in self.micro_batches for mb in m), default=-1)
        return tuple(tuple(range(base, base + c)) for c in counts)

    def schedule_of(self, d: int) -> tuple[int, ...]:
        """The micro-batches pipeline ``d``'s schedule runs: its own, then its ghosts."""
        return self.micro_batches[d] + self.ghosts[d]

    @cached_property
    def route_of(self) -> dict[int, tuple[int, ...]]:
        return dict(self.routes)

    @cached_property
    def guest_places(self) -> dict[int, tuple[tuple[int, int], ...]]:
        """Each host's guests (micro-batches detoured through it) as (their place in their own
        pipeline's schedule, the host's chunk they run)."""
        out: dict[int, list[tuple[int, int]]] = {}
        for d, pipe in enumerate(self.pipelines):
            for j, mb in enumerate(self.schedule_of(d)):
                route = self.route_of.get(mb, ())
                for v, r in enumerate(route):
                    if r not in pipe:
                        out.setdefault(r, []).append((j, v * self.virtual_stages // len(route)))
        return {r: tuple(sorted(places)) for r, places in out.items()}

    def frequency(self, rank: int) -> float:
        d, s = self.position(rank) if self.frequencies else (0, 0)
        return self.frequencies[d][s] if self.frequencies else 1.0

    def is_complete(self, d: int) -> bool:
        """Pipeline ``d`` holds every layer (baselines leave a broken pipeline's survivors in place)."""
        return covers(self.layer_ranges[d], self.num_layers)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches in a step (the global batch, unless a baseline policy dropped some)."""
        return sum(len(m) for m in self.micro_batches)

    def units_of(self, micro_batch: int) -> int:
        return self.micro_batch_units[micro_batch] if self.micro_batch_units else self.units_per_micro_batch

    @cached_property
    def _unit_starts(self) -> tuple[int, ...]:
        return tuple(accumulate(self.micro_batch_units[:-1], initial=0)) if self.micro_batch_units else ()

    def first_unit(self, micro_batch: int) -> int:
        """The global batch's first unit micro-batch ``micro_batch`` holds (ids hold units in order)."""
        return self._unit_starts[micro_batch] if self.micro_batch_units else micro_batch * self.units_per_micro_batch

    @property
    def batch_units(self) -> int:
        """Units in a step: the global batch (unless a baseline dropped some), whatever its shape."""
        return sum(self.units_of(mb) for m in self.micro_batches for mb in m)

    def position(self, rank: int) -> tuple[int, int]:
        """(pipeline, stage) of ``rank``."""
        try:
            return self._where[rank]
        except KeyError:
            raise KeyError(f"rank {rank} is not in the plan of epoch {self.epoch} (ranks {self.ranks})") from None

    def layers_of(self, rank: int) -> tuple[int, int]:
        """The one layer range ``rank`` runs (a plan without virtual stages; see chunk_ranges)."""
        if self.virtual_stages != 1:
            raise ValueError(f"rank {rank} runs {self.virtual_stages} chunks: ask chunk_ranges")
        d, s = self.position(rank)
        return self.layer_ranges[d][s]

    def chunk_ranges(self, rank: int) -> tuple[tuple[int, int], ...]:
        """The layer range of each model chunk ``rank`` runs, chunk 0 first (one without virtual stages)."""
        d, s = self.position(rank)
        return self.layer_ranges[d][s::len(self.pipelines[d])]

    def holders(self, unit: int) -> tuple[int, ...]:
        """The holder group of a unit (a layer's): the rank of each pipeline that holds it, sorted."""
        return self._holders[unit]

    def holder_groups(self) -> dict[tuple[int, ...], tuple[int, ...]]:
        """Distinct holder sets -> the units they hold together, in layer order (a layer's own
        unit before its experts')."""
        return dict(self._indexed[0])

    def gradient_buckets(self) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
        return self._indexed[3]  # (holders, layers) each: holder groups cut at model chunks (plan/buckets.py)

    def buckets_of(self, rank: int) -> tuple[int, ...]:
        """Indices into :meth:`gradient_buckets` of the buckets ``rank`` holds."""
        return self._buckets_by_rank.get(rank, ())

    @cached_property
    def _buckets_by_rank(self) -> dict[int, tuple[int, ...]]:
        index: dict[int, list[int]] = {}
        for b, (holders, _) in enumerate(self.gradient_buckets()):
            for h in holders:
                index.setdefault(h, []).append(b)
        return {r: tuple(bs) for r, bs in index.items()}

    def chunks_of(self, rank: int) -> tuple[tuple[int, int], ...]:
        """The (layer, chunk) keys ``rank`` owns, in canonical order."""
        return self._indexed[1].get(rank, ())

    def slot_chunks(self, rank: int) -> tuple[int, ...]:
        """Chunks in ``rank``'s optimizer slot of each holder group it is in (chunks.slot_chunks)."""
        return self._indexed[2].get(rank, ())

    @cached_property
    def _indexed(self) -> tuple[dict, dict, dict, tuple]:
        """Holder groups, each rank's chunks and slot sizes, the buckets: the memory model asks for every rank's."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for unit in sorted(range(self.num_units), key=lambda u: (self.layer_of(u), u)):
            groups.setdefault(self._holders[unit], []).append(unit)
        by_holders = {h: tuple(ls) for h, ls in sorted(groups.items())}
        buckets = gradient_buckets(self, by_holders)
        return by_holders, chunks_by_rank(self.chunk_owners), slot_chunks(self.chunk_owners, buckets), buckets

    def snapshot_holders(self, rank: int) -> tuple[int, ...]:
        """Who keeps ``rank``'s snapshot: the next ``snapshot_copies`` ranks on the ring (none when alone)."""
        ring, place = self._ring
        k = min(self.snapshot_copies, len(ring) - 1)
        return tuple(ring[(place[rank] + i) % len(ring)] for i in range(1, k + 1))

    def snapshot_owners(self, rank: int) -> tuple[int, ...]:
        """Whose snapshots ``rank`` keeps: the previous ``snapshot_copies`` ranks on the ring."""
        ring, place = self._ring
        k = min(self.snapshot_copies, len(ring) - 1)
        return tuple(ring[(place[rank] - i) % len(ring)] for i in range(1, k + 1))


def initial_plan(world_size: int, dp: int, pp: int, layer_costs: Sequence[float], num_micro_batches: int,
                 layer_numels: Sequence[int] = (), chunk_numel: int = 1, layer_memory: Sequence[float] = (),
                 stage_memory_limit: float = 0.0, ties: Sequence[tuple[int, int]] = (),
                 memory: MemoryModel | None = None, units_per_micro_batch: int = 1, virtual_stages: int = 1,
                 bucket_starts: Sequence[int] = (), unit_layers: Sequence[int] = (), ep: int = 1) -> Plan:
    """Rank ``d * pp + s`` is stage ``s`` of pipeline ``d``: a pipeline's stages are neighbours
    (with ``ep`` > 1 and experts, each team's stage-``s`` ranks are: plan/experts.team_layout).
    ``units_per_micro_batch`` > 1: re-plans reshape micro-batches in units (see Plan);
    ``virtual_stages`` > 1: ``pp x virtual_stages`` chunks, minimax on the layer costs (interleaved 1F1B);
    ``unit_layers``: the layer of each unit after the layers (see Plan), ``layer_numels`` then a unit's each;
    ``ep`` > 1: those units (experts) held by their owners (plan/experts.py)."""
    if units_per_micro_batch < 1:
        raise ValueError(f"units_per_micro_batch={units_per_micro_batch} must be >= 1")
    if dp * pp != world_size:
        raise ValueError(f"dp={dp} x pp={pp} = {dp * pp} must equal the world size {world_size}")
    try:
        if by_cost(virtual_stages, memory):
            ranges = tuple(partition(layer_costs, pp * virtual_stages))
        else:
            ranges = tuple(partition(layer_costs, pp, layer_memory or None, stage_memory_limit or None,
                                     stage_memory=stages_memory(memory, pp, dp, num_micro_batches)))
    except PartitionError as exc:
        raise PlanError(f"the initial layout does not fit: {exc}") from None

    def planned(ranges) -> Plan:
        plan = Plan(
            epoch=0,
            num_layers=len(layer_costs),
            pipelines=team_layout(dp, pp, ep if unit_layers else 1),
            layer_ranges=tuple(ranges for _ in range(dp)),
            micro_batches=tuple(microbatches.assign(num_micro_batches, [1.0] * dp)),
            layer_costs=tuple(float(c) for c in layer_costs),
            layer_memory=tuple(float(m) for m in layer_memory),
            stage_memory_limit=float(stage_memory_limit),
            memory=memory,
            depth=pp,
            ties=tuple(tuple(t) for t in ties),
            units_per_micro_batch=units_per_micro_batch,
            virtual_stages=virtual_stages, bucket_starts=tuple(bucket_starts), unit_layers=tuple(unit_layers), ep=ep,
        )
        if ep > 1 and unit_layers:
            plan = replace(plan, expert_holders=place_holders(plan, None))
        if layer_numels:
            plan = replace(plan, chunk_owners=round_robin_owners(plan.gradient_buckets(), layer_numels, chunk_numel))
        return fit_recomputation(plan)
    plan = planned(ranges)
    why = limit_refusal(plan)
    if why and virtual_stages == 1 and memory is not None and memory.plan_recomputation:
        # By cost it does not fit even recomputing every block: partitioned as full is, it may.
        other = by_memory(layer_costs, pp, memory, stage_memory_limit, dp, num_micro_batches)
        if other is not None and not limit_refusal(refit := planned(tuple(other))):
            plan, why = refit, None
    if why:
        raise PlanError(f"the initial layout does not fit: {why}")
    return plan
