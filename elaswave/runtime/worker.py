"""The worker entry point: one rank of a job, and its loop over steps and epochs.

Started by ``elaswave run`` (which hosts the TCPStore and passes ``ELASWAVE_STORE=host:port``) or by
``torchrun`` (``env://`` rendezvous), with the same arguments either way:
``python -m elaswave.runtime.worker [--config F] [--set key=value]... [--metrics-out F]``.
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import resource
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import torch

from elaswave import config
from elaswave.checkpoint import disk, export, hf_folder
from elaswave.comm import backend
from elaswave.config import JobConfig
from elaswave.errors import ConfigError
from elaswave.control.admission import JOIN_ENV, Refused
from elaswave.control.agents import NODE_RANK_ENV, NODES_ENV
from elaswave.control.health import RankReport
from elaswave.control import failover, rendezvous
from elaswave.control.link import EXIT_EXCLUDED, EXIT_GROUP_LEFT, EXIT_STORE_LOST, StoreLink, StoreLost
from elaswave.interrupt import Disruption
from elaswave.model.contract import tie_pairs
from elaswave.model.units import units_of
from elaswave.pipeline.stage import Stage
from elaswave.plan.buckets import size_starts
from elaswave.plan.frequency import PowerModel
from elaswave.plan.memory import rank_bytes
from elaswave.plan.plan import PlanError, initial_plan
from elaswave.plan.recompute import refitted
from elaswave.precision import compute_dtype, name as precision_name, pin_kernels
from elaswave.runtime import device_memory, join, recovery, rescue
from elaswave.runtime.actuator import ActuatorError
from elaswave.runtime.memory import measure_step
from elaswave.runtime.metrics import MetricsWriter, print_error
from elaswave.runtime.context import Context
from elaswave.runtime.flip import flip_low_bit
from elaswave.runtime.rank import build_rank
from elaswave.runtime.step import gather_masters, gather_params, samples_of, train_step
from elaswave.tensor import checkpoints, layout
from elaswave.tensor.shards import state_total, whole_digest
from elaswave.runtime.straggler import REBALANCE
from elaswave.zero import digest
from elaswave.zero.flat import params_sha256



def _connect(cfg: JobConfig, rank: int, world_size: int) -> tuple[StoreLink, int, int]:
    """The link to the job's store: ``elaswave run``'s (``ELASWAVE_STORE``) or torchrun's rendezvous."""
    addr = os.environ.get("ELASWAVE_STORE")
    timeout_s, grace_s = cfg.parallel.timeout_s, cfg.elastic.heartbeat_timeout_s
    if addr:
        return rendezvous.connect(addr, timeout_s, grace_s), rank, world_size
    store, rank, world_size = backend.rendezvous_store(timeout_s)
    return StoreLink(store, None, timeout_s, grace_s), rank, world_size


