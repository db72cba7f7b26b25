"""When the control store is gone: save what this rank holds, stop, and let a rerun lose nothing.

Without the store no membership can change (no agreement, no new groups, no joins), but the
training state is intact in the ranks' memory. Every rank notices within the heartbeat timeout
(its :class:`~elaswave.control.link.StoreLink` gives up), and a step's loss exchange counts them:
once it is every rank, all stop at the end of that same step. (A rank cut off from a store that
the others still reach trains on until they leave it out, and comes here from its recovery: what
it saves is its part of a generation the others do not complete, which a rerun ignores.)
Each rank writes the ZeRO chunks it owns
-- both generations it keeps, the newest first -- as a disk checkpoint under the plan's owners,
with no collective and no store: a checkpoint counts only once every owner's part is there
(:mod:`elaswave.checkpoint.disk`), so the newest generation all ranks reached is the one a rerun
resumes from. With every rank alive that is the step after the last one trained: nothing is lost.
"""
from __future__ import annotations

import sys
import time

import torch

from elaswave.checkpoint import disk
from elaswave.control import failover
from elaswave.control.link import EXIT_STORE_LOST
from elaswave.runtime.rank import RankState
from elaswave.tensor import checkpoints

RESCUE_DIR = "elaswave-rescue"
"""Where the state goes when the job has no ``checkpoint.dir``: progress is not thrown away."""


def left_out(ctx, st: RankState | None) -> str | None:
    """Why this rank must write nothing, or None: the job went on without it. Its own link gave up
    on the store, but a rank paused past that grace (SIGSTOP, a frozen VM) finds the store answering
    the others in an epoch it is not in; one cut off finds the checkpoint directory holding a
    newer fence than its own (the side that went on saved since)."""
    if st is None:
        return None
    now = failover.epoch_now(ctx.store, ctx.cfg.elastic.heartbeat_timeout_s / 2)
    if now is not None and now[0] > st.epoch and now[1] is not None and ctx.rank not in now[1]:
        return f"the job went on without it (epoch {now[0]}, members {list(now[1])})"
    cfg = ctx.cfg
    root = checkpoints.shard_root(cfg.checkpoint.dir or RESCUE_DIR, ctx.shard, cfg.parallel.tp)
    newest, mine = disk.newest_fence(root), disk.Fence(ctx.run, st.epoch)
    if newest is not None and newest > mine:
        return f"{root} holds a newer checkpoint ({newest.name}) than its own {mine.name}: the job went on without it"
    return None


def save_and_stop(ctx, st: RankState | None, reason: str, noticed_at: float, writer=None) -> int:
    """Save this rank's part and say what happened; returns the exit code. ``writer``: the metrics
    writer, on the rank that writes them (a ``store_lost`` record)."""
    cfg = ctx.cfg
    root = checkpoints.shard_root(cfg.checkpoint.dir or RESCUE_DIR, ctx.shard, cfg.parallel.tp)
    if st is None:
        print(f"elaswave: rank {ctx.rank}: {reason}; it had not joined the training, so it has nothing "
              "to save", file=sys.stderr, flush=True)
        return EXIT_STORE_LOST
    began = time.perf_counter()
    checkpointer = ctx.checkpointer or disk.Checkpointer(root, ctx.rank, 0, cfg.checkpoint.keep,
                                                         cfg.model_identity(), cfg.parallel.chunk_numel, ctx.run,
                                                         cfg.sources(), cfg.data_identity())
    try:
        checkpointer.wait()  # a background save of the same generation must not race ours
    except disk.CheckpointError as exc:
        print(f"elaswave: rank {ctx.rank}: {exc}", file=sys.stderr, flush=True)
    plan, owned = st.plan, st.optimizer.keys()
    saved = []
    for gen, keys in sorted(st.optimizer.holding().items(), reverse=True):
        # A generation whose chunks are not all here (moments still arriving) would make a
        # checkpoint that claims what it lacks: leave it out, the other one is whole.
        if sorted(keys) != sorted(owned) or disk.is_complete(root, gen):
            continue
        payload = torch.stack([st.optimizer.chunk(k, gen) for k in owned]) if owned else torch.empty(0)
        refused = len(checkpointer.fenced_off)
        checkpointer.save(gen, plan.chunk_owners, owned, payload, is_writer=ctx.rank == plan.ranks[0], epoch=st.epoch)
        checkpointer.wait()
        if len(checkpointer.fenced_off) == refused:
            saved.append(gen)
    newest = st.optimizer.gen
    took = time.perf_counter() - began
    if writer is not None:
        writer.write({"event": "store_lost", "step": newest, "dir": root, "reason": reason,
                      "noticed_wall": noticed_at, "save_s": took, "generations_saved": saved,
                      "wall_time": time.time()})
    if ctx.rank == plan.ranks[0]:
        again = "the same command" + ("" if cfg.checkpoint.dir else f" with --set checkpoint.dir={RESCUE_DIR}")
        print(f"elaswave: {reason}. Without it the job cannot change its membership, so every rank "
              f"stopped and saved its state: the job is at step {newest} in {disk.step_dir(root, newest)}. "
              f"Run {again} (checkpoint.resume is on by default) to continue from step {newest}.",
              file=sys.stderr, flush=True)
    else:
        print(f"elaswave: rank {ctx.rank}: {reason}; saved its part of step {newest} in {root} ({took:.2f} s)",
              file=sys.stderr, flush=True)
    return EXIT_STORE_LOST

