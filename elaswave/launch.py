"""Local launcher: hosts torch's TCPStore, spawns one worker process per rank, and watches them.

Elastic jobs: a worker that dies is reported to the control plane at once (``ew/dead/<rank>`` and
an alert), which is how the survivors learn of a SIGKILL in milliseconds instead of waiting for a
collective to time out; the survivors go on. The job is over when every worker has exited, or
when the job has stamped ``done`` and the rest are hung or left out (they are then killed).
Non-elastic jobs stop every worker when one fails.

Several hosts: one launcher per host, as an *agent* (:mod:`elaswave.control.agents`): node 0's
hosts the store, each starts and watches its own host's workers, and a worker's death costs that
rank alone. The same worker entry point also runs under ``torchrun`` (see README).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time

import torch.distributed as dist

from elaswave.config import JobConfig
from elaswave.errors import ConfigError
from elaswave.forkserver import Starter, open_starter
from elaswave.control import addresses, agents, failover, job_store, rank_numbers, rendezvous, seal, signpost
from elaswave.control.admission import job_token, new_token, Admission
from elaswave.control.agents import AgentRefused, Node
from elaswave.control.health import HostHealth
from elaswave.control.link import EXIT_EXCLUDED, EXIT_GROUP_LEFT, EXIT_STORE_LOST, StoreLink, StoreLost
from elaswave.control.liveness import Prober
from elaswave.control.membership import PREFIX, Membership
from elaswave.workers import Workers, stop

STORE_POLL_S = 0.25
"""How often an agent's watch reads the store (``ew/done``, the step for scheduled joins)."""


class _Terminated(Exception):
    """The launcher was asked to stop (SIGTERM/SIGHUP): its workers are stopped with it."""


def _on_terminate(signum, frame) -> None:
    raise _Terminated(signum)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _check_devices(cfg: JobConfig, node: Node) -> None:
    """Each worker and each warm spare of a host needs a GPU of its own under NCCL."""
    import torch

    if cfg.parallel.backend == "gloo" or not torch.cuda.is_available():
        return
    have, workers = torch.cuda.device_count(), node.workers(cfg.world_size)
    if workers > have:
        raise ConfigError(f"parallel.dp x parallel.pp = {workers} workers on this host is invalid under NCCL: it has "
                          f"{have} GPU(s), one per worker; use at most {have} workers here, or parallel.backend=gloo")
    if workers + cfg.elastic.spares > have:
        raise ConfigError(f"elastic.spares={cfg.elastic.spares} is invalid: this host has {have} GPUs for its "
                          f"{workers} workers; at most {max(0, have - workers)} spares fit")


def launch(cfg: JobConfig, metrics_out: str | None = None, host: str = "127.0.0.1",
           timeout_s: float | None = None, done_grace_s: float = 10.0, node: Node = Node(),
           health: HostHealth | None = None, outcome: dict | None = None) -> int:
    """Run the job (or, with ``node``, this host's share of it) to completion; returns the exit
    code (0 when the training finished). ``health``: where this host's state is kept for a probe;
    ``outcome``: gets ``watching``, this agent's watch (``followed``: it followed the store to where
    the members moved it).

    On one host the store binds to ``host`` (loopback unless told otherwise). Joining ranks must
    prove the job's token: ``ELASWAVE_TOKEN`` from the environment, or (one host only) a new random
    one that only this launcher's own replacements know."""
    node.validate(cfg.world_size, job_token())
    starter = open_starter()  # before any thread, socket or device context of this process
    code = 1
    try:
        code = _launch(cfg, metrics_out, host, timeout_s, done_grace_s, node, starter, health, outcome)
        return code
    except ConfigError:
        code = 2  # the one-line error's code (cli.main)
        raise
    finally:
        starter.close()
        if health is not None:
            health.stopped(code)


