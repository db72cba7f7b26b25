"""How each system answers a change of membership, as the simulator prices it (pure).

Every policy turns the live devices into a plan with the runtime's own planner
(:func:`~elaswave.plan.replan.replan`, which gives the layout for any set of losses) and says what the
change costs. Every policy starts from the same failure-free plan (:func:`failure_free`): with
clocks planned, the frequency planner's levels on every device, so the rate before a failure is
equal across policies and the ratios after it measure recovery alone. After a change only
elaswave re-plans clocks: a baseline's device keeps its clock from that plan while it keeps its
stage, and runs at nominal when given other layers (:func:`static_clocks`); a system that deals its
batch by pipeline speed deals it at those clocks; a restarted job plans its clocks anew. Every plan of every policy is priced alike
(:func:`~elaswave.sim.engine.priced`). Assumptions, per system:

- **elaswave**: broken pipelines re-partitioned over their survivors, micro-batches rebalanced,
  frequency levels planned within the live devices' nominal power; recovery is detection +
  agreement + standby communicator + plan + state migration (the slowest receiver's bytes), and the
  interrupted step is redone. A returning device is admitted at a step boundary: its pipeline gets
  its layout back and it receives its state (no work lost). Its control-plane options
  (:class:`~elaswave.sim.control.Control`): warm spares that take a failed device's place, and the
  store's host lost with a failure -- the floor (a restart from the last committed step, written on
  the way out: heartbeat timeout + checkpoint write + ``restart_s``) or failover (the ordinary
  recovery + heartbeat timeout + the store's move).
- **elaswave_no_dvfs**: elaswave without re-planning clocks after a change (the re-partition and
  micro-batch balance alone; the failure-free clocks kept as the baselines keep them): how much of
  elaswave's recovery comes from clocks. With no level above nominal (a device already at its
  sustained clock under its power limit) the planner can only lower waiting stages, which saves
  energy but no time: its throughput is this row's.
- **restart** (TorchElastic): every change restarts the job from its last checkpoint: process
  start + checkpoint load (``restart_s``) and the work since the checkpoint is redone (on average
  half a checkpoint interval); the job runs with as many whole pipelines as the live devices fill,
  the global batch kept.
- **drop_replica** (TorchFT): the broken pipeline's survivors stand idle and its micro-batches are
  skipped (the global batch shrinks); detection waits for the lighthouse heartbeat timeout
  (``torchft_detect_s``); a returning device rejoins once its whole pipeline is up, after a state
  transfer from a peer.
- **reroute** (ReCycle): the layout stays; the broken pipeline's micro-batches pass through the
  same stage of the other pipelines; recovery is detection + a communicator built for the new
  routes (``partial_rebuild_s``); no state moves. Its steps are priced at the routes' lower bound
  (:func:`~elaswave.sim.detours.routed_lower_bound`: the busiest device's own and rerouted work plus
  its fill and drain): ReCycle's decoupled-backward schedule, which fills the bubbles, is not
  modelled, so it is given the best any schedule could do. elaswave's own detours are priced by the
  schedule its runtime runs. With interleaved pipelines the same, a route naming the rank of each
  virtual stage (each lost chunk on the next host in turn, as ``elastic.policy=reroute`` runs it).
- **reroute_runtime**: the same routes priced by the schedule elaswave's runtime runs for
  ``elastic.policy=reroute`` (each guest in its host's own order, :mod:`~elaswave.pipeline.routed`):
  what a rerouted job reaches here, beside the bound no schedule of those routes beats.
- **templates** (Oobleck): pipelines re-instantiated from precomputed templates over the live
  devices -- the broken pipeline becomes a template one stage shorter -- without frequency
  planning; the re-instantiated pipeline's ranks copy all their layers' state from peers and every
  communicator is rebuilt (``full_rebuild_s``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from elaswave.plan import microbatches
from elaswave.plan.frequency import PowerModel
from elaswave.plan.plan import Plan, PlanError, initial_plan
from elaswave.plan.replan import replan
from elaswave.plan.recompute import fit_recomputation
from elaswave.sim.control import Control, slot_events
from elaswave.sim.model import ClusterModel
from elaswave.sim.moves import held_units, migration_s
from elaswave.sim.trace import Event

POLICIES = ("elaswave", "elaswave_no_dvfs", "reroute", "drop_replica", "restart", "templates")
CHOICES = POLICIES + ("static_experts", "reroute_runtime")
"""What ``--policies`` may name: the default set, the static-expert-map baseline (a mixture of
experts' comparison: elaswave with its experts' re-placement off) and reroute priced by the
runtime's routed schedule instead of its lower bound."""


