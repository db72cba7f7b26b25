"""The recovery executor: from a broken epoch to a working one, each phase timed.

detect (fault -> this rank noticed) -> agree (the next epoch's members) -> communicator (a standby
group, or one built now) -> plan (new micro-batch assignment and chunk owners, and the step to
resume at) -> state (lost chunks restored from snapshot holders by disjoint rank-to-rank
transfers, each checked against its checksum: :mod:`~elaswave.runtime.migration`; parameters re-gathered, the new snapshot ring started). The first step on the new
epoch is timed by the caller; MTTR runs from the fault to its end.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace

import torch

from elaswave.checkpoint import disk
from elaswave.config import JobConfig
from elaswave.control import leases, partition
from elaswave.control.membership import MOVED_PATIENCE
from elaswave.interrupt import CommError, Disruption
from elaswave.pipeline.stage import Stage
from elaswave.plan.frequency import PowerModel
from elaswave.plan.plan import Plan, PlanError
from elaswave.plan.replan import replan
from elaswave.plan.recovery import Holding, plan_restore, restorable
from elaswave.runtime import migration
from elaswave.runtime.experts import counts_of
from elaswave.runtime.rank import RankState, build_rank
from elaswave.runtime.step import gather_params
from elaswave.tensor import checkpoints, layout


class Excluded(RuntimeError):
    """This rank was left out of the next epoch (it checked in too late)."""


class GroupLost(RuntimeError):
    """This rank lives, but its tensor-parallel group lost a rank: the group's layers are re-
    partitioned away and this rank leaves the job (it holds a shard of layers no one else cuts)."""


class CutOff(Excluded):
    """This rank was left out of the next epoch alive: it and the others could not connect."""


def unreachable_of(ctx, ranks) -> list[int]:
    """The ranks, of ``ranks`` other than this one and those already shown or said dead, whose
    liveness port does not answer this rank: its check-in reports them (see
    :mod:`~elaswave.control.partition`). Asked only when the epoch broke by a network symptom: a
    death needs no such report, and a host powered off would hold every report for the probe's
    timeout."""
    _, dead = ctx.membership.known_dead(ranks, ctx.plan.epoch if ctx.plan is not None else 0)
    return ctx.prober.unreachable([r for r in ranks if r != ctx.rank and r not in dead], ctx.store)


@dataclass
class Recovery:
    epoch: int
    lost_ranks: list[int]
    resume_step: int
    fault_wall: float | None
    noticed_wall: float
    phases_s: dict[str, float] = field(default_factory=dict)
    communicator: str = ""
    is_fallback: bool = False
    bytes_received: int = 0
    plan: dict = field(default_factory=dict)
    joined_ranks: list[int] = field(default_factory=list)
    join_walls: dict = field(default_factory=dict)
    """A join's earlier moments (wall times): its processes' start, its requests, its admission."""
    evidence: dict = field(default_factory=dict)
    """Lost rank -> what showed it dead (the launcher's report, a refused probe, a stale heartbeat);
    also an admitted joiner that never came."""
    earlier_start_wall: float | None = None
    """When an earlier change began whose first step never completed (this one interrupted it)."""
    fault_from: str = "injected"
    """How ``fault_wall`` is known: injected, last_heartbeat, last_step, or noticed (there is none)."""
    num_changes: int = 1
    """Changes this record covers: more than one when a failure hit before a change's first step ended."""
    records: list = field(default_factory=list)
    """The members' step and eval records not yet committed (see ``StepJournal.fill``)."""
    lost_hosts: dict = field(default_factory=dict)
    """Lost rank -> the host it ran on, as it announced itself (``agents.host_name``)."""

    def absorb(self, earlier: "Recovery") -> "Recovery":
        """This change cut ``earlier`` short before its first step completed (no record was written
        for it): one record for both, timed from the first fault, naming every rank either lost."""
        self.lost_ranks = sorted(set(earlier.lost_ranks) | set(self.lost_ranks))
        self.joined_ranks = sorted((set(earlier.joined_ranks) | set(self.joined_ranks)) - set(self.lost_ranks))
        self.evidence = {**earlier.evidence, **self.evidence}
        self.lost_hosts = {**earlier.lost_hosts, **self.lost_hosts}
        begun = [w for w in (earlier.earlier_start_wall, earlier._start_wall) if w is not None]
        self.earlier_start_wall = min(begun)
        self.num_changes += earlier.num_changes
        self.records = earlier.records + self.records
        return self

    @property
    def _start_wall(self) -> float:
        return self.fault_wall if self.fault_wall is not None else self.noticed_wall

    def record(self, first_step_end_wall: float, first_step_s: float, evaluation_s: float = 0.0) -> dict:
        """``evaluation_s``: time an evaluation due at the resume step took before the first step:
        not recovery work, so it is left out of the MTTR (and reported beside it)."""
        first_step_end_wall -= evaluation_s
        if not self.lost_ranks and self.joined_ranks and self.join_walls:
            return {**self._join_record(first_step_end_wall, first_step_s), "evaluation_s": evaluation_s}
        own = self._start_wall
        start = own if self.earlier_start_wall is None else min(own, self.earlier_start_wall)
        # "interrupted": the earlier changes' time until this one's fault, so the phases sum to the MTTR.
        phases = {**({"interrupted": own - start} if self.num_changes > 1 else {}),
                  "detect": self.noticed_wall - own, **self.phases_s, "first_step": first_step_s}
        event = "recovery" if self.lost_ranks else ("join" if self.joined_ranks else "rebalance")
        return {"event": event, "epoch": self.epoch, "lost_ranks": self.lost_ranks,
                "evidence": {str(r): how for r, how in self.evidence.items()}, "joined_ranks": self.joined_ranks,
                "num_changes": self.num_changes,
                "resume_step": self.resume_step, "mttr_s": first_step_end_wall - start,
                "mttr_from": self.fault_from if self.fault_wall is not None else "noticed",
                "phases_s": phases, "communicator": self.communicator, "is_fallback": self.is_fallback,
                "bytes_received": self.bytes_received, "plan": self.plan, "evaluation_s": evaluation_s,
                "lost_hosts": _by_host(self.lost_hosts)}

    def _join_record(self, first_step_end_wall: float, first_step_s: float) -> dict:
        """A join without losses: from the joiners' start to the end of their first productive step.
        start-up (process start to request: imports, data), admission (request to the step boundary
        where the leader admitted it), then this recovery's own phases."""
        w = self.join_walls
        phases = {"start_up": w["requested"] - w["started"], "admission": w["admitted"] - w["requested"],
                  "boundary": self.noticed_wall - w["admitted"], **self.phases_s, "first_step": first_step_s}
        return {"event": "join", "epoch": self.epoch, "joined_ranks": self.joined_ranks,
                "resume_step": self.resume_step, "time_to_first_step_s": first_step_end_wall - w["started"],
                "since_request_s": first_step_end_wall - w["requested"], "phases_s": phases,
                "communicator": self.communicator, "bytes_received": self.bytes_received, "plan": self.plan,
                **({"evidence": {str(r): how for r, how in self.evidence.items()}} if self.evidence else {})}


def recover(ctx, st: RankState | None, cause: Disruption | None, noticed_wall: float,
            joining: tuple[int, ...] = (), prev: Plan | None = None, rebalance: bool = False) -> tuple[RankState, Recovery]:
    """Run every phase on this rank; returns the new epoch's state and the recovery's account.

    ``cause`` is None for a change at a step boundary: ranks admitted into the next epoch join
    (``joining``, and whoever the store says), or with ``rebalance`` the same ranks are re-planned
    by their measured speeds (a straggler).
    ``st`` is None on a joining rank, which holds nothing yet and joins ``prev``. A failure during
    a recovery lands here again with the same ``st``: the epoch that was being built is given up,
    and the next one is agreed among its members, from the state of the last epoch that trained."""
    cfg: JobConfig = ctx.cfg
    old = st.plan if st is not None else prev
    tp = cfg.parallel.tp
    old_ranks = ctx.devices.every_rank(old)  # every slice's
    was = set(old_ranks)
    # The epoch after the newest one this rank agreed on: a failure during a recovery gives up
    # the epoch being built. (The store's counter cannot tell: others may be a phase ahead.)
    epoch = max(old.epoch, ctx.agreed_epoch) + 1
    # The devices of the old epoch and those admitted since (whole devices, in admission order).
    full = ctx.devices
    for e in range(old.epoch + 1, epoch + 1) if tp > 1 else ():
        full = full.joined(ctx.admission.joining(e))
    shard = full.shard_of(ctx.rank)
    old = full.on_slice(old, shard)  # a joiner's ``prev`` is the plan as the leader's slice ran it
    # Who must check in: the members of the newest agreed epoch (the one that was being built, after
    # a failure during a recovery), and whoever the leader admitted into this one.
    expected = ctx.membership.members_of(epoch - 1) if epoch - 1 > old.epoch else old_ranks
    joining = tuple(sorted(set(joining) | set(ctx.admission.joining(epoch))))
    expected = tuple(sorted(set(expected) | set(joining)))
    t = time.perf_counter()
    phases: dict[str, float] = {}

    def lap(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        phases[name] = now - t
        t = now

    if isinstance(cause, CommError) and not ctx.interrupt.is_broken(epoch - 1):
        ctx.membership.alert(epoch - 1, f"rank {ctx.rank}: {cause}", network=True)
    if ctx.watcher is not None:
        noticed_wall = min([noticed_wall] + [w for e, w in ctx.watcher.noticed_at.items() if e >= old.epoch])
    if ctx.prober is not None and ctx.membership.network_in_question(epoch - 1):
        ctx.membership.check_in_reporting(epoch, lambda: unreachable_of(ctx, expected))
    else:
        ctx.membership.check_in(epoch)
    # A join waits for members still finishing the step; their deaths are reported, not timed out.
    agree_s = (cfg.elastic.agree_timeout_s if cause is not None else cfg.parallel.timeout_s) + ctx.agree_grace_s
    lease, hb_s = ctx.watcher.lease if ctx.watcher is not None else None, cfg.elastic.heartbeat_timeout_s
    alive_wait_s = leases.LATE_S if lease is not None else (MOVED_PATIENCE - 2) * hb_s
    if lease is not None:
        lives = lambda r: lease.lives(r, ctx.store)  # noqa: E731
    elif ctx.agree_grace_s and ctx.prober is not None:  # a store just moved: whose port answers is on its way
        lives = lambda r: ctx.prober.answers(r, ctx.store)  # noqa: E731
    else:  # a member still beating on this store is late (a loaded host), not gone: see Membership.beats
        lives = lambda r: ctx.membership.beats(r, hb_s)  # noqa: E731
    members = ctx.membership.agree(expected, epoch, agree_s, cfg.parallel.timeout_s, alerts_since=old.epoch,
                                   lives=lives, alive_wait_s=alive_wait_s)
    ctx.agree_grace_s = 0.0
    ctx.agreed_epoch = epoch
    if ctx.rank not in members:
        cut = ctx.membership.cut_off(epoch)
        if ctx.rank in cut:
            raise CutOff(f"rank {ctx.rank} was left out of epoch {epoch} (members {list(members)}): "
                         f"{partition.describe(ctx.rank, cut[ctx.rank])}")
        raise Excluded(f"rank {ctx.rank} was left out of epoch {epoch} (members {list(members)})")
    absent = _absent_joiners(ctx, epoch, joining, members, agree_s)
    # With tp: the devices whose every shard lives go on (each slice re-plans them alike); the
    # survivors of a device that lost a shard leave (see GroupLost).
    members, orphans = full.whole(members)
    if not members:
        raise PlanError(f"no tensor-parallel group of the job is whole after losing ranks "
                        f"{sorted(was - set(orphans))}: the job stops; "
                        + (f"the newest checkpoint in {cfg.checkpoint.dir} is where a restart resumes"
                           if cfg.checkpoint.dir else "set checkpoint.dir to keep the state in such a case"))
    if ctx.rank in orphans:
        raise GroupLost(f"rank {ctx.rank} leaves the job at epoch {epoch}: its tensor-parallel group "
                        f"{list(full.tensor_group(ctx.rank))} lost a rank, and its layers go to the other stages")
    lost = sorted(was - set(members))
    joined = sorted(set(members) - was)
    devices = full.keeping(members)
    everyone, members = members, devices.on_shard(members, shard)
    holding = (Holding(ctx.rank, st.optimizer.holding(), ctx.pool.holding() if ctx.pool else {})
               if st is not None else Holding(ctx.rank, {}, {}))
    ctx.membership.post(epoch, "state", {"holding": holding.to_doc(), "speed": ctx.speed,
                                         "expert_counts": counts_of(st.stage) if st is not None and cfg.parallel.ep > 1 else None,
                                         "standby_ready": ctx.comm.standby_ready(members),
                                         "disk_step": _readable_checkpoint(ctx), "records": ctx.journal.unwritten()})
    reports = ctx.membership.gather(epoch, "state", everyone, cfg.parallel.timeout_s,
                                    broken=lambda: ctx.interrupt.is_broken(epoch))
    # By device (its head): every slice plans the plan of devices alike, and runs it on its ranks.
    speeds = devices.device_speeds({r: doc["speed"] for r, doc in reports.items() if r in was})
    disk_steps = [doc["disk_step"] for doc in reports.values()]
    # The newest checkpoint every survivor saw complete (they may have looked at different moments).
    disk_step = None if None in disk_steps else min(disk_steps)
    # Every slice resumes at one step: the newest that each slice can restore all its chunks at.
    within = _slices_restorable(full, old, reports, disk_step) if tp > 1 else None
    records = [rec for doc in reports.values() for rec in doc["records"]]
    reports = {r: doc for r, doc in reports.items() if r in members}  # this slice's: its chunks and groups
    lap("agree")

    ctx.comm.park_before(epoch)  # the old epoch's groups, and any of an epoch given up during this change
    world = ctx.comm.group(members, epoch, use_standby=all(doc["standby_ready"] for doc in reports.values()))
    lap("communicator")

    power = _power_model(cfg)
    holdings = [Holding.from_doc(r, doc["holding"]) for r, doc in reports.items()]
    old_devices, heads = full.on_slice(old, 0), devices.on_shard(everyone, 0)
    # The router's counts over the old epoch, summed over the reports in rank order (every rank alike,
    # joiners too): a re-plan places experts by them (plan/experts.py).
    counts = [doc["expert_counts"] for _, doc in sorted(reports.items()) if doc.get("expert_counts")]
    if counts and old_devices.expert_holders:
        old_devices = replace(old_devices, expert_loads=tuple(sum(c[k] for c in counts) for k in range(len(counts[0]))))
    try:
        plan = devices.on_slice(replan(old_devices, heads, epoch, cfg.train.num_micro_batches,
                                       {r: v for r, v in speeds.items() if r in old_devices.ranks}, cfg.elastic.policy,
                                       power, (cfg.frequency.power_cap_w or power.power(1.0) * len(heads)) if power else None,
                                       detours=cfg.elastic.detours, schedule=cfg.parallel.schedule,
                                       rebalance=rebalance and not (set(heads) ^ set(old_devices.ranks))), shard)
    except PlanError as exc:
        _stop_with_state(ctx, st, old, members, holdings, disk_step, exc)
    if ctx.rank == members[0]:
        for d, (pipe, mbs) in enumerate(zip(plan.pipelines, plan.micro_batches)):
            if not mbs and not plan.is_complete(d) and cfg.elastic.policy == "elaswave":
                print(f"elaswave: ranks {list(pipe)} cannot hold the whole model within parallel.stage_memory_mb="
                      f"{cfg.parallel.stage_memory_mb} ({plan.stage_memory_limit:g} MiB): they stand by with their layers and chunks, and the other "
                      "pipelines run the whole batch, until ranks join", file=sys.stderr, flush=True)
            elif not mbs and plan.ep > 1 and cfg.elastic.policy == "elaswave":
                print(f"elaswave: ranks {list(pipe)} stand by with their layers, chunks and experts: their expert-parallel "
                      f"team is short of parallel.ep={plan.ep} pipelines, whose experts its others cannot hold within "
                      f"parallel.stage_memory_mb={cfg.parallel.stage_memory_mb}; the other teams run the whole batch, "
                      "until ranks join", file=sys.stderr, flush=True)
    restore = plan_restore(old.chunk_owners, plan.chunk_owners, holdings, disk_step, within)
    if restore.is_fallback and ctx.rank == members[0]:
        source = (f"the disk checkpoint in {disk.step_dir(ctx.checkpoint_root, disk_step)}"
                  if restore.resume_step == disk_step and disk_step else
                  "the keyed initial state (no disk checkpoint: set checkpoint.dir and checkpoint.every_steps)")
        print(f"elaswave: WARNING: the ZeRO chunks of ranks {list(restore.unrecoverable_owners)} died with "
              f"their snapshot holders; training goes back to step {restore.resume_step}, from {source}",
              file=sys.stderr, flush=True)
    lap("plan")

    # Everything this recovery asks the store, asked before any state changes hands: from here on
    # the kept chunks are the new optimizer's too (the same tensors) and the snapshot pool starts
    # the new ring, so a store lost after this point must not send the change back to ``st`` to
    # be recovered again (it did, once: not bit-identical, bytes_received 0 -- issue 58).
    evidence = {**ctx.membership.death_evidence(lost, epoch), **absent,
                **{r: "left with its tensor-parallel group, which lost a rank" for r in orphans}}
    fault_wall, fault_from = _fault_start(ctx, lost, noticed_wall)
    lost_hosts = ctx.membership.hosts(lost)
    if tp > 1:  # the group's collectives start afresh in the new epoch (the old ones may be cut mid-way)
        ctx.model.cut.group = ctx.comm.group(devices.tensor_group(ctx.rank), epoch)
    ctx.injector.at(restore.resume_step, "recovery")
    chunks, received, arriving = migration.restore_chunks(ctx, st, world, plan.chunk_owners, restore)
    layers = plan.chunk_ranges(ctx.rank)
    # A re-partitioned stage (or a joiner's) starts from fresh layers; the gather below fills in
    # their parameters from the chunk owners, who hold the same layers in the other pipelines.
    experts = plan.experts_held(ctx.rank)  # (its held experts may change with its layers kept)
    stage = (st.stage if st is not None and st.stage.chunks == layers and st.stage.experts == experts
             else Stage(cfg, layers, ctx.device, ctx.model, plan.recomputed_of(ctx.rank), experts))
    stage.recompute(plan.recomputed_of(ctx.rank))  # a kept stage may recompute more, or less, under the new plan
    new = build_rank(cfg, plan, ctx.rank, stage, ctx.sampler_for(stage), world, ctx.comm, ctx.device,
                     ctx.backend_name, gen=restore.resume_step, chunks=chunks, before=ctx.before_action,
                     actuator=ctx.actuator, fault=ctx.injector.at)
    ctx.actuator.apply(plan.frequency(ctx.rank))
    for wait, keys, moments in arriving:
        new.optimizer.moments_arriving(wait, keys, moments)
    gather_params(new)
    if ctx.pool is not None:
        ctx.pool.reset()
        pool = ctx.pool

        def snapshot() -> None:  # the new ring's first snapshot: whole chunks, so moments included
            pool.send(world, plan, new.optimizer.gen, new.optimizer.snapshot_slots(), new.device)

        if arriving:  # sent once the moments are in, early in the first step (see Executor.first_backward)
            new.executor.first_backward = snapshot
        else:
            snapshot()
        pool.expect(world, plan, new.device)
    ctx.comm.prepare_standbys(members, epoch)
    ctx.settle(plan, devices)
    lap("state")
    return new, Recovery(epoch, lost, restore.resume_step, fault_wall,
                         noticed_wall, phases, ctx.comm.last_source, restore.is_fallback, received,
                         _layout(plan), joined, evidence=evidence, fault_from=fault_from, records=records,
                         lost_hosts=lost_hosts)


def _by_host(hosts: dict[int, str]) -> dict[str, list[int]]:
    """Host -> its lost ranks (the record's view: a host lost whole is one line)."""
    out: dict[str, list[int]] = {}
    for rank, host in sorted(hosts.items()):
        out.setdefault(host, []).append(rank)
    return out


def _absent_joiners(ctx, epoch: int, joining: tuple[int, ...], members: tuple[int, ...],
                    waited_s: float) -> dict[int, str]:
    """The joiners admitted into ``epoch`` that it was agreed without, with why. One that never
    checked in -- it hung or died after it asked, with no agent to report it (``elaswave join``
    from a shell) -- is recorded gone: the leader would admit it again at every step, and each
    time the members waited ``parallel.timeout_s`` for it. The leader refuses it too, so that
    one that only came late stops with the reason instead of waiting for another admission."""
    missing = [r for r in joining if r not in members]
    if not missing:
        return {}
    for r in missing:  # (a death recorded first stays the cause: compare_set)
        ctx.membership.report_dead(r, f"was admitted into epoch {epoch} and did not check in within "
                                      f"{waited_s:g} s", alert=False)
    out = ctx.membership.death_evidence(missing, epoch)
    if ctx.rank == min(members):
        for r, why in out.items():
            print(f"elaswave: rank {r} {why}: it is not admitted again", file=sys.stderr, flush=True)
            ctx.admission.refuse(r, f"rank {r} {why}")
    return out


def _slices_restorable(devices: layout.Devices, old: Plan, reports: dict, disk_step: int | None) -> set[int]:
    """The generations every slice of a tensor-parallel job can restore all its chunks at (each
    slice's chunks, owners and holdings are its own; the slices' plans are one plan of devices)."""
    common: set[int] | None = None
    for s in range(devices.tp):
        owners = devices.on_slice(old, s).chunk_owners
        holdings = [Holding.from_doc(r, doc["holding"]) for r, doc in reports.items() if devices.shard_of(r) == s]
        gens = restorable(owners, holdings, disk_step)
        common = gens if common is None else common & gens
    return common or {0}


def _fault_start(ctx, lost: list[int], noticed_wall: float) -> tuple[float | None, str]:
    """When the losses began, and how that is known: ``injected`` (the faults stamped it), else
    the lost ranks' last sign of life -- ``last_heartbeat`` (a dead host says nothing more), or
    ``last_step``, the end of the last step this rank completed (every member lived until its
    exchange), whichever is later -- else ``noticed`` (no trace: the MTTR starts when a survivor
    noticed). The heartbeats may be out of reach: a store that died with its host took them along,
    and a survivor that noticed only after its store link's grace would then understate the MTTR
    by that grace (issue 58: 4.8 s recorded against 15 s between steps)."""
    injected = [w for w in (ctx.membership.read_stamp(f"fault/{r}") for r in lost) if w is not None]
    if injected:
        return min(injected), "injected"
    beats = [w for w in (ctx.membership.last_beat_wall(r) for r in lost) if w is not None and w < noticed_wall]
    step = ctx.last_step_wall if ctx.last_step_wall is not None and ctx.last_step_wall < noticed_wall else None
    if beats and (step is None or min(beats) >= step):
        return min(beats), "last_heartbeat"
    if step is not None:
        return step, "last_step"
    return None, "noticed"


def _stop_with_state(ctx, st: RankState | None, old: Plan, members, holdings, disk_step, exc: PlanError):
    """No plan fits the ranks left: save the state they hold (their own chunks and the snapshots
    of the dead) as a disk checkpoint, so that a restart with more ranks loses nothing, and stop
    with the planner's reason."""
    restore = plan_restore(old.chunk_owners, old.chunk_owners, holdings, disk_step)
    if st is None or ctx.checkpointer is None or restore.is_fallback:
        where = ("set checkpoint.dir to keep the state in such a case" if ctx.checkpointer is None else
                 f"the newest checkpoint in {ctx.checkpoint_root} is where a restart resumes")
        raise PlanError(f"{exc}. The job stops; {where}") from None
    gen = restore.resume_step
    mine = sorted(k for k, (src, _) in restore.sources.items() if src == ctx.rank)
    owners = tuple(tuple(restore.sources[(layer, c)][0] for c in range(len(row)))
                   for layer, row in enumerate(old.chunk_owners))
    # Own chunks are on the device, kept snapshots (on a GPU) in host memory: saved from the host.
    payload = torch.stack([migration.local_chunk(ctx, st, restore, k).cpu() for k in mine]) if mine else torch.empty(0)
    if mine:
        ctx.checkpointer.save(gen, owners, mine, payload, is_writer=ctx.rank == min(r for row in owners for r in row),
                              epoch=old.epoch)
        ctx.checkpointer.wait()
    stop = PlanError(f"{exc}. The job stops; its state at step {gen} is saved in "
                     f"{disk.step_dir(ctx.checkpoint_root, gen)}: run it again with more ranks and it resumes there")
    stop.saved_step = gen
    raise stop from None


def _power_model(cfg: JobConfig) -> PowerModel | None:
    """Frequency planning where a level can take effect: elaswave's policy, with an actuator."""
    f = cfg.frequency
    return PowerModel() if cfg.elastic.policy == "elaswave" and f.planning and cfg.actuator != "none" else None


def _layout(plan: Plan) -> dict:
    """The new plan as the metrics record it: who runs which layers, how many micro-batches (and the
    units -- sequences when reshaped -- in each), at what level, which blocks it recomputes (chosen
    to fit memory: train.activation_checkpointing=auto)."""
    return {"pipelines": [list(p) for p in plan.pipelines],
            "layer_ranges": [[list(r) for r in rs] for rs in plan.layer_ranges],
            "micro_batches": [len(m) for m in plan.micro_batches],
            "units": [[plan.units_of(mb) for mb in m] for m in plan.micro_batches],
            "frequencies": [list(f) for f in plan.frequencies] if plan.frequencies else None,
            "detours": len(plan.routes), "virtual_stages": plan.virtual_stages, "recomputed": [[list(b) for b in pipe] for pipe in plan.recomputed]}


def _readable_checkpoint(ctx) -> int | None:
    """The step of the newest complete checkpoint, once this rank's own save in flight is done."""
    if ctx.checkpointer is None:
        return None
    try:
        ctx.checkpointer.wait()
    except disk.CheckpointError as exc:
        print(f"elaswave: WARNING: rank {ctx.rank}: {exc}", file=sys.stderr, flush=True)
    # With tp: the newest step every slice completed (a fallback must go back alike in all).
    return checkpoints.common_step(ctx.cfg.checkpoint.dir, ctx.cfg.parallel.tp)