def run(cfg: JobConfig, rank: int, world_size: int, metrics_out: str | None) -> int:
    t = cfg.train
    torch.set_num_threads(1)  # many ranks share a few cores; one thread each also fixes kernel order
    joining = bool(os.environ.get(JOIN_ENV))
    if cfg.world_size != world_size and not joining:
        raise ConfigError(f"parallel.dp={cfg.parallel.dp} x parallel.pp={cfg.parallel.pp} x parallel.tp="
                          f"{cfg.parallel.tp} = {cfg.world_size} is invalid: the job has {world_size} ranks")
    name, device = backend.choose(cfg.parallel.backend)
    compute_dtype(t.precision, device)  # bf16 on a device without it: say so before connecting
    pin_kernels(t.deterministic, device)
    store, rank, world_size = _connect(cfg, rank, world_size)
    ctx = Context(cfg, rank, store, name, device)
    if _models_memory(cfg, device):
        ctx.memory_model  # a model the meta device cannot run: one line now, not at the step measured
    if joining:
        st, pending = join.join(ctx)
        ctx.plan = st.plan
        resumed, step = None, pending.resume_step
    else:
        st, resumed = _start(ctx, world_size)
        step, pending = st.optimizer.gen, None
    ctx.learn_standbys()
    if ctx.watcher is not None and not ctx.watcher.is_alive():
        ctx.watcher.start()

    journal = ctx.journal
    health = RankReport(rank)  # this rank's word for its agent's health probe (--health-file)
    writer = MetricsWriter(metrics_out if rank == 0 else None, show_progress=rank == 0, total_steps=t.steps,
                           append=resumed is not None)
    # The job as configured, first: reports and the simulator's calibration read the run from it.
    writer.write({"event": "job", "config": cfg.to_dict(), "world_size": world_size, "wall_time": time.time(),
                  "memory_limit": ctx.memory_limit})
    if resumed and writer.continues:  # the steps the job died before writing into this file (it skips those it has)
        for record in resumed.manifest.records:
            writer.write(record)
        writer.write({"event": "resume", "step": step, "checkpoint": str(resumed.manifest.path),
                      "load_s": resumed.load_s, "wall_time": time.time()})
    began = time.perf_counter()
    result = moved = None
    evaluation_s = 0.0  # evaluations since the last change, before its first step: not in its MTTR
    try:
        while True:
            cause = None
            try:
                while True:
                    if t.eval_due(step):  # the state after `step` steps, on the layout that runs the next
                        st.gathering.settle()
                        evaluated = ctx.evaluation.run(st, step, lambda j, a, s=step: ctx.before_eval(s, j, a))
                        journal.add(evaluated)
                        if pending is not None:
                            evaluation_s += evaluated["eval_s"]
                    if step >= t.steps:
                        break
                    started = time.perf_counter()
                    st.executor.slowdown = ctx.injector.slowdown(step)
                    starve_s = ctx.injector.starves(step)
                    if starve_s and ctx.watcher is not None:
                        ctx.watcher.starve(starve_s)
                    ctx.step = step
                    def one_step():
                        return train_step(st, cfg, step, ctx.pool, ctx.injector.at, ctx.admit, ctx.injector.corrupts,
                                          ctx.store.lost.is_set)
                    if step == t.measure_memory_step:
                        result, before, peak = measure_step(st, one_step, device)
                        ctx.measured_memory = {"step": step, "before_bytes": before, "peak_bytes": peak,
                                               "predicted": rank_bytes(ctx.memory_model, st.plan, rank),
                                               "held_values": sum(layer.numel for layer in st.stage.layers),
                                               "sends_alive": st.executor.p2p.most_pending}
                    else:
                        result = one_step()
                    for what in ctx.injector.flips(step):
                        st.gathering.settle()
                        if ctx.pool is not None:  # the step's snapshot is sent from the state: let it go first
                            ctx.pool.wait_sends(st.world)
                        flip_low_bit(st, what)
                    took = time.perf_counter() - started
                    ctx.note_step()
                    ctx.speeds.add(st.epoch, result.speeds)
                    # The median of the epoch's last steps; an idle rank (drop_replica) keeps its last figure.
                    ctx.speed = ctx.speeds.median(rank) or ctx.speed
                    journal.commit_before(step, writer)
                    samples = samples_of(st.plan, t)
                    journal.add({"event": "step", "step": step, "loss": result.loss, "grad_norm": result.grad_norm,
                                 "lr": result.lr, "num_samples": samples, "tokens": result.tokens,
                                 "loss_tokens": result.loss_tokens, "world_size": len(st.plan.ranks) * cfg.parallel.tp,
                                 **({"aux_loss": result.aux_loss} if result.aux_loss is not None else {}),
                                 "epoch": st.epoch, "step_time_s": took, "tokens_per_s": samples * ctx.model.seq_len / took,
                                 "wall_time": time.time(), "phases_s": result.phases_s, "early_sums": result.early_sums,
                                 "gathers_in_forwards": result.gathers_in_forwards, "sums_in_backwards": result.sums_in_backwards,
                                 "modelled_power_w": _modelled_power(st.plan), **ctx.source_tokens(step),
                                 **({"tp_bytes": result.tp_bytes} if cfg.parallel.tp > 1 else {}),
                                 **({"expert_bytes": result.expert_bytes, **st.experts["record"]} if cfg.parallel.ep > 1 else {})})
                    if pending is not None:  # (a no-op writer on ranks that do not write)
                        writer.write({**pending.record(time.time(), took, evaluation_s),
                                      "spares_standing": _spares_standing(ctx)})
                        pending = None
                    if moved is not None:  # the first step on the store it moved to: the move's MTTR
                        writer.write(Context.moved_record(moved, took))
                        moved = None
                    step += 1
                    health("training", step, st.epoch)
                    if result.store_lost:  # the step stays pending, as any: a death in the next may redo it
                        moved = ctx.move_store(st, step)
                    if ctx.checkpointer is not None and ctx.checkpointer.due(step):  # (optimizer state only)
                        ctx.checkpointer.save(step, st.plan.chunk_owners, st.optimizer.keys(), st.optimizer.payload(),
                                              is_writer=rank == st.plan.ranks[0], epoch=st.epoch,
                                              records=journal.unwritten())
                    if ctx.stamps_steps and rank == st.plan.ranks[0]:
                        _stamp_step(ctx, step)
                    if result.joining:  # admitted during this step: the job grows at its end
                        st.gathering.settle()  # (the change gathers every layer again, on its new groups)
                        cause = join.GROW
                        break
                    # (Each slice sees its own ranks' speeds: a tp job does not re-plan for stragglers.)
                    gain = (ctx.speeds.straggles(st.plan, t.num_micro_batches, cfg.elastic.straggler_gain)
                            if cfg.parallel.tp == 1 else 0.0)
                    if gain and cfg.elastic.enabled and step < t.steps:
                        if rank == st.plan.ranks[0]:
                            slowest = min(st.plan.ranks, key=ctx.speeds.median)
                            print(f"elaswave: re-planning at step {step} by measured speeds (slowest: rank {slowest}); "
                                  f"predicted to save {100 * gain:.0f}% of a step", file=sys.stderr, flush=True)
                        st.gathering.settle()
                        cause = REBALANCE
                        break
                if cause is None:
                    if moved is not None:  # it came with the last step: no step on the new store to wait for
                        writer.write(Context.moved_record(moved, 0.0))
                    if ctx.checkpointer is not None:
                        ctx.checkpointer.wait()
                    summary, exported = _finish(ctx, st, cfg)
                    journal.commit_before(t.steps + 1, writer)  # the last evaluation's record too
                    if exported:
                        print(f"elaswave: exported the model as a Hugging Face folder: {exported}", flush=True)
                    break
            except Disruption as exc:
                if not cfg.elastic.enabled:
                    raise
                cause = exc
            unfinished = pending  # a change whose first step never ended: its record goes into this one's
            health("recovering", step, st.epoch)
            try:
                st, pending = join.change(ctx, st, cause, time.time())
            except PlanError as stop:
                if stop.saved_step is not None:  # the steps the saved state has seen happened: record them
                    journal.commit_before(stop.saved_step, writer)
                raise
            except recovery.GroupLost as out:  # alive, but its shard's layers went to other stages
                print(f"elaswave: {out}", file=sys.stderr, flush=True)
                writer.close()
                return _group_left_code()
            except recovery.Excluded as out:
                print_error(str(out))
                writer.close()
                return EXIT_EXCLUDED
            if unfinished is not None:
                pending = pending.absorb(unfinished)
            ctx.plan = st.plan
            ctx.learn_standbys()
            step, evaluation_s = pending.resume_step, 0.0
            journal.fill(pending.records)
            journal.discard_from(step)
            # The new leader takes over the metrics and the progress line (rank 0 may be gone).
            if rank == st.plan.ranks[0] and ctx.shard == 0 and not writer.show_progress:
                writer = MetricsWriter(metrics_out, show_progress=True, total_steps=t.steps, append=True)
                journal.replay(writer)
            journal.commit_before(step, writer)
    except StoreLost as lost:
        stale = rescue.left_out(ctx, st)
        if stale is not None:  # nothing of it may reach the user's files: the job's state is elsewhere
            print_error(f"rank {rank}: {lost}; {stale}. It writes nothing and stops")
            writer.close()
            return EXIT_EXCLUDED
        journal.commit_before(step, writer)  # the steps every rank finished: the state saved is after them
        if moved is not None:  # moved, then lost again before a step ended there
            writer.write(Context.moved_record(moved, 0.0))
        code = rescue.save_and_stop(ctx, st, str(lost), ctx.store.lost_wall or time.time(), writer)
        writer.close()
        if ctx.watcher is not None:
            ctx.watcher.stop()
        return code
    wall = time.perf_counter() - began
    if rank == st.plan.ranks[0] and ctx.shard == 0:
        ranks = sorted(summary)
        # Every holder's copy of a layer is the same (checked in _finish): take any. With
        # parallel.tp, the whole layers gathered from their shards.
        digests = {i: h for part in summary.values() for i, h in (part["whole_layers"] or part["layer_copies"]).items()}
        sums = [int(summary[r]["state_sum"], 16) for r in ranks]
        writer.write({"event": "summary", "steps": t.steps, "final_loss": result.loss if result else None,
                      "params_sha256": params_sha256([bytes.fromhex(digests[str(i)]) for i in range(st.plan.num_units)]),
                      "state_sha256": digest.state_sha256(summary[rank]["step_counter"],
                                                          [state_total(sums)] if cfg.parallel.tp > 1 else sums),
                      "wall_s": wall, "world_size": len(ranks), "dp": cfg.parallel.dp, "pp": cfg.parallel.pp,
                      "tp": cfg.parallel.tp,
                      "epoch": st.epoch, "run": ctx.run, "ranks": ranks, "deterministic": t.deterministic,
                      "precision": precision_name(compute_dtype(t.precision, device)),
                      "optimizer_state_bytes_per_rank": [summary[r]["state_bytes"] for r in ranks],
                      "master_bytes_per_rank": [summary[r]["master_bytes"] for r in ranks],
                      "snapshot_bytes_held_per_rank": [summary[r]["snapshot_bytes"] for r in ranks],
                      "snapshot_buffer_bytes_per_rank": [summary[r]["snapshot_buffer_bytes"] for r in ranks],
                      "peak_rss_bytes_per_rank": [summary[r]["peak_rss_bytes"] for r in ranks],
                      "memory_predicted_per_rank": [summary[r]["memory_predicted"] for r in ranks],
                      "memory_measured_per_rank": [summary[r]["memory_measured"] for r in ranks],
                      "cpu_s_per_rank": [summary[r]["cpu_s"] for r in ranks]})
        try:
            ctx.membership.stamp("done")
        except StoreLost:  # the training is over and checked: nobody is left to tell
            pass
    if ctx.standby is not None and ctx.store.addr == ctx.standby.addr:
        # The job's store moved here: the agents that followed it need it until they are done.
        failover.hold_for_agents(ctx.store, int(os.environ.get(NODES_ENV, "1")),
                                 int(os.environ.get(NODE_RANK_ENV, "0")), cfg.parallel.timeout_s)
    writer.close()
    if ctx.watcher is not None:
        ctx.watcher.stop()
    ctx.actuator.close()
    return 0


