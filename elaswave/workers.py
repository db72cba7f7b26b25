"""This host's worker processes: its founding ranks, its warm spares and the joiners it starts
later under new rank numbers, each started by the launcher's :class:`~elaswave.forkserver.Starter`
with the environment a worker reads (``RANK``, ``ELASWAVE_STORE``, the job's token, ...)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import torch.distributed as dist

from elaswave.config import JobConfig
from elaswave.control import rank_numbers
from elaswave.control.admission import JOIN_ENV, SPARE_ENV, SPARE_HOST_ENV, STARTED_ENV, TOKEN_ENV, promote
from elaswave.control.agents import NODE_RANK_ENV, NODES_ENV, Node
from elaswave.control.membership import Membership
from elaswave.forkserver import Starter


def stop(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM every live worker, then SIGKILL what is still there after ``grace_s``."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            p.send_signal(signal.SIGCONT)  # a stopped process only acts on SIGTERM once continued
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()



class Workers:
    """This host's worker processes: its founding ranks, and the joiners started later under new ranks."""

    def __init__(self, cfg: JobConfig, cfg_path: str, store: dist.TCPStore, store_addr: str,
                 metrics_out: str | None, token: str, node: Node, membership: Membership, starter: Starter):
        self.cfg, self.cfg_path, self.store_addr, self.metrics_out = cfg, cfg_path, store_addr, metrics_out
        self.store, self.token, self.node = store, token, node
        self.procs: dict[int, subprocess.Popen] = {}
        self.slots: dict[int, int] = {}
        """rank -> its LOCAL_RANK on this host."""
        self.standing: list[int] = []
        """Warm spares of this host standing by, oldest first."""
        self.started_on: dict[int, tuple[str, str]] = {}
        """joiner's rank -> the store it was started on, and the id of its number's claim there."""
        self.membership = membership
        self.starter = starter

    def stop_stale_joiners(self, is_member) -> None:
        """After following the store: a joiner started on the old one that is not a member (never
        admitted, it cannot follow: its store is the old one) stops, and the watch loop starts
        another on this one (``is_member(rank)``: whether the job holds it)."""
        for rank, proc in self.procs.items():
            if proc.poll() is None and self.started_before_move(rank) and not is_member(rank):
                # Its number stays taken here too (unless the new store gave it to another already):
                # no two processes of the job are ever known by one number.
                rank_numbers.reclaim(self.store, rank, self.started_on[rank][1])
                print(f"elaswave: rank {rank} was starting on the store the job moved away from; it stops",
                      file=sys.stderr, flush=True)
                stop([proc], grace_s=1.0)

    def started_before_move(self, rank: int) -> bool:
        """Whether ``rank`` is a joiner (not a standing spare) started on a store the job has moved
        away from: unless it was admitted before the move, it cannot follow (its store is the old one)."""
        return rank in self.started_on and self.started_on[rank][0] != self.store_addr and rank not in self.standing

    def spawn_spare(self) -> int:
        rank = self.spawn(joining=True, spare=True)
        self.standing.append(rank)
        self.membership.spares_standing(+1)
        return rank

    def promote(self) -> int | None:
        """The oldest standing spare asks in now; a new spare starts in its place. None: no spare."""
        while self.standing:
            rank = self.standing.pop(0)
            self.membership.spares_standing(-1)
            if self.procs[rank].poll() is None:
                promote(self.store, rank)
                self.spawn_spare()
                return rank
        return None

    def lost_spare(self, rank: int) -> bool:
        """Whether ``rank`` was a standing spare (its death costs the job nothing; it is replaced)."""
        if rank not in self.standing:
            return False
        self.standing.remove(rank)
        self.membership.spares_standing(-1)
        return True

    def spawn(self, joining: bool = False, spare: bool = False) -> int:
        world_size = self.cfg.world_size
        founding = self.node.founding_ranks(world_size)
        rank, claim = rank_numbers.claim(self.store) if joining else (founding[len(self.procs)], "")
        # The lowest local slot (a GPU under NCCL) no live worker of this host has: a replacement
        # takes the dead one's device.
        taken = {self.slots[r] for r, p in self.procs.items() if p.poll() is None}
        local = self.slots[rank] = min(set(range(len(self.procs) + 1)) - taken)
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local),
                   LOCAL_WORLD_SIZE=str(self.node.workers(world_size)), ELASWAVE_STORE=self.store_addr, OMP_NUM_THREADS="1")
        env[TOKEN_ENV], env[NODES_ENV], env[NODE_RANK_ENV] = self.token, str(self.node.nnodes), str(self.node.node_rank)
        if joining:
            env[JOIN_ENV], env[STARTED_ENV], env[rank_numbers.CLAIM_ENV] = "1", repr(time.time()), claim
            self.started_on[rank] = (self.store_addr, claim)
        if spare:
            env[SPARE_ENV] = "1"
        if self.node.is_spare:  # a spare host's every rank waits for room in the job
            env[SPARE_HOST_ENV] = "1"
        # The watchers' store waits time out every heartbeat interval by design; keep c10d quiet.
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        args = ["--config", self.cfg_path]
        if self.metrics_out:  # any rank may become the writer when rank 0 is gone
            args += ["--metrics-out", self.metrics_out]
        # No parent-death signal: when this process dies, the store it hosts goes with it and the
        # workers notice within the heartbeat timeout, save their state and exit
        # (elaswave.runtime.rescue); on a host whose agent died, the workers keep training.
        self.procs[rank] = self.starter.start(args, env, rank)
        return rank

    def fill_spare_host(self) -> None:
        """A spare host: as many live ranks as a training host runs, each asking in (warm) for
        the room a lost rank leaves; started at first, and again on a store the job moved to."""
        live = sum(p.poll() is None for p in self.procs.values())
        for _ in range(self.node.workers(self.cfg.world_size) - live):
            self.spawn(joining=True)

    def all(self) -> list[subprocess.Popen]:
        return list(self.procs.values())