@dataclass(frozen=True)
class BaselineCosts:
    """Seconds the baselines' own machinery takes. Defaults: our measurements on a 2-core CPU box
    (``../shared/FACTS.md``, ``bench/results``); set them for the cluster you model."""

    restart_s: float = 7.3
    """Restart to the first step on loaded state (torchrun --max-restarts=1, GPT dp=4 on the 2-core
    box: 7.300 s of its 7.805 s MTTR, ``bench/results/elastic.md``, 2026-11-22)."""
    checkpoint_every_s: float = 600.0
    torchft_detect_s: float = 5.15
    """TorchFT's lighthouse heartbeat timeout (default settings, measured)."""
    torchft_rejoin_s: float = 3.37
    partial_rebuild_s: float = 0.0045
    full_rebuild_s: float = 0.028


@dataclass(frozen=True)
class Change:
    plan: Plan | None
    """None: the policy cannot train on these devices (it waits for a repair)."""
    downtime_s: float
    """No training from the change until this much later."""
    lost_work_s: float
    """Training time whose result is thrown away (redone)."""
    store_lost: bool = False
    """The failure took the control store's host with it (priced by the policy's store option)."""


class Policy:
    """``layout(every device)`` is the failure-free plan every policy starts from (``start``)."""

    name = ""

    def __init__(self, initial: Plan, num_micro_batches: int, model: ClusterModel, costs: BaselineCosts,
                 control: Control = Control(), start: Plan | None = None):
        self.initial, self.m, self.model, self.costs, self.control = initial, num_micro_batches, model, costs, control
        self.start = start if start is not None else initial
        self.devices = len(initial.ranks)
        self.spares = control.spares
        """Idle devices the job holds beside its layout (charged in ETTR over every device)."""

    def slot_events(self, events: Sequence[Event]) -> list[Event]:
        """The trace as the job's places in the plan see it: with spares, a spare's arrival in a
        failed device's place is an event of kind ``spare`` (:func:`~elaswave.sim.control.slot_events`)."""
        return slot_events(events, self.control.spares, self.control.join_s)

    def respond(self, prev: Plan | None, live: Sequence[int], event: Event, step_s: float) -> Change:
        """The change ``event`` brings, the live devices already updated. A spare's arrival is a
        join of its own (the runtime's: survivors recover first, the spare joins at a step boundary)."""
        return self.change(prev, live, event.kind != "fail", step_s)

    deal = ""
    """How the system deals its batch by its pipelines' speeds after a change (static_clocks)."""
    schedule = "runtime"
    """How a plan of it with detours is priced (:func:`~elaswave.sim.model.step_time`)."""

    def layout(self, live: Sequence[int]) -> Plan:
        if len(live) == self.devices:
            return self.start
        return static_clocks(self.rebuild(live), self.start, self.deal, self.model.power)

    def rebuild(self, live: Sequence[int]) -> Plan:
        """The system's own layout on ``live`` (fewer than every device), before clocks."""
        return replan(self.start, live, 1, self.m, policy=self.name, schedule=self.model.pipeline_schedule)

    def change(self, prev: Plan | None, live: Sequence[int], joined: bool, step_s: float) -> Change:
        raise NotImplementedError

    def _try(self, live: Sequence[int]) -> Plan | None:
        try:
            return self.layout(live)
        except PlanError:
            return None


