"""What a rank keeps across epochs (:class:`Context`): its control-plane links and standby store,
its communicator, weights, data and fault injector, and the moves of the job's store it takes
part in (:mod:`elaswave.control.failover`)."""
from __future__ import annotations

import os
import sys
import time
from functools import cached_property

import torch

from elaswave.checkpoint import disk
from elaswave.comm import backend
from elaswave.comm.groups import Communicator
from elaswave.config import JobConfig
from elaswave.control import failover, rank_numbers, rendezvous, seal
from elaswave.control.agents import NODES_ENV, host_name
from elaswave.control.admission import JOIN_ENV, Admission, Refused, job_token
from elaswave.control.faults import FaultInjector
from elaswave.control.heartbeat import Watcher
from elaswave.control.link import StoreLink, StoreLost
from elaswave.control.liveness import LivenessPort, Prober
from elaswave.control.membership import Membership
from elaswave.data.mixture import Mixture, mixture_of, tokens_per_source
from elaswave.data.sampler import Sampler, open_sampler
from elaswave.data.trace import DATA_TRACE_ENV, DataTrace
from elaswave.interrupt import Interrupt
from elaswave.model.registry import model_for
from elaswave.pipeline.schedule import Action, Op
from elaswave.pipeline.stage import Stage
from elaswave.plan.memory import MemoryModel
from elaswave.precision import compute_dtype
from elaswave.runtime import actuator, join
from elaswave.runtime.evaluation import Evaluation
from elaswave.runtime.memory import job_memory_model
from elaswave.runtime.metrics import StepJournal
from elaswave.runtime.straggler import SpeedWindow
from elaswave.snapshot.pool import SnapshotPool
from elaswave.tensor import checkpoints
from elaswave.tensor.layout import Devices


