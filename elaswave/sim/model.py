"""What a plan costs on a modelled cluster (pure): step time, power, recovery and migration times.

The same :class:`~elaswave.plan.plan.Plan` the runtime trains with is priced here:

- a stage's time per micro-batch is its layers' forward + backward time at its frequency level,
  plus a fixed cost per micro-batch and stage (dispatch, and the activation's send and the
  gradient's send back over the link to the neighbour: intra- or inter-node by placement);
- a complete pipeline's compute is the time of the schedule the runtime runs on its stages
  (``pipeline_schedule``, ``parallel.schedule``: 1F1B or ZB-H1), the same action lists the
  runtime executes timed by :func:`~elaswave.pipeline.schedule.makespan`: fill and drain from the
  real stage times, not ``(S - 1)`` times the slowest; ZB-H1's split backward priced with B and W
  each half of a backward (``BACKWARD_INPUT_SHARE``, an assumption). A plan with detours (the
  reroute baseline) is timed by the routed scheduler the runtime runs whatever
  ``pipeline_schedule`` says (the runtime runs that one there too), and above its size limit a
  rank that hosts detoured micro-batches is bounded by its own and its guests' work plus one fill
  at the slowest stage. The ``lower_bound`` pricing (:func:`routed_lower_bound`) does not depend
  on the schedule;
- the step ends when the slowest pipeline has finished and the slowest holder group has summed
  its gradients and re-gathered its parameters (ring algorithms over the group's slowest link: a
  reduce-scatter and an all-gather each move ``(n-1)/n`` of the bytes in ``n-1`` hops; gloo sums
  with a whole all-reduce, twice that), plus a fixed per-step cost (norm, optimizer, launch).

Devices are numbered node-major (``devices_per_node`` per node) as the launchers number ranks.
With tensor parallelism a device of the plan is a TP group of GPUs inside a node
(:func:`~elaswave.sim.workload.cluster`): its layers' times are a shard's, plus the group's
all-reduces (``layer_tp_s``), and ``devices_per_node`` counts groups.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Sequence

from elaswave.pipeline import routed
from elaswave.pipeline.schedule import GENERATORS, schedule_makespan
from elaswave.plan.frequency import PowerModel
from elaswave.plan.plan import Plan


UNPRICED = {"interleaved": "the runtime runs it; the simulator's plans hold one model chunk a rank, so it "
                          "does not price it yet"}
"""Schedules the runtime runs that the simulator refuses, and why."""


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
    # Recovery, in seconds (elaswave's measured phases; the baselines' own figures live with them).
    detect_s: float = 0.05
    agree_s: float = 0.01
    communicator_s: float = 0.0
    plan_s: float = 0.001
    pipeline_schedule: str = "1f1b"
    """The schedule a complete pipeline without detours runs (``parallel.schedule``): 1f1b or zb-h1."""

    def __post_init__(self) -> None:
        priced = [name for name in GENERATORS if name not in UNPRICED]
        if self.pipeline_schedule not in priced:
            raise ValueError(f"pipeline_schedule={self.pipeline_schedule!r} is invalid: choose from {', '.join(priced)}"
                             + (f" ({UNPRICED[self.pipeline_schedule]})" if self.pipeline_schedule in UNPRICED else ""))

    @property
    def num_layers(self) -> int:
        return len(self.layer_forward_s)

    def same_node(self, a: int, b: int) -> bool:
        return a // self.devices_per_node == b // self.devices_per_node

    def transfer_s(self, nbytes: float, a: int, b: int) -> float:
        if self.same_node(a, b):
            return self.intra_node_latency_s + nbytes / self.intra_node_bytes_per_s
        return self.inter_node_latency_s + nbytes / self.inter_node_bytes_per_s

    def stage_s(self, plan: Plan, rank: int, nxt: int | None, prev: int | None) -> float:
        """One micro-batch's forward + backward on ``rank``'s stage, with its sends."""
        i, j = plan.layers_of(rank)
        compute = sum(self.layer_forward_s[i:j]) * (1 + self.backward_factor) / self.power.speed(plan.frequency(rank))
        if self.layer_tp_s:
            compute += 2 * sum(self.layer_tp_s[i:j])
        comm = sum(self.transfer_s(self.activation_bytes, rank, peer) for peer in (nxt, prev)
                   if peer is not None and self.activation_bytes)
        return compute + self.per_microbatch_stage_s + comm


@dataclass(frozen=True)
class StepEstimate:
    step_s: float
    compute_s: float
    collective_s: float
    samples: float
    """Micro-batches in the step, whole ones' worth (the global batch, unless a baseline dropped some)."""
    power_w: float

    @property
    def micro_batches_per_s(self) -> float:
        return self.samples / self.step_s


