"""Growing the job: the leader's admission decision, a joining rank's way in, and the loop that
carries every membership change (a loss, a join, or a failure in the middle of either) through.

A join runs the same phases as a recovery (agree, communicator, plan, state), at a step
boundary instead of mid-step: no step is redone, the survivors keep their chunks, and the
joiners receive their layers' parameters by the holder groups' all-gather and their share of
ZeRO chunks from the chunks' owners (one transfer per source and destination).
"""
from __future__ import annotations

import os
import sys
import time

from elaswave.control.admission import SPARE_ENV, SPARE_HOST_ENV, STARTED_ENV
from elaswave.control.link import StoreLost
from elaswave.control.membership import NoMajority
from elaswave.interrupt import Disruption
from elaswave.plan.plan import Plan, PlanError
from elaswave.plan.replan import replan
from elaswave.runtime import device_memory, recovery
from elaswave.runtime.rank import RankState
from elaswave.runtime.straggler import REBALANCE
from elaswave.tensor.layout import Devices

class StoodDown(Exception):
    """A spare or joiner that the job finished without: it ends with nothing to do (its message,
    if any, says why)."""


GROW = "grow"
"""The cause of a membership change at a step boundary where the leader admitted ranks."""


def admit(ctx, st: RankState) -> int:
    """The leader's answer to new join requests, once per step (a request that does not prove the
    job's token is not even read: :mod:`elaswave.control.seal`): refuse every request in a job
    without a token, or one that no plan can take; admit the rest into the next epoch. Returns
    how many."""
    epoch = st.plan.epoch + 1
    pending = ctx.admission.pending(ctx.devices.every_rank(st.plan))  # with tp: every slice's ranks
    if not pending or ctx.admission.joining(epoch):
        return 0
    if not ctx.admission.proves_tokens:
        why = "this job admits no joins: it was started without ELASWAVE_TOKEN"
        for req in pending:
            _decide(ctx, f"refusing rank {req.rank}: {why}")
            ctx.admission.refuse(req.rank, why)
        return 0
    cfg, tp = ctx.cfg, ctx.cfg.parallel.tp
    genuine = [req.rank for req in pending if not req.spare]
    spares = [req.rank for req in pending if req.spare]
    if tp > 1:
        hosts = ctx.membership.hosts(genuine + spares)
        genuine, spares = whole_devices(genuine, hosts, tp), whole_devices(spares, hosts, tp)
    # A spare host's ranks fill the room lost ones left, never more: the founding devices (dp x pp),
    # whole devices at a time.
    room = (cfg.parallel.dp * cfg.parallel.pp - len(st.plan.ranks)) * tp - len(genuine)
    genuine += spares[:max(0, room) // tp * tp]
    if not genuine:
        return 0
    try:
        replan(st.plan, st.plan.ranks + tuple(genuine[::tp]), epoch, cfg.train.num_micro_batches, {}, cfg.elastic.policy,
               schedule=cfg.parallel.schedule)
    except PlanError as exc:
        for r in genuine:
            _decide(ctx, f"refusing rank {r}: {exc}")
            ctx.admission.refuse(r, str(exc))
        return 0
    devices = ctx.devices.joined(genuine)
    _decide(ctx, f"admitting ranks {genuine} into epoch {epoch}"
                 + (f" as devices {[list(devices.tensor_group(r)) for r in genuine[::tp]]}" if tp > 1 else "")
                 + "; the job grows at the end of this step")
    ctx.admission.admit(genuine, epoch, st.plan.to_doc(), ctx.run, ctx.devices.to_doc())
    return len(genuine)


def whole_devices(ranks: list[int], hosts: dict[int, str], tp: int) -> list[int]:
    """The joiners a tensor-parallel job admits now, in the order that makes devices of them: the
    job grows by whole devices, ``tp`` joiners of one host each (a group's collectives stay inside
    a node), shard by order; the rest wait for more of their host. (The leader runs slice 0, whose
    plan is the plan of devices, each named by its shard 0's rank.)"""
    out: list[int] = []
    for host in sorted({hosts.get(r, "") for r in ranks}):
        mine = [r for r in ranks if hosts.get(r, "") == host]
        out += mine[:len(mine) // tp * tp]
    return out


def join(ctx) -> tuple[RankState, recovery.Recovery]:
    """A joining rank: request admission, wait for the verdict, then take part in the change that
    lets it in. A failure that keeps it out of that epoch sends it back to wait for the next
    admission; a refusal raises ``Refused`` (its message is the leader's reason)."""
    started = float(os.environ.get(STARTED_ENV) or time.time())
    # Whatever a joiner can do alone it does before it asks: once admitted, the members wait for it.
    ctx.sampler_for(None)
    _warm_up(ctx)
    if os.environ.get(SPARE_ENV):
        # A warm spare has paid all of that already; its join starts when its agent promotes it.
        promoted = ctx.admission.stand_by()
        if promoted is None:
            raise StoodDown()
        started = promoted
    _reach_members(ctx)
    spare_host = bool(os.environ.get(SPARE_HOST_ENV))
    ctx.admission.request(started, spare=spare_host)
    ctx.injector.at(0, "admission")
    attempt = 1
    while True:
        try:
            # A spare host's rank waits for a loss as long as the job runs.
            verdict = ctx.admission.wait_verdict(attempt, None if spare_host else ctx.cfg.parallel.timeout_s)
        except TimeoutError as exc:
            tp = ctx.cfg.parallel.tp
            if tp > 1:  # a lone joiner waits for the rest of a device
                raise TimeoutError(f"{exc}; a job with parallel.tp={tp} admits joiners {tp} at a time, as whole "
                                   f"devices: start {tp} together") from None
            raise
        if verdict is None:
            raise StoodDown(f"rank {ctx.rank}: the job finished before it was admitted; nothing to do")
        prev = Plan.from_doc(verdict.prev_plan)
        ctx.memory_limit = {"source": "plan", "limit_mb": prev.stage_memory_limit}
        device_memory.check_joiner(ctx.cfg, ctx.rank, ctx.device, prev.stage_memory_limit)
        devices = Devices.from_doc(ctx.cfg.parallel.tp, verdict.devices)
        # With tp, its place in its device is decided now: it builds that shard of the model.
        shard = devices.joined(verdict.joining).shard_of(ctx.rank)
        if shard != ctx.shard:
            ctx.place(shard)
        ctx.settle(prev, devices)  # the watcher beats and listens for alerts from now on
        ctx.set_run(verdict.run)
        if ctx.watcher is not None and not ctx.watcher.is_alive():
            ctx.watcher.start()
        try:
            return change(ctx, None, GROW, time.time(), prev)
        except recovery.CutOff:
            raise
        except recovery.Excluded:
            attempt += 1


def _reach_members(ctx, every_s: float = 0.5) -> None:
    """A joiner that cannot reach the members over their network would break every group built
    with it, each after a collective timeout: it asks in only once their liveness ports answer,
    and gives up after ``parallel.timeout_s`` (the store alone is not enough to train)."""
    if ctx.prober is None:
        return
    deadline = time.monotonic() + ctx.cfg.parallel.timeout_s
    while True:
        if ctx.admission.job_done():
            raise StoodDown(f"rank {ctx.rank}: the job finished before it could ask in; nothing to do")
        members = ctx.membership.members_of(ctx.membership.current_epoch()) or ()
        silent = ctx.prober.unreachable(members, ctx.store, reached_only=False)
        if not silent:
            return
        if time.monotonic() > deadline:
            raise recovery.CutOff(f"rank {ctx.rank} reaches the job's store but not ranks {silent} (their liveness "
                                  f"ports gave no answer for parallel.timeout_s={ctx.cfg.parallel.timeout_s} s): "
                                  "it does not join")
        time.sleep(every_s)


def change(ctx, st: RankState | None, cause, noticed_wall: float, prev: Plan | None = None):
    """Carry one membership change through to a working epoch, whatever happens meanwhile: a
    failure during it (a Disruption) starts the next epoch's agreement from the same state."""
    moved_at = None
    while True:
        try:
            boundary = cause in (GROW, REBALANCE)
            began = time.time()
            new, account = recovery.recover(ctx, st, None if boundary else cause, noticed_wall, prev=prev,
                                            rebalance=cause is REBALANCE)
            break
        except Disruption as again:
            cause, noticed_wall = again, time.time()
        except StoreLost as lost:
            # Members died with the store: move it to the first survivor's standby, and agree there
            # (a side without a majority of the members does neither: it stops).
            if isinstance(lost, NoMajority) or st is None or not ctx.relocate_store(st):
                raise
            moved_at = (moved_at or 0.0) + time.time() - began
    if moved_at is not None:  # finding the store gone (its links' grace) and moving it: part of the MTTR
        account.phases_s = {"store": moved_at, **account.phases_s}
    if account.joined_ranks and not account.lost_ranks:
        account.join_walls = ctx.admission.walls(account.joined_ranks)
    return new, account


def _warm_up(ctx) -> None:
    """One forward and backward through a throwaway block, and the layers counted: a fresh process
    pays for its first autograd pass and lazy imports here rather than in its first step with the
    others."""
    import torch

    from elaswave.precision import compute_dtype

    from elaswave.model.contract import counted_numels

    m, dtype = ctx.model, compute_dtype(ctx.cfg.train.precision, ctx.device)
    # Building the layers on the meta device (what the plan's chunk sizes come from) lazily imports
    # torch._dynamo on the first initialiser: ~0.6 s here, which the members would wait out.
    counted_numels(m)
    block = m.build_layer(1, ctx.cfg.train.seed, init=False).to(ctx.device, dtype)
    x = torch.zeros(1, m.seq_len, m.hidden_size, device=ctx.device, dtype=dtype, requires_grad=True)
    block(x, None).sum().backward()


def _decide(ctx, what: str) -> None:
    print(f"elaswave: {what}", file=sys.stderr, flush=True)

