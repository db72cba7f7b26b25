"""What a plan costs on a modelled cluster (pure): step time, power, recovery and migration times.

The same :class:`~elaswave.plan.plan.Plan` the runtime trains with is priced here:

- a stage's time per micro-batch is its layers' forward + backward time at its frequency level,
  plus a fixed cost per micro-batch and stage (dispatch, and the activation's send and the
  gradient's send back over the link to the neighbour: intra- or inter-node by placement); under
  interleaved 1F1B each of a rank's ``virtual_stages`` model chunks is such a stage
  (:meth:`ClusterModel.chunk_s`), its sends round the ring of the pipeline's ranks;
- a complete pipeline's compute is the time of the schedule the runtime runs on its stages
  (``pipeline_schedule``, ``parallel.schedule``: 1F1B, ZB-H1 or interleaved 1F1B), the same action
  lists the runtime executes timed by :func:`~elaswave.pipeline.schedule.makespan`: fill and drain
  from the real stage times (each chunk's, interleaved), not ``(S - 1)`` times the slowest; ZB-H1's
  split backward priced with B and W each half of a backward (``BACKWARD_INPUT_SHARE``, an
  assumption). A plan with detours is timed by the routed scheduler the runtime runs whatever
  ``pipeline_schedule`` says (the runtime runs that one there too), and where a broken pipeline
  and its hosts are over that scheduler's size limit a rank that hosts detoured micro-batches is
  bounded by its own and its guests' work plus one fill at the slowest stage (sim/detours.py). The
  ``lower_bound`` pricing (:func:`~elaswave.sim.detours.routed_lower_bound`) does not depend on the
  schedule;
- each gradient bucket's sum starts when its holders' schedules have made its gradients whole
  (a rank's last stage long before the first, and under interleaved 1F1B a chunk's last backward;
  within a whole backward as it reaches the bucket's lowest layer: :func:`overlapped_collectives_s`,
  as ``zero/reduce.Reduction`` and ``zero/watch.py`` run them), a rank's sums one
  after another; the step ends when the slowest pipeline has finished and the last sum has ended,
  and the busiest rank has re-gathered its parameters (ring algorithms over the group's slowest
  link: a reduce-scatter and an all-gather each move ``(n-1)/n`` of the bytes in ``n-1`` hops;
  gloo sums with a whole all-reduce, twice that), plus a fixed per-step cost (norm, optimizer,
  launch).

Devices are numbered node-major (``devices_per_node`` per node) as the launchers number ranks.
With tensor parallelism a device of the plan is a TP group of GPUs inside a node
(:func:`~elaswave.sim.workload.cluster`): its layers' times are a shard's, plus the group's
all-reduces (``layer_tp_s``), and ``devices_per_node`` counts groups.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Sequence

from elaswave.sim.detours import routed_chunk_times, routed_compute, routed_lower_bound  # noqa: F401 (a name of the model)
from elaswave.pipeline.schedule import GENERATORS, gradients_whole, makespan, schedule_makespan, stage_schedule
from elaswave.sim.experts import busiest_owner_s
from elaswave.plan.buckets import gradient_chunks
from elaswave.plan.frequency import PowerModel
from elaswave.plan.plan import Plan


@dataclass(frozen=True)
class ClusterModel:
    layer_forward_s: tuple[float, ...]
    """Forward time of each layer per micro-batch at nominal frequency."""
    backward_factor: float = 2.0
    per_microbatch_stage_s: float = 0.0
    """Fixed cost per micro-batch and stage beyond the layers (dispatch, p2p latency)."""
    step_overhead_s: float = 0.0
    """Fixed cost per step beyond compute and the holder groups' collectives (norm, optimizer)."""
    activation_bytes: float = 0.0
    """Bytes of one micro-batch's activation between stages (the gradient back is the same size);
    0: the sends are not priced (a calibrated model keeps them in ``per_microbatch_stage_s``)."""
    layer_param_bytes: tuple[float, ...] = ()
    """Bytes of each layer's parameters (re-gathered per step) and, times 3, of its ZeRO state."""
    gradient_bytes_factor: float = 1.0
    """Bytes summed per parameter byte: 2 when deterministic mode sums 8-byte fixed point."""
    reduce_is_all_reduce: bool = False
    """gloo: every holder gets the whole summed bucket (an all-reduce) instead of its slot."""
    devices_per_node: int = 8
    intra_node_bytes_per_s: float = 200e9
    inter_node_bytes_per_s: float = 25e9
    intra_node_latency_s: float = 5e-6
    inter_node_latency_s: float = 20e-6
    power: PowerModel = field(default_factory=PowerModel)
    layer_tp_s: tuple[float, ...] = ()
    """Tensor parallelism: each layer's all-reduces inside its TP group per micro-batch in the
    forward (the backward has as many); not scaled by the clock. Empty: no TP."""
    layer_recompute_s: tuple[float, ...] = ()
    """Activation recomputation: what each layer runs again in its backward per micro-batch at
    nominal clocks, kernels only (a recomputed block's forward, or selective's attention core:
    ``workload.recompute_s``). Empty: none."""
    layer_exchange_bytes: tuple[float, ...] = ()
    """Expert parallelism: what one micro-batch's forward and backward of each layer would send if
    all its rows left the rank (a mixture of experts' dispatch and combine each way, and again in a
    recomputed block's forward; 0 for a dense layer). A rank of a group of ``n`` sends ``(n - 1) /
    n`` of it over the group's slowest link, nothing overlapped (the runtime waits for each
    exchange). Empty: none. (Blocks the plan chooses to recompute are not counted again.)"""
    layer_expert_share: tuple[float, ...] = ()
    """Expert parallelism: the share of each layer's forward its experts take (0: dense), which a
    group's busiest owner stretches (sim/experts.busiest_owner_s), and the times the configured
    checkpointing runs them again in the backward (a whole recomputed block's). Empty: none."""
    layer_expert_again: tuple[float, ...] = ()
    layer_recompute_tp_s: tuple[float, ...] = ()
    """The TP collectives a recomputed block runs again (its forward's ``layer_tp_s``; not scaled
    by the clock). Empty: none."""
    # Recovery, in seconds (elaswave's measured phases; the baselines' own figures live with them).
    detect_s: float = 0.05
    agree_s: float = 0.01
    communicator_s: float = 0.0
    plan_s: float = 0.001
    overlap_grad_reduce: bool = True
    """A bucket's gradient sum starts when its chunk is whole (``parallel.overlap_grad_reduce``);
    False: when the rank's schedule ends."""
    overlap_param_gather: bool = True
    """The parameter all-gathers run during the next step's first forwards, each chunk's forwards
    waiting for the buckets it reads (``parallel.overlap_param_gather``); False: after the sums."""
    pipeline_schedule: str = "1f1b"
    """The schedule a complete pipeline without detours runs (``parallel.schedule``): 1f1b, zb-h1, or
    interleaved over the plan's ``virtual_stages`` model chunks a rank."""

    def __post_init__(self) -> None:
        if self.pipeline_schedule not in GENERATORS:
            raise ValueError(f"pipeline_schedule={self.pipeline_schedule!r} is invalid: choose from "
                             f"{', '.join(GENERATORS)}")

    @property
    def recompute_runs(self) -> int:
        """Times a backward runs a recomputed block's forward: once; twice under ZB-H1, whose W
        restarts autograd inside the block after B did (pipeline/zero_bubble.py) -- W's redoing of
        the block's input gradient is not priced. (Selective's core runs once: W does not pass it.)"""
        return 2 if self.pipeline_schedule == "zb-h1" else 1

    def split_factor(self, plan: Plan | None = None) -> float:
        """Backward over forward, by which a schedule's timing splits a stage's time
        (``makespan``'s ``backward_factor``): ``backward_factor``, plus what recomputation adds to the
        backward over the forward's time (``plan``'s chosen blocks too). Exact for a stage whose
        share of recomputation is the whole model's; every_N's stages differ by at most a block's,
        a plan's choice by what it chose."""
        again = sum(self.layer_recompute_s) + sum(self.layer_recompute_tp_s)
        if plan is not None and plan.recomputed:  # a pipeline's worth, on average
            again += self.recompute_runs * sum(
                self.layer_forward_s[k] + (self.layer_tp_s[k] if self.layer_tp_s else 0.0)
                for pipe in plan.recomputed for blocks in pipe for k in blocks) / len(plan.recomputed)
        if not again:
            return self.backward_factor
        whole = (1 + self.backward_factor) * sum(self.layer_forward_s) + 2 * sum(self.layer_tp_s)
        return self.backward_factor + (1 + self.backward_factor) * again / whole

    @property
    def layer_costs(self) -> tuple[float, ...]:
        """What the planner partitions by: each layer's forward, plus its recomputation as a share
        of a forward and backward (proportional to its compute: a recomputed block weighs more)."""
        if not self.layer_recompute_s:
            return self.layer_forward_s
        return tuple(f + r / (1 + self.backward_factor) for f, r in zip(self.layer_forward_s, self.layer_recompute_s))

    @property
    def num_layers(self) -> int:
        return len(self.layer_forward_s)

    def same_node(self, a: int, b: int) -> bool:
        return a // self.devices_per_node == b // self.devices_per_node

    def transfer_s(self, nbytes: float, a: int, b: int) -> float:
        if self.same_node(a, b):
            return self.intra_node_latency_s + nbytes / self.intra_node_bytes_per_s
        return self.inter_node_latency_s + nbytes / self.inter_node_bytes_per_s

    def chunk_s(self, plan: Plan, rank: int, chunk: int) -> float:
        """One micro-batch's forward + backward on model chunk ``chunk`` of ``rank`` (virtual stage
        ``k = chunk * p + s``; without virtual stages, its one stage), with the fixed cost -- per
        chunk: each chunk's forward and backward is a dispatch of its own -- and its sends: the
        activation on to virtual stage ``k + 1`` and the gradient back to ``k - 1``, none past
        either end. Those are on the ring neighbours ``pipe[(s + 1) % p]`` and ``pipe[s - 1]``, so
        with V chunks a rank sends V activations and V gradients a micro-batch, less the ends' (the
        first rank's chunk 0 sends no gradient, the last rank's last chunk no activation); a
        one-rank pipeline's send to itself (the runtime's loopback) uses no link and is not priced."""
        d, s = plan.position(rank)
        pipe = plan.pipelines[d]
        k = chunk * len(pipe) + s
        i, j = plan.layer_ranges[d][k]
        compute = sum(self.layer_forward_s[i:j]) * (1 + self.backward_factor) / self.power.speed(plan.frequency(rank))
        if self.layer_tp_s:
            compute += 2 * sum(self.layer_tp_s[i:j])
        runs = self.recompute_runs
        if self.layer_recompute_s:  # the backward runs these again
            compute += sum(self.layer_recompute_s[i:j]) / self.power.speed(plan.frequency(rank))
        if self.layer_recompute_tp_s:
            compute += sum(self.layer_recompute_tp_s[i:j])
        if plan.recomputed:  # the blocks the rank chose to recompute (checkpointing auto): whole forwards again
            mine = plan.recomputed_of(rank)
            again = [k for k in range(i, j) if k in mine]
            compute += runs * sum(self.layer_forward_s[k] for k in again) / self.power.speed(plan.frequency(rank))
            compute += runs * sum(self.layer_tp_s[k] for k in again) if self.layer_tp_s else 0.0
        if self.layer_exchange_bytes and any(self.layer_exchange_bytes[i:j]):
            compute += self.exchange_s(plan, rank, sum(self.layer_exchange_bytes[i:j]),
                                       4 * sum(1 for b in self.layer_exchange_bytes[i:j] if b))
        if self.layer_expert_share and plan.expert_holders:
            compute += busiest_owner_s(self, plan, rank, i, j)
        nxt = [pipe[(s + 1) % len(pipe)]] if k + 1 < len(plan.layer_ranges[d]) else []
        peers = nxt + ([pipe[s - 1]] if k else [])
        comm = sum(self.transfer_s(self.activation_bytes, rank, peer) for peer in peers
                   if peer != rank and self.activation_bytes)
        return compute + self.per_microbatch_stage_s + comm

    def exchange_s(self, plan: Plan, rank: int, nbytes: float, exchanges: int) -> float:
        """``rank``'s ``exchanges`` all-to-alls of ``nbytes`` in all (if all its rows left) in its
        expert-parallel group under ``plan``: ``(n - 1) / n`` of the bytes leave, over the group's
        slowest link, and each exchange pays its latency (sim/experts.py's pricing)."""
        group = plan.expert_group[rank] if plan.ep > 1 else (rank,)
        n = len(group)
        if n == 1:
            return 0.0
        one_node = len({r // self.devices_per_node for r in group}) == 1
        bw, lat = ((self.intra_node_bytes_per_s, self.intra_node_latency_s) if one_node
                   else (self.inter_node_bytes_per_s, self.inter_node_latency_s))
        return exchanges * lat + nbytes * (n - 1) / n / bw

    def virtual_stage_s(self, plan: Plan, d: int) -> tuple[float, ...]:
        """Pipeline ``d``'s :meth:`chunk_s` of every virtual stage ``k``, in order: chunk ``k // p``
        of rank ``pipe[k % p]`` (one per stage without virtual stages)."""
        pipe, num_virtual = plan.pipelines[d], len(plan.layer_ranges[d])
        return tuple(self.chunk_s(plan, pipe[k % len(pipe)], k // len(pipe)) for k in range(num_virtual))

    def stage_s(self, plan: Plan, rank: int) -> float:
        """One micro-batch's forward + backward on ``rank``, its chunks' together, with its sends."""
        return sum(self.chunk_s(plan, rank, v) for v in range(len(plan.chunk_ranges(rank))))


@dataclass(frozen=True)
class StepEstimate:
    step_s: float
    compute_s: float
    collective_s: float
    """What the collectives add to the compute: the sums that end after it, and the all-gathers."""
    samples: float
    """Micro-batches in the step, whole ones' worth (the global batch, unless a baseline dropped some)."""
    power_w: float

    @property
    def micro_batches_per_s(self) -> float:
        return self.samples / self.step_s


SCHEDULES = ("runtime", "lower_bound")


def step_time(plan: Plan, model: ClusterModel, schedule: str = "runtime") -> StepEstimate:
    """``schedule``: ``runtime``, the model's ``pipeline_schedule`` (1F1B, ZB-H1 or interleaved), or for a
    plan with detours the routed schedule the runtime runs (its bound where a connected set of routes has more
    than ``elaswave.pipeline.routed.EXACT_MAX_RANKS`` ranks); ``lower_bound``, what no schedule of the
    plan's routes can beat (:func:`~elaswave.sim.detours.routed_lower_bound`): how a baseline whose own schedule is not
    modelled is priced (:func:`~elaswave.sim.engine.simulate`)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is invalid: choose from {', '.join(SCHEDULES)}")
    if model.num_layers != plan.num_layers:
        raise ValueError(f"the cluster model has {model.num_layers} layers, the plan {plan.num_layers}")
    if plan.virtual_stages > 1 and model.pipeline_schedule != "interleaved":
        raise ValueError(f"the plan has {plan.virtual_stages} model chunks a rank, which only the interleaved "
                         f"schedule runs; the cluster model's pipeline_schedule is {model.pipeline_schedule!r}")
    virtual = {d: model.virtual_stage_s(plan, d) for d in range(len(plan.pipelines))}
    stage = {r: sum(virtual[d][s::len(pipe)]) for d, pipe in enumerate(plan.pipelines) for s, r in enumerate(pipe)}
    # A plan with detours: its routed schedule, each rank's forwards after its all-gathers and its sums
    # after its last backward (the runtime overlaps both there too); where that schedule is too large
    # to build, its bound, with every sum after the step's compute and every all-gather after that.
    released = (gather_releases(plan, model) if model.overlap_param_gather and schedule == "runtime"
                and model.layer_param_bytes else None)
    routed_ends = None
    if schedule == "lower_bound":
        compute = routed_lower_bound(plan, stage, virtual)
    elif plan.routes and (exact := routed_compute(plan, virtual, model.split_factor(plan), released,
                                                  model.pipeline_schedule)) is not None:
        compute, routed_ends = exact
    else:
        released = None if plan.routes else released
        compute = _analytic_compute(plan, stage, virtual, model.split_factor(plan), model.pipeline_schedule, released)
    if routed_ends is not None:
        times = routed_chunk_times(plan, virtual, routed_ends, model.split_factor(plan), model.pipeline_schedule)
    elif schedule == "runtime" and not plan.routes:
        times = _scheduled_chunk_times(plan, virtual, model.split_factor(plan), model.pipeline_schedule, released)
    else:
        times = None
    whole = _whole_at(plan, times, model.overlap_grad_reduce, model.layer_forward_s) if times is not None else None
    summed, gathers = overlapped_collectives_s(plan, model, whole or (lambda rank, layers: compute))
    step = max(compute, summed) + (0.0 if released is not None else gathers)
    power = sum(model.power.power(plan.frequency(r)) for r in plan.ranks)
    return StepEstimate(step + model.step_overhead_s, compute, step - compute,
                        plan.batch_units / plan.units_per_micro_batch, power)


def _whole_at(plan: Plan, chunk_times: Callable[[int], tuple[tuple[float, float], ...] | None], overlap: bool,
              layer_s: Sequence[float] = ()):
    """(rank, a bucket's layers) -> when their gradients are whole on the rank in the step:
    ``chunk_times(rank)``, each of its chunks' last backward (its end and its length; a tuple, as
    it keys a memo; None where the rank runs nothing), of the chunks that compute them, and within
    a whole backward once it has run the chunk's layers from the bucket's lowest up (zero/watch.py;
    shares by ``layer_s``, each layer's forward); without ``overlap``, when all the rank's chunks
    are done."""
    seen: dict[tuple, float] = {}  # at 10^4 devices most ranks repeat a few (ranges, times)

    def at(rank: int, layers: Sequence[int]) -> float:
        lowest = plan.layer_of(layers[0])  # (a bucket's units are in layer order)
        ranges, times = plan.chunk_ranges(rank), chunk_times(rank)
        key = (lowest, ranges, times)
        if key not in seen:
            seen[key] = _whole(rank, lowest, ranges, times)
        return seen[key]

    def _whole(rank: int, lowest: int, ranges, times) -> float:
        chunks = gradient_chunks(plan, rank, lowest)
        if not overlap and chunks:
            chunks = frozenset(range(plan.virtual_stages))
        if times is None or not chunks:
            return 0.0
        out = 0.0
        for c in chunks:
            end, backward = times[c]
            start, stop = ranges[c]
            # What it still runs below (the runtime counts a tied use's tensors too: one computed in
            # another chunk leaves the bucket to the backward's end there).
            if overlap and backward and len(chunks) == 1 and start <= lowest < stop and layer_s:
                end -= backward * sum(layer_s[start:lowest]) / (sum(layer_s[start:stop]) or 1.0)
            out = max(out, end)
        return out
    return at


def _scheduled_chunk_times(plan: Plan, virtual: dict[int, tuple[float, ...]], backward_factor: float, schedule: str,
                           released: dict[int, tuple[float, ...]] | None = None):
    """:func:`_whole_at`'s ``chunk_times`` by the schedule's own timing of each rank's pipeline, its
    forwards after the all-gathers they read (``released``: :func:`gather_releases`)."""
    by_pipeline: dict[int, tuple[tuple[float, float], ...]] = {}

    def times(rank: int) -> tuple[tuple[float, float], ...] | None:
        d, s = plan.position(rank)
        if not plan.micro_batches[d]:
            return None
        if d not in by_pipeline:
            m = len(plan.micro_batches[d])
            sizes = (tuple(plan.units_of(mb) / plan.units_per_micro_batch for mb in plan.micro_batches[d])
                     if plan.micro_batch_units else m)
            by_pipeline[d] = _gradients_whole(schedule, virtual[d], sizes, backward_factor, plan.virtual_stages,
                                              _released_of(plan, d, released))
        return by_pipeline[d][s::len(plan.pipelines[d])]
    return times


@lru_cache(maxsize=4096)
def _gradients_whole(schedule: str, times: tuple[float, ...], m: int | tuple[float, ...], backward_factor: float,
                     num_chunks: int, released: tuple[float, ...] | None = None) -> tuple[tuple[float, float], ...]:
    count, sizes = (len(m), m) if isinstance(m, tuple) else (m, None)
    num_stages = len(times) // num_chunks
    return gradients_whole([stage_schedule(schedule, s, num_stages, range(count), num_chunks)
                            for s in range(num_stages)], times, backward_factor, sizes=sizes, released=released)


def gather_releases(plan: Plan, model: ClusterModel) -> dict[int, tuple[float, ...]]:
    """Each rank's model chunks -> when the step's first forward of each may start: the
    all-gathers (zero/reduce.Gathering) start with the step in the runtime's order -- the first
    layers first --, a rank's one after another on its link, each done when its slowest holder's
    is; the forward waits before each layer for the bucket it reads (and a tied use for its
    owner's), so it may start early by the forward time of the layers before that one."""
    buckets = plan.gradient_buckets()
    free: dict[int, float] = {}
    ends: dict[tuple[int, int], float] = {}
    for i in sorted(range(len(buckets)), key=lambda i: (min(map(plan.layer_of, buckets[i][1])), i)):
        holders, layers = buckets[i]
        took = _holder_parts(model, holders, sum(model.layer_param_bytes[k] for k in layers))[1]
        for h in holders:
            free[h] = ends[(h, i)] = free.get(h, 0.0) + took
    # Each holder's link, not the ring, is the queue: holder groups are process groups of their own,
    # whose collectives gloo and NCCL run side by side. (Starting a ring only once every holder was
    # free of its earlier ones chained a re-split pipeline's groups through all 16 stages of Llama 3
    # 405B: releases of 3.7 s in a 6.6 s step, a serialisation neither backend makes.)
    done: dict[int, float] = {}  # by layer: when its units' all-gathers are done on every holder
    for i, (holders, layers) in enumerate(buckets):
        for unit in layers:
            layer = plan.layer_of(unit)
            done[layer] = max(done.get(layer, 0.0), max(ends[(h, i)] for h in holders))
    owners: dict[int, list[int]] = {}
    for owner, user in plan.ties:
        owners.setdefault(user, []).append(owner)
    out: dict[int, tuple[float, ...]] = {}
    seen: dict[tuple, tuple[float, ...]] = {}  # by (chunk ranges, clock): most ranks repeat a few
    for r in plan.ranks:
        key = (plan.chunk_ranges(r), plan.frequency(r))
        if key not in seen:
            at = []
            for start, end in key[0]:
                release, before = 0.0, 0.0
                for layer in range(start, end):
                    need = max([done.get(layer, 0.0), *(done.get(o, 0.0) for o in owners.get(layer, ()))])
                    release = max(release, need - before)
                    before += model.layer_forward_s[layer] / key[1]
                at.append(release)
            seen[key] = tuple(at)
        out[r] = seen[key]
    return out


def _released_of(plan: Plan, d: int, released: dict[int, tuple[float, ...]] | None) -> tuple[float, ...] | None:
    """Pipeline ``d``'s releases by virtual stage (``chunk * p + stage``), or None where none waits."""
    if released is None:
        return None
    pipe = plan.pipelines[d]
    out = tuple(released.get(r, (0.0,) * plan.virtual_stages)[c] for c in range(plan.virtual_stages) for r in pipe)
    return out if any(out) else None


def _analytic_compute(plan: Plan, stage: dict[int, float], virtual: dict[int, tuple[float, ...]],
                      backward_factor: float, schedule: str,
                      released: dict[int, tuple[float, ...]] | None = None) -> float:
    guests: dict[int, int] = {}
    for _, route in plan.routes:
        for r in route:
            guests[r] = guests.get(r, 0) + 1
    compute = 0.0
    for d, pipe in enumerate(plan.pipelines):
        m = len(plan.micro_batches[d])
        if m == 0 or not plan.is_complete(d):
            continue  # an idle pipeline (drop_replica), or one whose micro-batches take detours
        if not any(guests.get(r) for r in pipe):
            sizes = tuple(plan.units_of(mb) / plan.units_per_micro_batch for mb in plan.micro_batches[d])
            compute = max(compute, pipeline_compute_s(schedule, virtual[d], sizes if plan.micro_batch_units else m,
                                                      backward_factor, plan.virtual_stages,
                                                      _released_of(plan, d, released)))
            continue
        times = tuple(stage[r] for r in pipe)
        # A host of detours: fill and drain once, then the slowest stage sets the pace for its
        # own and its guests' micro-batches (a bound: the routed schedule prices it exactly).
        busiest = max(t * (m + guests.get(r, 0)) for r, t in zip(pipe, times))
        compute = max(compute, busiest + (len(pipe) - 1) * max(times))
    return compute


@lru_cache(maxsize=4096)
def pipeline_compute_s(schedule: str, times: tuple[float, ...], m: int | tuple[float, ...],
                       backward_factor: float, num_chunks: int = 1, released: tuple[float, ...] | None = None) -> float:
    """One pipeline's compute under ``schedule`` on virtual stages of ``times`` (forward + backward
    per micro-batch, index ``chunk * p + stage``; the stages' own with ``num_chunks`` 1). ``m``: the
    count of whole micro-batches, or each one's size (reshaped).

    Without chunks, :func:`~elaswave.pipeline.schedule.schedule_makespan` (1F1B's closed timing).
    With chunks, :func:`~elaswave.pipeline.schedule.makespan` of the schedule's own action lists on
    each chunk's own time, not ``schedule_makespan``'s even split of a rank's time over its chunks:
    the planner's p x V minimax partition leaves chunks uneven (whole layers a chunk; the embedding
    and the head cost unlike a block), and fill and drain are set by the first and last chunks, not
    by a rank's average. ``released``: by virtual stage, when its first forward may start (its
    parameters' all-gather, :func:`gather_releases`)."""
    # At 10^4+ devices most pipelines have the same stage times: each kind is timed once.
    count, sizes = (len(m), m) if isinstance(m, tuple) else (m, None)
    if num_chunks == 1 and released is None:
        return schedule_makespan(schedule, times, count, backward_factor, sizes)
    num_stages = len(times) // num_chunks
    return makespan([stage_schedule(schedule, s, num_stages, range(count), num_chunks) for s in range(num_stages)],
                    times, backward_factor, sizes=sizes, released=released)


def ring_s(n: int, nbytes: float, latency_s: float, bytes_per_s: float) -> float:
    """One ring reduce-scatter or all-gather of ``nbytes`` over ``n`` ranks: ``n-1`` hops, each a
    latency and an ``n``-th of the bytes."""
    return (n - 1) * (latency_s + nbytes / n / bytes_per_s) if n > 1 else 0.0


def overlapped_collectives_s(plan: Plan, model: ClusterModel,
                             whole_at: Callable[[int, Sequence[int]], float]) -> tuple[float, float]:
    """(when the step's last gradient sum ends, the busiest rank's parameter all-gathers after it).
    Each bucket's sum can start, as the runtime starts it (zero/reduce.Reduction), once every
    holder has made its gradients whole (``whole_at``: by rank and the bucket's layers); a rank's link runs
    its sums one after another as they come (so when all come at once, the busiest rank's sum --
    a rank holds layers of several groups after an uneven re-split). The all-gathers follow the
    optimizer, each rank's one after another."""
    if not model.layer_param_bytes:
        return 0.0, 0.0
    sums: dict[int, list[tuple[float, float]]] = {}
    gathers: dict[int, float] = {}
    for holders, layers in plan.gradient_buckets():
        summed, gathered = _holder_parts(model, holders, sum(model.layer_param_bytes[k] for k in layers))
        start = max(whole_at(h, layers) for h in holders)
        for h in holders:
            sums.setdefault(h, []).append((start, summed))
            gathers[h] = gathers.get(h, 0.0) + gathered
    end = 0.0
    for queue in sums.values():
        free = 0.0
        for start, took in sorted(queue):
            free = max(free, start) + took
        end = max(end, free)
    return end, max(gathers.values(), default=0.0)


def holder_collectives_s(model: ClusterModel, holders: Sequence[int], param_bytes: float) -> float:
    """A holder group's gradient sum and parameter all-gather in one step, over its slowest link."""
    return sum(_holder_parts(model, holders, param_bytes))


def _holder_parts(model: ClusterModel, holders: Sequence[int], param_bytes: float) -> tuple[float, float]:
    """(the gradient sum, the parameter all-gather) of :func:`holder_collectives_s`."""
    n = len(holders)
    nodes = {h // model.devices_per_node for h in holders}
    bw, lat = ((model.intra_node_bytes_per_s, model.intra_node_latency_s) if len(nodes) == 1
               else (model.inter_node_bytes_per_s, model.inter_node_latency_s))
    reduce = ring_s(n, param_bytes * model.gradient_bytes_factor, lat, bw) * (2 if model.reduce_is_all_reduce else 1)
    return reduce, ring_s(n, param_bytes, lat, bw)