SCHEDULES = ("runtime", "lower_bound")


def step_time(plan: Plan, model: ClusterModel, schedule: str = "runtime") -> StepEstimate:
    """``schedule``: ``runtime``, the model's ``pipeline_schedule`` (1F1B or ZB-H1), or for a plan
    with detours the routed schedule the runtime runs (its bound above ``routed.EXACT_MAX_RANKS``); ``lower_bound``, what no schedule of the
    plan's routes can beat (:func:`routed_lower_bound`): how a baseline whose own schedule is not
    modelled is priced (:func:`~elaswave.sim.engine.simulate`)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is invalid: choose from {', '.join(SCHEDULES)}")
    if model.num_layers != plan.num_layers:
        raise ValueError(f"the cluster model has {model.num_layers} layers, the plan {plan.num_layers}")
    stage: dict[int, float] = {}
    for pipe in plan.pipelines:
        for s, r in enumerate(pipe):
            stage[r] = model.stage_s(plan, r, pipe[s + 1] if s + 1 < len(pipe) else None, pipe[s - 1] if s else None)
    if schedule == "lower_bound":
        compute = routed_lower_bound(plan, stage)
    elif plan.routes and len(plan.ranks) <= routed.EXACT_MAX_RANKS:
        compute = _routed_compute(plan, stage, model.backward_factor)
    else:
        compute = _analytic_compute(plan, stage, model.backward_factor, model.pipeline_schedule)
    collective = max((holder_collectives_s(model, holders, sum(model.layer_param_bytes[i] for i in layers))
                      for holders, layers in plan.holder_groups().items()), default=0.0) if model.layer_param_bytes else 0.0
    power = sum(model.power.power(plan.frequency(r)) for r in plan.ranks)
    return StepEstimate(compute + collective + model.step_overhead_s, compute, collective,
                        plan.batch_units / plan.units_per_micro_batch, power)


def _analytic_compute(plan: Plan, stage: dict[int, float], backward_factor: float, schedule: str) -> float:
    guests: dict[int, int] = {}
    for _, route in plan.routes:
        for r in route:
            guests[r] = guests.get(r, 0) + 1
    compute = 0.0
    for d, pipe in enumerate(plan.pipelines):
        m = len(plan.micro_batches[d])
        if m == 0 or not plan.is_complete(d):
            continue  # an idle pipeline (drop_replica), or one whose micro-batches take detours
        times = tuple(stage[r] for r in pipe)
        if not any(guests.get(r) for r in pipe):
            sizes = tuple(plan.units_of(mb) / plan.units_per_micro_batch for mb in plan.micro_batches[d])
            compute = max(compute, pipeline_compute_s(schedule, times, sizes if plan.micro_batch_units else m, backward_factor))
            continue
        # A host of detours: fill and drain once, then the slowest stage sets the pace for its
        # own and its guests' micro-batches (a bound: the routed schedule prices it exactly).
        busiest = max(t * (m + guests.get(r, 0)) for r, t in zip(pipe, times))
        compute = max(compute, busiest + (len(pipe) - 1) * max(times))
    return compute


@lru_cache(maxsize=4096)
def pipeline_compute_s(schedule: str, times: tuple[float, ...], m: int | tuple[float, ...],
                       backward_factor: float) -> float:
    """One pipeline's compute under ``schedule`` (:func:`~elaswave.pipeline.schedule.schedule_makespan`)
    on stages of ``times`` (forward + backward per micro-batch). ``m``: the count of whole
    micro-batches, or each one's size (reshaped)."""
    # At 10^4+ devices most pipelines have the same stage times: each kind is timed once.
    if isinstance(m, tuple):
        return schedule_makespan(schedule, times, len(m), backward_factor, m)
    return schedule_makespan(schedule, times, m, backward_factor)