def _launch(cfg: JobConfig, metrics_out: str | None, host: str, timeout_s: float | None, done_grace_s: float,
            node: Node, starter: Starter, health: HostHealth | None = None, outcome: dict | None = None) -> int:
    addresses.check_bind_address(cfg.parallel.bind_address)  # before anything listens
    _check_devices(cfg, node)
    if node.rdzv_backend == "etcd":
        cfg.elastic.store_failover = False  # no process holds the store: there is nothing to move
    store, store_addr = job_store.open_store(node, host, cfg.parallel.timeout_s, cfg.elastic.heartbeat_timeout_s)
    token = job_token() or new_token()
    try:
        store = seal.open_job(store, token, found=node.node_rank != 0, wait=True)
    except seal.TokenMismatch:
        raise AgentRefused("ELASWAVE_TOKEN differs from node 0's: every agent of a job must be started with the "
                           "same token") from None
    except (RuntimeError, OSError):
        raise AgentRefused(f"--rdzv-endpoint={node.rdzv_endpoint}: node 0's agent did not publish the job's "
                           f"settings within parallel.timeout_s={cfg.parallel.timeout_s:g} s") from None
    if node.node_rank == 0:
        # What `elaswave join` needs to add a rank from elsewhere: the job's config and a rank number.
        rank_numbers.set_floor(store, cfg.world_size)  # the founding ranks' numbers are taken
        store.set(PREFIX + "config", json.dumps(cfg.to_dict()))
        if node.is_multi_host:
            agents.publish(store, node, cfg.world_size, cfg.to_dict())
    else:
        try:
            agents.check_in(store, node, cfg.world_size, cfg.to_dict())
        except (RuntimeError, OSError):
            raise AgentRefused(f"--rdzv-endpoint={node.rdzv_endpoint}: node 0's agent did not publish the job's "
                               f"settings within parallel.timeout_s={cfg.parallel.timeout_s:g} s") from None
    membership = Membership(store, -1)
    post = signpost.open_signpost(node.signpost, store_addr, cfg.parallel.timeout_s)
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="elaswave-", delete=False) as fh:
        json.dump(cfg.to_dict(), fh)
        cfg_path = fh.name
    workers = Workers(cfg, cfg_path, store, store_addr, metrics_out, token, node, membership, starter)
    if cfg.elastic.enabled and node.node_rank == 0:
        how = ("with this job's ELASWAVE_TOKEN" if job_token() else
               "(none can: set ELASWAVE_TOKEN before `elaswave run` to allow it)")
        print(f"elaswave: store at {workers.store_addr}; more ranks join with `elaswave join --store "
              f"{workers.store_addr}` {how}", flush=True)
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {sig: signal.signal(sig, _on_terminate) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        for _ in node.founding_ranks(cfg.world_size):
            workers.spawn()
        if node.is_spare:
            workers.fill_spare_host()
        for _ in range(cfg.elastic.spares if cfg.elastic.enabled else 0):
            workers.spawn_spare()
        watching = _Watching(cfg, node)
        watching.health, watching.signpost = health, post
        if outcome is not None:
            outcome["watching"] = watching
        while True:
            try:
                code = _watch(cfg, workers, store, membership, timeout_s, done_grace_s, watching)
                break
            except StoreLost as lost:
                # (Standing spares aside: they wait for the job's end, which this agent may not have
                # read yet when the member holding a moved store finishes and takes it along.)
                if watching.done or _finished_here(workers, watching.reported):
                    # Its holder (a member, after a move) left at the end: nothing to follow.
                    code = _wait_for_workers(cfg, workers)
                    break
                if not _follow(cfg, workers, store, watching, lost):
                    if _finished_here(workers, watching.reported):  # they finished while it looked
                        code = _wait_for_workers(cfg, workers)
                        break
                    if watching.directory is not None and watching.directory.why_not:
                        print(f"elaswave: this agent found nowhere to follow the job's store: "
                              f"{watching.directory.why_not}", file=sys.stderr, flush=True)
                    return _after_store_lost(cfg, workers, lost)
        if node.is_multi_host:
            _finish(store, node, done_grace_s)
        if node.rdzv_backend == "etcd" and node.node_rank == 0:
            _close_run(store)
        return code
    except KeyboardInterrupt:
        stop(workers.all())
        return 130
    except _Terminated as exc:
        print(f"elaswave: this agent got {signal.Signals(exc.args[0]).name}; stopping this host's workers",
              file=sys.stderr, flush=True)
        stop(workers.all())
        return 128 + exc.args[0]
    finally:
        stop(workers.all())
        for sig, old in handlers.items():
            signal.signal(sig, old)
        os.unlink(cfg_path)


class _Watching:
    """What an agent's watch has done and has yet to do: kept when it follows a moved store."""

    def __init__(self, cfg: JobConfig, node: Node):
        self.reported: set[int] = set()
        # Scheduled joins are the job's, so one agent (node 0's) starts them; replacements are each host's own.
        self.joins = sorted((f for f in cfg.elastic.faults if f.kind == "join"), key=lambda f: f.step) \
            if node.node_rank == 0 else []
        self.respawns: list[float] = []
        """When to start the next replacements (monotonic clock)."""
        # (With tp the ranks register no standby: the store does not move.)
        moves = node.node_rank != 0 and cfg.elastic.store_failover and cfg.parallel.tp == 1
        self.directory = failover.Directory() if moves else None
        """Where the store may move (an agent that does not host it)."""
        self.started = time.monotonic()
        self.done = False
        """The training finished (``ew/done``)."""
        self.health: HostHealth | None = None
        """Where this host's state is kept for a probe (``--health-file``)."""
        self.signpost: signpost.Signpost | None = None
        """Where this agent tells joiners the store's address (under Slurm)."""
        self.followed = False
        """This agent followed the store to where the members moved it."""


def _watch(cfg: JobConfig, workers: Workers, store: dist.TCPStore, membership: Membership,
           timeout_s: float | None, done_grace_s: float, watching: _Watching) -> int:
    deadline = None if timeout_s is None else watching.started + timeout_s
    reported, joins, respawns = watching.reported, watching.joins, watching.respawns
    done_at, asked_at = None, 0.0
    others = _OtherHosts(store, workers) if workers.node.is_multi_host and workers.node.node_rank == 0 else None
    while True:
        if watching.directory is not None and cfg.elastic.enabled:
            watching.directory.refresh(store)
        codes = {rank: p.poll() for rank, p in workers.procs.items()}
        if watching.health is not None:  # a rank that has exited says nothing more (its last word is stale)
            watching.health.update(live={rank for rank, code in codes.items() if code is None})
        for rank, code in codes.items():
            if code in (None, 0) or rank in reported:
                continue
            reported.add(rank)
            if code == EXIT_STORE_LOST and workers.lost_spare(rank):  # a spare of the store that moved
                if done_at is None:
                    workers.spawn_spare()
                continue
            if workers.started_before_move(rank) and not _is_member(cfg, store, membership, rank):
                # Never admitted. Its death is recorded only where its number is still its own: had
                # it asked in on this store, the leader would admit it at every step and wait for
                # it. Its replacement starts on the store the job is on.
                if rank_numbers.reclaim(store, rank, workers.started_on[rank][1]):
                    membership.report_dead(rank, _describe(code), alert=False)
                print(f"elaswave: rank {rank}, started on the store the job moved away from, {_describe(code)}; "
                      "starting another", file=sys.stderr, flush=True)
                if done_at is None:
                    workers.spawn(joining=True)
                continue
            if code == EXIT_STORE_LOST:  # it saved its state and said so: nothing to report or replace
                continue
            if code == EXIT_GROUP_LEFT:  # alive, its tensor-parallel group broken: a spare takes its device
                if done_at is None:
                    _replace(cfg, workers, respawns, rank, ", which left with its tensor-parallel group")
                continue
            if workers.lost_spare(rank):
                print(f"elaswave: spare rank {rank} {_describe(code)}; starting another", file=sys.stderr, flush=True)
                if done_at is None:
                    workers.spawn_spare()
                continue
            print(f"elaswave: rank {rank} {_describe(code)}", file=sys.stderr, flush=True)
            if not cfg.elastic.enabled:
                stop(workers.all())  # not elastic: one dead rank ends the job
                return code if code > 0 else 1
            if cfg.elastic.launcher_reports_deaths:
                membership.report_dead(rank, _describe(code), alert=_is_member(cfg, store, membership, rank))
            if done_at is None:
                _replace(cfg, workers, respawns, rank)
        # The children are polled every loop (a death is reported at once); the store only every
        # STORE_POLL_S: on etcd each read is a request through the cluster's leader, and at the
        # loop's pace the agent alone kept the members busier than the whole job's control plane.
        asks = time.monotonic() - asked_at >= STORE_POLL_S or all(c is not None for c in codes.values())
        if asks:
            asked_at = time.monotonic()
        if asks and done_at is None and membership.read_stamp("done") is not None:  # sealed: a forged one ends nothing
            done_at, watching.done = time.monotonic(), True
        if done_at is None:
            _start_joiners(workers, joins if asks else [], respawns, membership)
        if others is not None and done_at is None and _side_stopped(workers, codes):
            # This host's workers found their side without a majority (or its store lost) and saved:
            # the job goes on elsewhere, if anywhere, on a store it moved away from this one.
            print("elaswave: this host's workers stopped without a majority of the job; the store it holds "
                  "is not the job's any more, and this agent stops", file=sys.stderr, flush=True)
            stop(workers.all(), grace_s=1.0)
            return EXIT_STORE_LOST
        if all(c is not None for c in codes.values()) and not (done_at is None and others and others.training()):
            if (done_at is None and 0 in codes.values() and workers.node.is_multi_host
                    and _done_within(membership, done_grace_s)):
                done_at, watching.done = time.monotonic(), True
            if done_at is not None or all(c in (0, EXIT_GROUP_LEFT) for c in codes.values()):
                return 0
            first = next(c for c in codes.values() if c not in (None, 0, EXIT_GROUP_LEFT))
            return first if first > 0 else 1
        members = _final_members(store, membership, cfg.world_size) if done_at is not None else ()
        members_exited = done_at is not None and all(codes.get(r, 0) is not None for r in members)  # (a rank joined from elsewhere is not ours to wait for)
        if done_at is not None and (members_exited or time.monotonic() - done_at > done_grace_s):
            hung = [r for r, c in codes.items() if c is None and r not in workers.standing]
            if hung:
                print(f"elaswave: training finished; stopping ranks {hung}, which were left out of it",
                      file=sys.stderr, flush=True)
            stop(workers.all(), grace_s=1.0)
            return 0
        if deadline is not None and time.monotonic() > deadline:
            print(f"elaswave: job exceeded {timeout_s}s; stopping it", file=sys.stderr, flush=True)
            stop(workers.all())
            return 124
        time.sleep(0.005)


def _done_within(membership: Membership, within_s: float) -> bool:
    """Whether the training's end is stamped within ``within_s``. A worker that exited 0 finished
    the training, but the rank that writes the summary -- on another host -- stamps "done" after
    the others may have exited: read too early, a host whose worker had been killed on the way
    exited 1 for a finished run (issue 58). (On one host every worker has exited: the stamp is
    final, and a run that failed its end check, with some workers at 0, is not held up.) A store
    gone meanwhile raises StoreLost: its holder finished and left."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if membership.read_stamp("done") is not None:
            return True
        time.sleep(0.05)
    return False


def _side_stopped(workers: Workers, codes: dict[int, int | None]) -> bool:
    """Whether every worker of this host (spares aside) has exited and one of them because its side
    had no majority or lost the store: on the host holding the store that means the others, if
    they go on, moved it (it is local: only a side cut off from the rest loses it here)."""
    working = [c for r, c in codes.items() if r not in workers.standing]
    return bool(working) and None not in working and EXIT_STORE_LOST in working


def _replace(cfg: JobConfig, workers: Workers, respawns: list[float], rank: int, why: str = "") -> None:
    """``rank`` is gone from the training: the oldest warm spare asks in for it, or without one a
    replacement starts after ``elastic.respawn_after_s`` (if set)."""
    spare = workers.promote()
    if spare is not None:
        print(f"elaswave: spare rank {spare} replaces rank {rank}{why}", file=sys.stderr, flush=True)
    elif cfg.elastic.respawn_after_s >= 0:
        respawns.append(time.monotonic() + cfg.elastic.respawn_after_s)


def _follow(cfg: JobConfig, workers: Workers, store, watching: _Watching, lost: StoreLost) -> bool:
    """The job's store is gone: if the members moved it to a standby (elaswave.control.failover),
    this agent goes there too, within ``parallel.timeout_s``; whether it did."""
    if watching.directory is None or not cfg.elastic.enabled:
        return False
    # (A spare host follows even with none of its ranks left: they stand by again on the moved store.)
    addr = watching.directory.follow(store, cfg.parallel.timeout_s, cfg.parallel.timeout_s,
                                     pointless=lambda: not workers.node.is_spare and
                                     all(p.poll() is not None for p in workers.all()))
    if addr is None:
        return False
    workers.store_addr = addr  # the replacements and spares it starts from now on
    watching.followed = True
    if watching.signpost is not None:
        watching.signpost.point(addr)
    if workers.node.is_spare:  # its ranks that left with the old store (before this agent followed) start again
        workers.fill_spare_host()
    workers.stop_stale_joiners(lambda rank: _is_member(cfg, store, workers.membership, rank))
    failover.followed(store, workers.node.node_rank)
    workers.membership.spares_standing(len(workers.standing))
    print(f"elaswave: {lost}; the job's store moved to {addr}, and this agent follows it", file=sys.stderr, flush=True)
    return True


def _finished_here(workers: Workers, reported: set[int]) -> bool:
    """Whether the store went because its holder -- a member on this host, after a move -- finished
    the training and exited (0) before this agent read ``done``: then this host's other members
    finish too (waited for, bounded). Workers already accounted for (a spare the move left behind,
    a joiner on the old store) and standing spares do not count."""
    mine = [p for r, p in workers.procs.items() if r not in workers.standing and r not in reported]
    if not any(p.poll() == 0 for p in mine):
        return False
    deadline = time.monotonic() + workers.cfg.parallel.timeout_s
    while any(p.poll() is None for p in mine) and time.monotonic() < deadline:
        time.sleep(0.05)
    return all(p.poll() == 0 for p in mine)


def _wait_for_workers(cfg: JobConfig, workers: Workers) -> int:
    """After the training finished: this host's workers exit on their own (bounded); 0 if all did."""
    deadline = time.monotonic() + cfg.parallel.timeout_s
    while any(p.poll() is None for p in workers.all()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return 0


def _after_store_lost(cfg: JobConfig, workers: Workers, lost: StoreLost) -> int:
    """The job's store (on node 0) is gone: this host's workers notice too, save their state and
    exit; wait for them (bounded), then stop with the same code."""
    print(f"elaswave: {lost}; this host's workers save their state and stop", file=sys.stderr, flush=True)
    deadline = time.monotonic() + cfg.parallel.timeout_s + cfg.elastic.heartbeat_timeout_s
    while any(p.poll() is None for p in workers.all()) and time.monotonic() < deadline:
        time.sleep(0.05)
    codes = [p.poll() for p in workers.all()]
    if EXIT_EXCLUDED in codes and EXIT_STORE_LOST not in codes:
        # The store lives on; this host was away (paused past its links' grace) and the job went
        # on without its workers: say that, not that the store was lost.
        return EXIT_EXCLUDED
    return EXIT_STORE_LOST


class _OtherHosts:
    """Node 0's view of the ranks on other hosts: while one lives, the job may go on there and
    needs the store this agent hosts, even when every worker of this host is gone."""

    def __init__(self, store: dist.TCPStore, workers: Workers, every_s: float = 0.5):
        self.store, self.workers, self.every_s = store, workers, every_s
        self.prober, self._checked, self._answer = Prober(), 0.0, True
        self._ranks = 0

    def training(self) -> bool:
        if time.monotonic() - self._checked >= self.every_s:
            self._checked = time.monotonic()
            self._ranks = rank_numbers.count(self.store, self._ranks)
            membership = self.workers.membership
            members = membership.members_of(membership.current_epoch())
            # A joiner still asking in (a spare host's) trains nothing: a failed job does not wait for it.
            ranks = [r for r in range(self._ranks) if r not in self.workers.procs and (members is None or r in members)]
            dead = self.workers.membership.proven_dead(ranks)  # by their agents (a port on another host proves nothing)
            self._answer = any(self.prober.is_alive(r, self.store) for r in ranks if r not in dead)
        return self._answer


def _finish(store: dist.TCPStore, node: Node, grace_s: float) -> None:
    """Node 0 keeps the store up until the other agents are done with it; they say when."""
    try:
        if node.node_rank == 0:
            missing = agents.wait_for_others(store, node, grace_s)
            if missing:
                print(f"elaswave: {missing} other host agent(s) did not report finishing within {grace_s:g} s; "
                      f"closing the job's store", file=sys.stderr, flush=True)
        else:
            agents.finished(store, node.node_rank)
    except (RuntimeError, OSError):  # node 0's store is gone: nobody is left to tell
        pass


def _close_run(store: StoreLink) -> None:
    try:
        rendezvous.close_etcd_run(store)
    except (StoreLost, RuntimeError, OSError):  # no majority now: a later agent may find the run open
        pass


def _start_joiners(workers: Workers, joins: list, respawns: list[float], membership: Membership) -> None:
    """Start the joins the job asked for (``join:step=S``, once it reaches step S) and the
    replacements that are due."""
    now = time.monotonic()
    while respawns and respawns[0] <= now:
        respawns.pop(0)
        rank = workers.spawn(joining=True)
        print(f"elaswave: starting rank {rank} to replace a lost one", file=sys.stderr, flush=True)
    if joins:
        reached = membership.read_stamp("step")
        while joins and reached is not None and reached >= joins[0].step:
            f = joins.pop(0)
            ranks = [workers.spawn(joining=True) for _ in range(f.count)]
            print(f"elaswave: starting ranks {ranks} to join at step {int(reached)}", file=sys.stderr, flush=True)


def _is_member(cfg: JobConfig, store: dist.TCPStore, membership: Membership, rank: int) -> bool:
    """Whether ``rank``'s death concerns the members: it is one, or was admitted into the next
    epoch. A joiner that dies before that (or that was refused) is only recorded dead."""
    epoch = membership.current_epoch()
    members = (membership.members_of(epoch) if epoch else None) or tuple(range(cfg.world_size))
    return rank in members or rank in Admission(store, -1).joining(epoch + 1)


def _final_members(store: dist.TCPStore, membership: Membership, world_size: int) -> tuple[int, ...]:
    epoch = membership.current_epoch()
    return (membership.members_of(epoch) if epoch else None) or tuple(range(world_size))