def failure_free(initial: Plan, num_micro_batches: int, power: PowerModel | None) -> Plan:
    """The plan every policy starts from: with ``power``, the frequency planner's levels within the
    devices' nominal power (it evens out an uneven first partition); without, ``initial``."""
    if power is None:
        return initial
    return replan(initial, initial.ranks, 1, num_micro_batches, policy="elaswave", power=power,
                  power_cap_w=power.power(1.0) * len(initial.ranks))


def static_clocks(plan: Plan, start: Plan, deal: str = "", power: PowerModel | None = None) -> Plan:
    """``plan`` with each rank that kept its stage (its layers, every chunk's) at its level in ``start``, and every
    other at nominal: the clocks of a system that sets them once and does not re-plan them.
    ``deal``: how a system that balances its batch by pipeline speed then deals it at those clocks
    -- ``micro_batches`` whole, ``units`` reshaped (:mod:`~elaswave.plan.microbatches`); else a
    pipeline the failure-free plan boosted and gave more micro-batches would be dealt as if nominal.
    ``power``: how a level's clock speeds a stage (default: in proportion)."""
    if not start.frequencies or plan.frequencies:
        return plan

    def level(r: int) -> float:
        kept = r in start._where and start.chunk_ranges(r) == plan.chunk_ranges(r)
        return start.frequency(r) if kept else 1.0
    levels = tuple(tuple(level(r) for r in pipe) for pipe in plan.pipelines)
    clocked = replace(plan, frequencies=levels)
    run = [d for d, mbs in enumerate(plan.micro_batches) if mbs]
    if not deal or plan.routes or not run:
        return clocked
    costs = plan.layer_costs or (1.0,) * plan.num_layers
    speed = power.speed if power is not None else float
    stage_s = [[sum(sum(costs[i:j]) for i, j in plan.chunk_ranges(r)) / speed(f)
                for r, f in zip(plan.pipelines[d], levels[d])] for d in run]
    shape = [max(p) for p in stage_s], [len(p) for p in stage_s], [sum(p) - max(p) for p in stage_s]
    whole = plan.batch_units // plan.units_per_micro_batch
    if deal == "units" and plan.units_per_micro_batch > 1:
        counts, units = microbatches.reshape(whole, plan.units_per_micro_batch, *shape)
    else:
        counts, units = microbatches.balance(whole, *shape), ()
    dealt = dict(zip(run, counts))
    # Another deal keeps other micro-batches in flight: what each rank recomputes is chosen again.
    return fit_recomputation(replace(clocked, micro_batches=tuple(dealt.get(d, ()) for d in range(len(plan.pipelines))),
                                     micro_batch_units=units))


class Elaswave(Policy):
    name = "elaswave"
    deal = "units"

    def respond(self, prev, live, event, step_s):
        ordinary = super().respond(prev, live, event, step_s)
        if event.kind != "fail" or not self.control.loses_store(event.device, self.model.devices_per_node):
            return ordinary
        c = self.control.costs
        if self.control.store == "failover":
            return Change(ordinary.plan, ordinary.downtime_s + c.store_detect_s + c.store_move_s,
                          ordinary.lost_work_s, store_lost=True)
        # The floor: every rank writes the last committed step and exits; the job restarts on the
        # live devices and loads it (restart_s covers the load, so no state moves between ranks).
        return Change(ordinary.plan, c.store_detect_s + c.checkpoint_write_s + self.costs.restart_s,
                      ordinary.lost_work_s, store_lost=True)

    def layout(self, live: Sequence[int]) -> Plan:
        if len(live) == self.devices or self.power is None:
            return super().layout(live)
        # The cap is the live devices' nominal power (the runtime's default): a lost device's share
        # does not boost the survivors, so no failure can buy speed the job could not have had.
        power = self.power
        return replan(self.start, live, 1, self.m, policy="elaswave", power=power,
                      power_cap_w=power.power(1.0) * len(live), schedule=self.model.pipeline_schedule)

    def rebuild(self, live: Sequence[int]) -> Plan:
        return replan(self.start, live, 1, self.m, policy="elaswave", schedule=self.model.pipeline_schedule)

    @property
    def power(self) -> PowerModel | None:
        """The frequency levels and power curve it re-plans with after a change (None: none)."""
        return self.model.power if self.start.frequencies else None

    def change(self, prev, live, joined, step_s):
        plan = self._try(live)
        m = self.model
        control = (m.agree_s + m.plan_s) if joined else (m.detect_s + m.agree_s + m.communicator_s + m.plan_s)
        move = migration_s(prev, plan, m) if prev is not None and plan is not None else 0.0
        return Change(plan, control + move, 0.0 if joined else step_s / 2)