def _routed_compute(plan: Plan, stage: dict[int, float], backward_factor: float) -> float:
    routes, home = routed.routes_of(plan.pipelines, plan.micro_batches, plan.route_of)
    _, makespan = routed.routed_schedules(routes, home, {r: t / (1 + backward_factor) for r, t in stage.items()},
                                          backward_factor)
    return makespan


def routed_lower_bound(plan: Plan, stage: dict[int, float]) -> float:
    """No schedule of the plan's routes finishes sooner: some rank must run every forward and
    backward that passes through it (``stage[r]`` each), cannot start before the first of them has
    come through the stages before it (their forwards), and after its last backward that one still
    goes back through them (their backwards). A schedule that fills bubbles perfectly -- ReCycle's
    decoupled backward passes aim at it -- reaches this; the runtime's greedy one runs above it."""
    routes, _ = routed.routes_of(plan.pipelines, plan.micro_batches, plan.route_of)
    work: dict[int, float] = {}
    upstream: dict[int, float] = {}
    for mb, route in routes.items():
        size = plan.units_of(mb) / plan.units_per_micro_batch if plan.micro_batch_units else 1.0
        before = 0.0
        for r in route:
            work[r] = work.get(r, 0.0) + stage[r] * size
            upstream[r] = min(upstream.get(r, before), before)
            before += stage[r] * size
    # Fill (the forwards before r) and drain (the backwards before r), each at least the cheapest
    # route's to r: together its whole upstream forward + backward.
    return max(w + upstream[r] for r, w in work.items())


def ring_s(n: int, nbytes: float, latency_s: float, bytes_per_s: float) -> float:
    """One ring reduce-scatter or all-gather of ``nbytes`` over ``n`` ranks: ``n-1`` hops, each a
    latency and an ``n``-th of the bytes."""
    return (n - 1) * (latency_s + nbytes / n / bytes_per_s) if n > 1 else 0.0


def holder_collectives_s(model: ClusterModel, holders: Sequence[int], param_bytes: float) -> float:
    """A holder group's gradient sum and parameter all-gather in one step, over its slowest link."""
    n = len(holders)
    nodes = {h // model.devices_per_node for h in holders}
    bw, lat = ((model.intra_node_bytes_per_s, model.intra_node_latency_s) if len(nodes) == 1
               else (model.inter_node_bytes_per_s, model.inter_node_latency_s))
    reduce = ring_s(n, param_bytes * model.gradient_bytes_factor, lat, bw) * (2 if model.reduce_is_all_reduce else 1)
    return reduce + ring_s(n, param_bytes, lat, bw)


def migration_s(before: Plan, after: Plan, model: ClusterModel) -> float:
    """State that moves in a re-plan, as disjoint transfers in parallel: the slowest receiver's
    bytes over its link. A rank receives the ZeRO state (3x the parameters) of chunks it newly owns
    and the parameters of layers it newly holds."""
    if not model.layer_param_bytes:
        return 0.0
    incoming: dict[int, float] = {}
    for r in after.ranks:
        new = after.layers_of(r)
        try:
            prev = before.layers_of(r)
        except KeyError:
            prev = (0, 0)
        if new != prev:
            incoming[r] = sum(model.layer_param_bytes[layer] for layer in range(*new)
                              if not prev[0] <= layer < prev[1])
    for layer, (old_row, new_row) in enumerate(zip(before.chunk_owners, after.chunk_owners)):
        per_chunk = 3 * model.layer_param_bytes[layer] / max(1, len(new_row))
        for o, n in zip(old_row, new_row):
            if o != n:
                incoming[n] = incoming.get(n, 0.0) + per_chunk
    worst = max(incoming.values(), default=0.0)
    return worst / model.inter_node_bytes_per_s if worst else 0.0
