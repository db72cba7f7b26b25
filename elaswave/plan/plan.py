"""The plan of an epoch: a pure function of (live ranks, job shape, cost profile, previous plan).

Every rank computes the same plan from the same inputs; nothing here touches a process group.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import cached_property
from itertools import accumulate
from typing import Mapping, Sequence

from elaswave.plan import microbatches
from elaswave.plan.buckets import gradient_buckets
from elaswave.plan.chunks import Owners, chunks_by_rank, reassign_owners, rebalance_owners, round_robin_owners, slot_chunks
from elaswave.plan.deal import deal, detoured_step_s, step_s
from elaswave.plan.frequency import PowerModel
from elaswave.plan.memory import MemoryModel, by_cost, limit_refusal, over_limit, stages_memory
from elaswave.plan.recompute import fit_recomputation
from elaswave.plan.detours import covers, detour_routes
from elaswave.plan.errors import PlanError  # noqa: F401 (where callers import it from)
from elaswave.plan.partition import PartitionError, partition
from elaswave.plan.rates import priced_step_s, range_cost, rank_rates, recompute_cost, stage_times, timing
from elaswave.plan.resplit import place_joiners, split


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
    unit ``num_layers + k``); its holders are its layer's. ``chunk_owners`` has a row per unit."""
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
        out += [out[layer] for layer in self.unit_layers]
        return tuple(tuple(sorted(set(h))) for h in out)

    @cached_property
    def route_of(self) -> dict[int, tuple[int, ...]]:
        return dict(self.routes)

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
                 bucket_starts: Sequence[int] = (), unit_layers: Sequence[int] = ()) -> Plan:
    """Rank ``d * pp + s`` is stage ``s`` of pipeline ``d``: a pipeline's stages are neighbours.
    ``units_per_micro_batch`` > 1: re-plans reshape micro-batches in units (see Plan);
    ``virtual_stages`` > 1: ``pp x virtual_stages`` chunks, minimax on the layer costs (interleaved 1F1B);
    ``unit_layers``: the layer of each unit after the layers (see Plan), ``layer_numels`` then a unit's each."""
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
    pipelines = tuple(tuple(d * pp + s for s in range(pp)) for d in range(dp))
    plan = Plan(
        epoch=0,
        num_layers=len(layer_costs),
        pipelines=pipelines,
        layer_ranges=tuple(ranges for _ in range(dp)),
        micro_batches=tuple(microbatches.assign(num_micro_batches, [1.0] * dp)),
        layer_costs=tuple(float(c) for c in layer_costs),
        layer_memory=tuple(float(m) for m in layer_memory),
        stage_memory_limit=float(stage_memory_limit),
        memory=memory,
        depth=pp,
        ties=tuple(tuple(t) for t in ties),
        units_per_micro_batch=units_per_micro_batch,
        virtual_stages=virtual_stages, bucket_starts=tuple(bucket_starts), unit_layers=tuple(unit_layers),
    )
    if layer_numels:
        plan = replace(plan, chunk_owners=round_robin_owners(plan.gradient_buckets(), layer_numels, chunk_numel))
    plan = fit_recomputation(plan)
    if why := limit_refusal(plan):
        raise PlanError(f"the initial layout does not fit: {why}")
    return plan


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
    if policy == "reroute" and prev.virtual_stages > 1:
        raise PlanError(f"epoch {epoch}: elastic.policy=reroute sends micro-batches through other pipelines' stages, "
                        f"which pipelines of {prev.virtual_stages} interleaved chunks a rank do not share")
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
    if num_micro_batches < len(pipelines):
        raise PlanError(f"epoch {epoch}: {num_micro_batches} micro-batches cannot feed {len(pipelines)} pipelines")
    if policy == "elaswave":
        return _elaswave(prev, epoch, pipelines, kept_ranges, kept, num_micro_batches, speeds or {}, power,
                         power_cap_w, detours and not rebalance, rebalance, schedule)
    complete = [covers(rng, prev.num_layers) for rng in kept_ranges]
    if not any(complete):
        raise PlanError(f"epoch {epoch}: elastic.policy={policy} needs a pipeline that still holds every layer, "
                        f"and none does (survivors {list(live)}); elastic.policy=elaswave re-partitions instead")
    if policy == "drop_replica":
        return _build(prev, epoch, pipelines, kept_ranges,
                      tuple(prev.micro_batches[d] if ok else () for d, ok in zip(kept, complete)))
    mbs = tuple(prev.micro_batches[d] for d in kept)
    return _build(prev, epoch, pipelines, kept_ranges, mbs,
                  routes=detour_routes(prev, pipelines, kept_ranges, complete, mbs, epoch))