class Context:
    """What a rank keeps across epochs: its control-plane links, communicator, weights and data."""

    def __init__(self, cfg: JobConfig, rank: int, store: StoreLink, backend_name: str, device: torch.device):
        e = cfg.elastic
        # Every control record this rank writes is sealed with the job's key, every one it reads verified.
        store = seal.open_job(store, job_token(), found=bool(os.environ.get(JOIN_ENV)))
        claim = os.environ.get(rank_numbers.CLAIM_ENV)
        if claim and not rank_numbers.reclaim(store, rank, claim):
            raise Refused(f"rank number {rank} is another process's on the job's store at "
                          f"{store.addr or getattr(store, 'description', 'torchrun')} (it moved "
                          "while this one started): this one stops")
        self.store = store
        self.memory_limit: dict | None = None
        """Where the plans' memory limit came from (``runtime.device_memory``): the job's first record says."""
        self.cfg, self.rank, self.device, self.backend_name = cfg, rank, device, backend_name
        self._placed = (None, Devices.founding(cfg.world_size, cfg.parallel.tp))
        """(the plan of the epoch this rank is in, the job's devices then): one value, read at once
        by the watcher's thread."""
        self.interrupt = Interrupt()
        bind = backend.bind_address(cfg.parallel.bind_address, os.environ.get("ELASWAVE_STORE"))
        # Registered before anything else: from now on a peer can prove this process dead.
        self.liveness = LivenessPort(bind) if e.enabled else None
        if self.liveness is not None:
            self.liveness.register(store, rank)
        # With tp the store does not move (elastic.store_failover is not built for slices yet).
        self.standby = (failover.Standby(backend.listen_address(bind, os.environ.get("ELASWAVE_STORE")),
                                         cfg.parallel.timeout_s)
                        if e.enabled and e.store_failover and cfg.parallel.tp == 1 else None)
        if self.standby is not None:
            self.standby.register(store, rank)
        self.prober = Prober() if e.enabled else None
        # Hosts can be cut apart around one TCPStore: a side must hold a majority to decide (on
        # etcd, etcd's own majority is that arbiter; on one host there is nothing to cut).
        self.membership = Membership(store, rank, prober=self.prober, requires_majority=_hosts_around_a_tcpstore())
        self.membership.announce_host(host_name())
        self.admission = Admission(store, rank)
        self.stamps_steps = any(f.kind == "join" for f in cfg.elastic.faults)
        self.comm = Communicator(store, rank, backend_name, device, cfg.parallel.timeout_s, self.interrupt,
                                 e.enabled and e.standby_groups, bind)
        self.pool = (SnapshotPool(rank, cfg.parallel.chunk_numel, e.heartbeat_timeout_s)
                     if e.enabled and e.snapshots else None)
        # A fault is an event in the run's life: a job restarted by torchrun does not meet it again.
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.injector = FaultInjector(cfg.elastic.faults if first_attempt else [], rank, self.membership)
        self.run = 0
        """Which run of the checkpoint directory this job is: with the epoch, the fence of what it writes there."""
        self.actuator = actuator.make(cfg.actuator, device)
        self.measured_memory: dict | None = None
        """This rank's peak in train.measure_memory_step, beside what the memory model predicted for it."""
        self.speed = 0.0
        """Micro-batches per second of this rank's own forward and backward time, measured at its
        frequency level (median of the epoch's last steps); the re-plan balances by it. 0 until a
        step has measured it: the planner then counts the rank as the median one (a placeholder of
        1.0 read as measured made a rank of cheaper layers look slower after a loss in step 0)."""
        self.speeds = SpeedWindow()
        self.agreed_epoch = 0
        """The newest epoch whose members this rank agreed on (it may not have trained yet)."""
        self.agree_grace_s = 0.0
        """Extra time the next agreement waits for silent members (after the store moved from a recovery)."""
        self.journal = StepJournal()
        """This rank's step and eval records not yet committed (a change shares them)."""
        self.step = 0
        self.last_step_wall: float | None = None
        """When this rank's last step ended (wall clock): see :meth:`note_step`."""
        # The watcher has its own store connection: its blocking waits must never stall training.
        self.watcher = Watcher(store.separate(), rank, self._view, self.interrupt,
                               e.heartbeat_interval_s, e.heartbeat_timeout_s, self.prober,
                               agreed=lambda: self.agreed_epoch) if e.enabled else None
        if self.watcher is not None and self.watcher.lease is not None:
            lease = self.watcher.lease
            self.admission.counted = lambda: lease.requests_seen
        self._sampler = None
        # A joiner learns its shard when it is admitted (its device is decided then): see place().
        self.place(0 if os.environ.get(JOIN_ENV) else self.devices.shard_of(rank))

    def place(self, shard: int) -> None:
        """This rank holds shard ``shard`` of its device's layers (always 0 without tp): the model
        it builds, its evaluation and the slice's checkpoint directory follow."""
        cfg, c = self.cfg, self.cfg.checkpoint
        self.shard = shard
        self.model = model_for(cfg, shard)
        """The model contract every stage, plan and recovery of this rank goes through (with
        parallel.tp: this rank's shard of it)."""
        self.checkpoint_root = checkpoints.shard_root(c.dir, shard, cfg.parallel.tp)
        """Where this rank's slice keeps its disk checkpoints (checkpoint.dir itself without tp)."""
        self.checkpointer = disk.Checkpointer(self.checkpoint_root, self.rank, c.every_steps, c.keep,
                                              cfg.model_identity(), cfg.parallel.chunk_numel, source=cfg.sources(),
                                              data=cfg.data_identity()) if c.dir else None
        if self.checkpointer is not None:
            self.checkpointer.run = self.run
        self.evaluation = Evaluation(cfg, self.model)
        self.__dict__.pop("memory_model", None)

    @property
    def plan(self):
        return self._placed[0]

    @plan.setter
    def plan(self, plan) -> None:
        self._placed = (plan, self._placed[1])

    @property
    def devices(self) -> Devices:
        """The job's devices in this rank's epoch (:mod:`elaswave.tensor.layout`)."""
        return self._placed[1]

    def settle(self, plan, devices: Devices) -> None:
        """This rank is now in ``plan``'s epoch, whose devices are ``devices``."""
        self._placed = (plan, devices)

    @cached_property
    def memory_model(self) -> MemoryModel:
        return job_memory_model(self.cfg, self.model, compute_dtype(self.cfg.train.precision, self.device), self.device)

    def set_run(self, run: int) -> None:
        self.run = run
        if self.checkpointer is not None:
            self.checkpointer.run = run

    def sampler_for(self, stage: Stage | None) -> Sampler | None:
        """The data, read the first time this rank runs a first or last stage (a data-parallel rank
        always does; a middle stage may become one when its pipeline is re-partitioned), or at once
        with ``stage`` None (a joiner, before it asks in: off the path of the members it joins)."""
        # With document masking every stage reads its micro-batches' document index.
        if self._sampler is None and (stage is None or stage.is_first or stage.is_last or self.cfg.masks_documents):
            self._sampler = open_sampler(self.cfg, self.model)
            trace = os.environ.get(DATA_TRACE_ENV)
            if trace:
                self._sampler.on_read = DataTrace(trace, self.rank, lambda: self.plan.epoch if self.plan else 0)
        return self._sampler

    @cached_property
    def _mixture(self) -> Mixture | None:
        return mixture_of(self.cfg)

    def source_tokens(self, step: int) -> dict:
        """For the step's metrics: each source's tokens in a ``data.mix`` job (nothing otherwise)."""
        return {"tokens_per_source": tokens_per_source(self.cfg, self._mixture, step, self.model.seq_len)} if self._mixture else {}

    def admit(self, st) -> int:
        """On the epoch's leader: answer join requests (see :mod:`elaswave.runtime.join`); not in
        the last step, after which there is nothing left to grow for."""
        if (not self.cfg.elastic.enabled or st.rank != st.plan.ranks[0] or self.shard
                or self.step >= self.cfg.train.steps - 1):
            return 0
        try:
            return join.admit(self, st)
        except StoreLost:  # said in this step's exchange (store_lost): every rank stops after it
            return 0

    def learn_standbys(self) -> None:
        """Where the store would move: the members' standby addresses, read while it is up."""
        if self.standby is not None:
            try:
                self.standby.learn(self.store, self.plan.ranks)
                self.membership.hosts(self.devices.every_rank(self.plan))  # kept: a moved store loses the dead's hosts
            except StoreLost:  # said in the step's exchange: it moves, or the ranks stop
                pass

    def move_store(self, st, step: int) -> dict:
        """Every member, at the end of the step whose exchange said that all of them lost the store:
        it moves to the first member's standby (:mod:`elaswave.control.failover`); returns the
        ``store_moved`` record (its ``mttr_s`` follows the first step on the new store: see
        :meth:`moved_record`)."""
        noticed, old, began = self.store.lost_wall, self.store.addr, time.perf_counter()
        last_answer = self.store.answered_wall  # (the move resets it)
        if self.standby is None:
            raise StoreLost(self.store.lost_reason)
        leader, addr = failover.move(self.store, self.standby, self.rank, st.plan.epoch, st.plan.ranks,
                                     self.cfg.to_dict(), self.liveness)
        st.world.all_reduce(torch.zeros(1, device=st.device), "store moved barrier")
        if self.rank == leader:
            failover.announce(self.store)
            print(f"elaswave: the control store at {old} was lost; it moved to rank {leader}'s standby at {addr} "
                  f"after step {step - 1}, and training goes on", file=sys.stderr, flush=True)
        return {"event": "store_moved", "step": step, "from": old, "to": addr, "to_rank": leader,
                "noticed_wall": noticed, "last_answer_wall": last_answer, "move_s": time.perf_counter() - began,
                "wall_time": time.time()}

    @staticmethod
    def moved_record(moved: dict, first_step_s: float) -> dict:
        """A store move's record, once the first step on the new store ended: its MTTR from the old
        store's last answer (a frozen or lost store says nothing after it)."""
        now = time.time()
        return {**moved, "mttr_s": now - moved["last_answer_wall"], "mttr_from": "last_answer",
                "first_step_s": first_step_s, "wall_time": now}

    def relocate_store(self, st) -> bool:
        """A recovery found the store gone, members with it: move it to the first survivor's
        standby that answers (the same on every survivor) and give up the epochs agreed on the
        lost store; the recovery starts again there. False without standbys (the rescue floor)."""
        if self.standby is None:
            return False
        now = failover.epoch_now(self.store, self.cfg.elastic.heartbeat_timeout_s / 2)
        if now is not None and now[0] >= st.plan.epoch and now[1] is not None:
            # The job's store answers a new connection: it is this rank that was away (paused past
            # its links' grace), not the store. Electing a successor now would start a second run.
            # (A store that answers without the job's epochs is a new one at the same address.)
            return False
        old = self.store.addr
        self.membership.holds_store = False
        # The epochs after the last trained one are agreed anew on the moved store: a trip the lost
        # store caused for the one under construction is undone -- before the move, so that no trip
        # an alert on the new store makes (its watcher reads them once the link has moved) is undone
        # too; a trip of the old loss after this one breaks only this epoch (or, moved, nothing).
        self.agreed_epoch = st.plan.epoch
        self.interrupt.rearm(st.plan.epoch)
        leader, addr = failover.move(self.store, self.standby, self.rank, st.plan.epoch, st.plan.ranks,
                                     self.cfg.to_dict(), self.liveness, self.prober,
                                     requires_majority=self.membership.requires_majority)
        # A survivor still waiting in a collective with the dead comes when its watcher gives up on
        # the lost store (the heartbeat timeout after its links did): wait for it that much longer,
        # and while its liveness port answers, up to MOVED_PATIENCE timeouts (see recovery.recover).
        self.agree_grace_s = 2 * self.cfg.elastic.heartbeat_timeout_s
        failover.announce(self.store)
        self.membership.alert(st.plan.epoch, f"rank {self.rank}: the control store was lost with members; "
                                             f"it moved to {addr}")
        if self.rank == leader:
            print(f"elaswave: the control store at {old} was lost with members; it moved to rank {leader}'s "
                  f"standby at {addr}, and the survivors agree there", file=sys.stderr, flush=True)
        return True

    def note_step(self) -> None:
        """A step ended here: every member of the epoch lived until its exchange (a fault nobody
        injected began after it, which the next recovery's MTTR may count from)."""
        self.last_step_wall = time.time()

    def _view(self):
        """(epoch, the ranks whose heartbeats this rank watches): every rank of the job, every slice's."""
        plan, devices = self._placed
        return (plan.epoch, devices.every_rank(plan)) if plan is not None else (0, ())

    def before_action(self, step: int, action: Action) -> None:
        if action.op == Op.FORWARD and action.micro_batch == self._first_mb:
            self.injector.at(step, "forward")
        elif action.op in (Op.BACKWARD, Op.BACKWARD_INPUT) and action.micro_batch == self._first_mb:
            self.injector.at(step, "backward")
        elif action.op == Op.BACKWARD_WEIGHT and action.micro_batch == self._first_mb:
            self.injector.at(step, "weight")
        if self.plan is not None:
            self.interrupt.check(self.plan.epoch)

    def before_eval(self, step: int, batch: int, action: Action) -> None:
        if (batch == self.cfg.train.eval_batches - 1 and action.op == Op.FORWARD
                and action.micro_batch == self._first_mb):
            self.injector.at(step, "eval")
        self.interrupt.check(self.plan.epoch)

    @property
    def _first_mb(self) -> int:
        d, _ = self.plan.position(self.rank)
        return self.plan.micro_batches[d][0]


def _hosts_around_a_tcpstore() -> bool:
    return int(os.environ.get(NODES_ENV, "1")) > 1 and not rendezvous.is_etcd(os.environ.get("ELASWAVE_STORE", ""))