class ElaswaveNoDvfs(Elaswave):
    name = "elaswave_no_dvfs"

    @property
    def power(self) -> PowerModel | None:
        return None


class StaticExperts(Elaswave):
    """elaswave's recovery with a static expert map, the baseline to its re-placement by load: a
    lost owner's experts all go to one backup member of its group (its first), none move after.
    (Megatron and DeepSpeed fix each expert's rank; this is that map with a backup, not elaswave.)"""
    name = "static_experts"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.start = replace(self.start, expert_map="static")


class Restart(Policy):
    name = "restart"

    def rebuild(self, live: Sequence[int]) -> Plan:
        """The restarted job's plan: whole pipelines of the first one's depth on the live devices (a
        multiple of ``ep`` of them, as its configuration must have),
        planned as the first one was -- its memory limit and model (a partition that fits, the
        blocks to recompute), its ties and units. (Before session 44 it dropped the memory limit:
        a restarted 1F1B job's plan need not have fitted.)"""
        first = self.initial
        pp = len(first.pipelines[0])
        dp = len(live) // pp // first.ep * first.ep  # (a job's data-parallel ranks are whole expert-parallel groups)
        if dp < 1:
            raise PlanError(f"{len(live)} devices cannot hold {first.ep} {pp}-stage pipeline(s)")
        # With expert parallelism, whole hosts first (a host that lost a GPU is left out where the rest
        # suffice), in device order: each stage's expert-parallel group stays inside a host, as in the
        # first layout. (Dense jobs keep the live devices in order, as the published figures priced.)
        per, alive = self.model.devices_per_node, set(live)
        broken = {r // per for r in range(self.devices) if r not in alive} if first.ep > 1 else set()
        ranks = sorted(sorted(live, key=lambda r: (r // per in broken, r))[:dp * pp])
        chunk = first.memory.chunk_numel if first.memory is not None else 1
        numels = [len(row) * chunk for row in first.chunk_owners] if first.chunk_owners else ()
        base = initial_plan(dp * pp, dp, pp, first.layer_costs, self.m, numels, chunk,
                            stage_memory_limit=first.stage_memory_limit, ties=first.ties, memory=first.memory,
                            units_per_micro_batch=first.units_per_micro_batch, virtual_stages=first.virtual_stages,
                            bucket_starts=first.bucket_starts, unit_layers=first.unit_layers, ep=first.ep)
        # The restarted job numbers its ranks afresh; place them on the live devices, in order.
        rename = dict(enumerate(ranks))
        return replace(base, pipelines=tuple(tuple(rename[r] for r in p) for p in base.pipelines),
                       chunk_owners=tuple(tuple(rename[r] for r in row) for row in base.chunk_owners),
                       expert_holders=tuple(tuple(rename[r] for r in row) for row in base.expert_holders))

    def layout(self, live: Sequence[int]) -> Plan:
        if len(live) == self.devices:
            return self.start
        # A restarted job plans its clocks as the failure-free job did, within the live devices' power.
        plan = self.rebuild(live)
        power = self.model.power if self.start.frequencies else None
        return failure_free(plan, self.m, power) if power is not None else plan

    def change(self, prev, live, joined, step_s):
        c = self.costs
        return Change(self._try(live), c.restart_s, c.checkpoint_every_s / 2)

    def respond(self, prev, live, event, step_s):
        if event.kind == "spare":
            # The restart after the failure is still under way (a spare's join time < restart_s):
            # the restarted job takes the spare into its world, at no cost of its own.
            return Change(self._try(live), 0.0, 0.0)
        return super().respond(prev, live, event, step_s)


class DropReplica(Policy):
    name = "drop_replica"

    def change(self, prev, live, joined, step_s):
        c = self.costs
        return Change(self._try(live), c.torchft_rejoin_s if joined else c.torchft_detect_s,
                      0.0 if joined else step_s / 2)


class Reroute(Policy):
    name = "reroute"
    schedule = "lower_bound"  # ReCycle's decoupled-backward schedule is not modelled: its best case

    def change(self, prev, live, joined, step_s):
        m, c = self.model, self.costs
        control = m.detect_s + m.agree_s + c.partial_rebuild_s + m.plan_s
        return Change(self._try(live), control, 0.0 if joined else step_s / 2)


class RerouteRuntime(Reroute):
    name = "reroute_runtime"
    schedule = "runtime"

    def rebuild(self, live: Sequence[int]) -> Plan:
        return replan(self.start, live, 1, self.m, policy="reroute", schedule=self.model.pipeline_schedule)


class Templates(Policy):
    name = "templates"
    deal = "micro_batches"  # Oobleck deals the batch over its pipeline instances by their throughput

    def rebuild(self, live: Sequence[int]) -> Plan:
        # Whole micro-batches: templates do not reshape.
        whole = replace(self.start, units_per_micro_batch=1, micro_batch_units=())
        plan = replan(whole, live, 1, self.m, policy="elaswave", detours=False, schedule=self.model.pipeline_schedule)
        return replace(plan, units_per_micro_batch=self.start.units_per_micro_batch)

    def change(self, prev, live, joined, step_s):
        m, c = self.model, self.costs
        plan = self._try(live)
        move = 0.0
        if prev is not None and plan is not None:
            # Re-instantiated pipelines start empty: every rank of a changed pipeline loads all its layers.
            changed = {r for p_new in plan.pipelines for r in p_new
                       if r not in prev.ranks or prev.chunk_ranges(r) != plan.chunk_ranges(r)}
            move = _whole_layers_s(plan, changed, m)
        return Change(plan, m.detect_s + m.agree_s + c.full_rebuild_s + m.plan_s + move,
                      0.0 if joined else step_s / 2)


def _whole_layers_s(plan: Plan, ranks, model: ClusterModel) -> float:
    if not model.layer_param_bytes or not ranks:
        return 0.0
    worst = max(3 * sum(model.layer_param_bytes[i] for i in held_units(plan, r)) for r in ranks)
    return worst / model.inter_node_bytes_per_s


def make_class(name: str) -> type[Policy]:
    return {c.name: c for c in (Elaswave, ElaswaveNoDvfs, StaticExperts, Restart, DropReplica, Reroute, RerouteRuntime,
                                 Templates)}[name]


def make(name: str, initial: Plan, num_micro_batches: int, model: ClusterModel, costs: BaselineCosts,
         control: Control | None = None, start: Plan | None = None) -> Policy:
    """``control``: the spares every policy may hold, and the store's host, which only elaswave's
    policies model (the baselines' own stores are not). ``start``: the failure-free plan
    (:func:`failure_free`; default: it with ``model.power``), the same for every policy."""
    kind = make_class(name)
    control = control or Control()
    if control.store != "dedicated" and not issubclass(kind, Elaswave):
        raise ValueError(f"store={control.store!r} is invalid for policy {name}: only elaswave's policies "
                         "model the store's host; give the baselines store='dedicated'")
    if start is None:
        start = failure_free(initial, num_micro_batches, model.power)
    return kind(initial, num_micro_batches, model, costs, control, start)