def _build(prev: Plan, epoch: int, pipelines, ranges, mbs, freqs=(), routes=(), units=None, solver="",
           check: bool = True) -> Plan:
    """``units``: each micro-batch id's units (None: ``prev``'s, whose ids ``mbs`` then are);
    ``check``: refuse an interleaved plan over the memory limit (else the caller decides)."""
    plan = Plan(epoch=epoch, num_layers=prev.num_layers, pipelines=tuple(pipelines), layer_ranges=tuple(ranges),
                micro_batches=tuple(mbs), layer_costs=prev.layer_costs, frequencies=tuple(freqs), routes=tuple(routes),
                layer_memory=prev.layer_memory, stage_memory_limit=prev.stage_memory_limit, memory=prev.memory,
                depth=prev.depth, ties=prev.ties, ranks_per_node=prev.ranks_per_node, snapshot_copies=prev.snapshot_copies,
                units_per_micro_batch=prev.units_per_micro_batch,
                micro_batch_units=prev.micro_batch_units if units is None else tuple(units),
                frequency_solver=solver if freqs else "", virtual_stages=prev.virtual_stages,
                bucket_starts=prev.bucket_starts, unit_layers=prev.unit_layers)
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
              detours: bool, rebalance: bool = False, schedule: str = "1f1b") -> Plan:
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
            # The clock planner times 1F1B: levels the schedule's own timing finds slower give way to nominal.
            if d[1] and nominal_ok and timed(n := dealt(False)) < timed(d) * (1 - 1e-3):
                d = n
            built = _build(prev, epoch, pipelines, ranges, d[0], d[1], units=d[2], solver=d[3], check=False)
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
    # Interleaved pipelines share no stage layout a detour could pass through.
    if detours and prev.virtual_stages == 1 and any(complete) and not all(complete):
        kept_mbs = tuple(prev.micro_batches[d] if d is not None else () for d in kept)
        try:
            routes = detour_routes(prev, pipelines, kept_ranges, complete, kept_mbs, epoch)
        except PlanError:
            routes = None
        if routes is not None and sum(map(len, kept_mbs)) == num_micro_batches:
            forward = {r: (range_cost(prev, i, j) + extra.get(r, 0.0)) / rate[r] for pipe, rng in zip(pipelines, kept_ranges)
                       for r, (i, j) in zip(pipe, rng)}  # recomputing as in the re-split plan: both priced alike
            if detoured_step_s(pipelines, kept_mbs, routes, forward) < step_s(at_levels, run_mbs, sizes, schedule) * (1 - 1e-3):
                return _build(prev, epoch, pipelines, kept_ranges, kept_mbs, routes=routes)
    plan = built
    # A partition by cost (interleaved, or recomputing to fit): a re-split pipeline over the limit stands
    # by, as one that no partition fits does (its survivors keep their layers; the others take its batch).
    while over := [i for i, pipe in enumerate(pipelines) if i not in standby and ranges[i] is not kept_ranges[i]
                   and not covers(kept_ranges[i], prev.num_layers) and set(pipe) & set(over_limit(plan))]:
        for i in over:
            ranges[i] = kept_ranges[i]
            standby.append(i)
            held = f"as {prev.virtual_stages} interleaved chunks each" if prev.virtual_stages > 1 else "recomputing every block"
            why.append(f"ranks {list(pipelines[i])} hold too much {held}")
        _, plan = settled()
    if refusal := limit_refusal(plan):  # an intact pipeline over the limit: nothing stands it by
        raise PlanError(f"epoch {epoch}: {refusal}")
    return plan