def _start(ctx: Context, world_size: int):
    """The founding ranks' first epoch: the initial plan, from scratch or from a disk checkpoint."""
    cfg, rank, device = ctx.cfg, ctx.rank, ctx.device
    t, model, tp = cfg.train, ctx.model, cfg.parallel.tp
    units = units_of(model)
    limit, ctx.memory_limit = device_memory.stage_limit_mb(cfg, ctx.store, rank, world_size,
                                                                device_memory.own_mib(device))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if tp > 1 and local % tp:  # under torchrun: a tensor-parallel group must not span hosts
        raise ConfigError(f"parallel.tp={tp} is invalid with {local} ranks on this host (LOCAL_WORLD_SIZE): a host "
                          "must hold whole tensor-parallel groups; use --nproc-per-node a multiple of parallel.tp")
    # The plan is of devices (a device: tp ranks); each rank runs it on its slice (tensor.layout).
    try:
        plan = initial_plan(world_size // tp, cfg.parallel.dp, cfg.parallel.pp,
                            [c.flops_per_token for c in model.layer_costs()], t.num_micro_batches,
                            units.numels, cfg.parallel.chunk_numel, stage_memory_limit=limit, ties=tie_pairs(model),
                            memory=ctx.memory_model if limit else None,
                            units_per_micro_batch=t.micro_batch_size if cfg.elastic.reshape else 1,
                            virtual_stages=cfg.parallel.virtual_stages,
                            unit_layers=units.expert_layers, ep=cfg.parallel.ep,
                            bucket_starts=size_starts(units.numels, cfg.parallel.bucket_numel, units.expert_layers))
        plan = replace(plan, snapshot_copies=cfg.elastic.snapshot_copies)
        # Under torchrun and several agents, ranks are numbered host-major, LOCAL_WORLD_SIZE to a host;
        # the one-host launcher's job is one host (its joiners' numbers say nothing about hosts).
        if not os.environ.get("ELASWAVE_STORE") or os.environ.get(NODES_ENV, "1") != "1":
            plan = replace(plan, ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", "0")))
        plan = refitted(plan)  # the snapshots it keeps for its peers count in what a rank must recompute
    except PlanError:
        if ctx.memory_limit["source"] != "auto":
            raise
        # Preflight checks a configured limit; the agreed one is known only now.
        raise device_memory.unfit(cfg, ctx.memory_limit, model, ctx.memory_model) from None
    ctx.plan = plan = layout.founding_slice(plan, ctx.shard, tp)
    stage = Stage(cfg, plan.chunk_ranges(rank), device, model, plan.recomputed_of(rank), plan.experts_held(rank))
    world = ctx.comm.group(plan.ranks, plan.epoch)
    if tp > 1:
        model.cut.group = ctx.comm.group(ctx.devices.tensor_group(rank), plan.epoch)
    # Before the barrier below, so before any rank of this run has written there.
    ctx.set_run(checkpoints.next_run(cfg.checkpoint.dir or rescue.RESCUE_DIR, tp))
    resumed = _resume_point(cfg, plan, rank, ctx.shard)
    gen, chunks = (resumed.manifest.step, resumed.chunks) if resumed else (0, None)
    st = build_rank(cfg, plan, rank, stage, ctx.sampler_for(stage), world, ctx.comm, device, ctx.backend_name,
                    gen=gen, chunks=chunks, before=ctx.before_action, actuator=ctx.actuator,
                    fault=ctx.injector.at)
    ctx.actuator.apply(plan.frequency(rank))
    if resumed:
        gather_params(st)
    ctx.comm.prepare_standbys(plan.ranks, plan.epoch)
    if tp > 1 and rank == 0 and cfg.elastic.enabled and (cfg.elastic.store_failover or cfg.elastic.straggler_gain):
        print(f"elaswave: with parallel.tp={tp} the control store does not move to a standby and stragglers are not "
              "re-planned (neither is built for tensor-parallel slices yet)", file=sys.stderr, flush=True)
    if cfg.checkpoint.export_hf and rank == plan.ranks[0] and ctx.shard == 0:
        hf_folder.clear_staging(cfg.checkpoint.export_hf)  # before the barrier: no rank has written yet
    world.all_reduce(torch.zeros(1, device=device), "start-up barrier")
    return st, resumed


def _group_left_code() -> int:
    """A rank that left with its broken tensor-parallel group: its launcher starts a spare's join
    in its place; under torchrun it exits 0 (a non-zero code would restart the job)."""
    return EXIT_GROUP_LEFT if os.environ.get("ELASWAVE_STORE") else 0


def _stamp_step(ctx: Context, step: int) -> None:
    """The launcher starts the joins asked for at a step; not when the store is gone (the step's
    exchange says so, and the ranks move it or stop)."""
    try:
        ctx.membership.stamp("step", step)
    except StoreLost:
        pass


def _spares_standing(ctx: Context) -> int | None:
    """For a change's record; None when the store is gone (it moves, or the ranks stop, after the step)."""
    try:
        return ctx.membership.spares_standing()
    except StoreLost:
        return None


def _models_memory(cfg: JobConfig, device: torch.device) -> bool:
    """Whether the job uses its memory model (building it runs every layer once on the meta device):
    under a memory limit (``auto`` has one on a GPU), or to measure a step against it."""
    return device_memory.plans_within_a_limit(cfg, device) or cfg.train.measure_memory_step >= 0


def _modelled_power(plan) -> float:
    """What the live devices draw at their planned levels under the power model (1.0 = one device
    at nominal frequency); times the step time, the modelled energy of a step."""
    model = PowerModel()
    return sum(model.power(plan.frequency(r)) for r in plan.ranks)


class ResumePoint(NamedTuple):
    manifest: disk.Manifest
    chunks: dict
    """This rank's chunks in the new plan, read from the checkpoint."""
    load_s: float


def _resume_point(cfg: JobConfig, plan, rank: int, shard: int) -> ResumePoint | None:
    """Where to continue from: the newest complete checkpoint, or None."""
    c = cfg.checkpoint
    if not (c.dir and c.resume):
        return None
    began = time.perf_counter()
    tp = cfg.parallel.tp
    checkpoints.check_degree(c.dir, tp)
    manifest = checkpoints.latest(c.dir, shard, tp)
    if manifest is None:
        return None
    manifest.check_fits(cfg.model_identity(), cfg.parallel.chunk_numel, plan.chunk_owners)
    manifest.check_data(cfg.data_identity())
    if manifest.step >= cfg.train.steps:
        raise ConfigError(f"train.steps={cfg.train.steps} is invalid: the checkpoint in {c.dir} is already at "
                          f"step {manifest.step}; raise train.steps or use another checkpoint.dir")
    chunks = disk.load_chunks(manifest, plan.chunks_of(rank))
    if rank == 0:
        print(f"elaswave: resuming at step {manifest.step} from {manifest.path}", flush=True)
    return ResumePoint(manifest, chunks, time.perf_counter() - began)


def _finish(ctx: Context, st, cfg: JobConfig) -> tuple[dict[int, dict], Path | None]:
    """Every rank posts the digest of its copy of each layer it holds (with tp, of each tensor its
    shard replicates too), its optimizer state's sum and its memory figures; the first member
    checks that the copies agree (:func:`elaswave.zero.digest.check_replicas`) and finishes the export
    (returned: the parts, and the export's folder on the member that wrote it)."""
    plan = st.plan
    st.gathering.settle()
    if st.stage.dtype != torch.float32:
        gather_masters(st)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    target = export.Target.of_job(cfg) if cfg.checkpoint.export_hf else None
    shards = st.shards
    # A tp job's whole layers, gathered from their shards a layer at a time: their digests, and
    # the layers shard 0 of their first holder exports.
    wholes, kept, written = None, {}, st.stage.layers
    if shards is not None:
        writes = target is not None and ctx.shard == 0
        wholes = {}
        for i, flat in shards.each_whole(st.stage.layers):
            wholes[str(i)] = whole_digest(flat)
            if writes and plan.holders(i)[0] == st.rank:
                kept[i] = flat.cpu()  # written from the host: the device keeps no whole layers
        written = shards.whole_layers(kept, kept)
    exported = export.write_my_shards(target, plan, st.rank, written, ctx.model, cfg.train.seed) if target else None
    doc = {"layer_copies": digest.layer_digests(st.stage.layers), "whole_layers": wholes,
           # A tp job's tensors each of a device's shards holds (norms...): compared across them.
           "shard_replicas": shards.replica_digests(st.stage.layers) if shards else None,
           # Summed over ranks into state_sha256; a tp job's counts each value of the whole model once.
           "state_sum": f"{shards.state_sum(st.optimizer, st.stage.layers) if shards else digest.owned_state_sum(st.optimizer):x}",
           "step_counter": st.optimizer.gen,
           "master_problems": digest.masters_mismatches(st.optimizer, st.stage.layers, st.rank),
           "export": exported,
           "state_bytes": st.optimizer.state_bytes(), "master_bytes": st.optimizer.master_bytes(),
           "snapshot_bytes": ctx.pool.bytes_held() if ctx.pool else 0,
           "snapshot_buffer_bytes": ctx.pool.bytes_buffered() if ctx.pool else 0,
           "peak_rss_bytes": usage.ru_maxrss * 1024, "cpu_s": usage.ru_utime + usage.ru_stime,
           "memory_predicted": rank_bytes(ctx.memory_model, plan, st.rank) if _models_memory(cfg, st.device) else None,
           "memory_measured": ctx.measured_memory}
    ctx.membership.post(plan.epoch, "final", doc)
    st.world.all_reduce(torch.zeros(1, device=st.device), "final barrier")
    if st.rank != plan.ranks[0] or ctx.shard != 0:
        return {}, None
    parts = ctx.membership.gather(plan.epoch, "final", ctx.devices.every_rank(plan), cfg.parallel.timeout_s)
    digest.check_replicas(parts, ctx.devices.head_of, ctx.devices.shard_of)
    # The fence of the export and the summary: nothing of an epoch the job has left reaches them.
    if (now := ctx.membership.current_epoch()) != plan.epoch:
        raise recovery.Excluded(f"rank {st.rank} finished epoch {plan.epoch} but the job is in epoch {now}: "
                                "it writes no export and no summary")
    out = export.finish_run_export(target, cfg.model, [p["export"] for p in parts.values()]) if target else None
    return parts, out


def main(argv: list[str] | None = None) -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1` shows where a rank is
    ap = argparse.ArgumentParser(prog="elaswave-worker")
    ap.add_argument("--config")
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--metrics-out")
    args = ap.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = config.load(args.config, args.overrides)
        code = run(cfg, rank, world_size, args.metrics_out)
    except join.StoodDown as idle:
        if str(idle):
            print(f"elaswave: {idle}", flush=True)
        code = 0  # a spare or joiner the job finished without
    except recovery.GroupLost as out:  # a joiner whose device lost a rank while it joined
        print(f"elaswave: {out}", file=sys.stderr, flush=True)
        code = _group_left_code()
    except recovery.Excluded as out:  # a joiner that never got in
        print_error(str(out))
        code = EXIT_EXCLUDED
    except StoreLost as lost:  # before the rank trained: nothing of the job's state is here
        print_error(f"rank {rank}: {lost}; it stops")
        code = EXIT_STORE_LOST
    except (ConfigError, disk.CheckpointError, PlanError, ActuatorError, Refused, digest.StateMismatch) as exc:
        print_error(str(exc))
        code = 2
    except Exception as exc:  # one line for the user; the traceback goes with ELASWAVE_DEBUG=1
        if os.environ.get("ELASWAVE_DEBUG"):
            raise
        print_error(f"rank {rank}: {type(exc).__name__}: {exc}")
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Parked broken groups and standby threads stuck on dead peers must not delay the exit.
    os._exit(code)


if __name__ == "__main__":
    main()
