"""The dynamic communicator: one group per epoch, and standby groups for the next one.

gloo cannot shrink a group (``supports_shrinking`` is False in torch 2.13) and a broken gloo
group stays broken, so editing means switching. The fastest switch is one already built: while an
epoch trains, a background thread builds, for every other member ``x``, the group of the members
without ``x``. When ``x`` dies, the survivors' group for the next epoch is ready and already
connected; the communicator phase of recovery is a dictionary look-up. Losses that no standby
covers (two at once) build their group on demand over a fresh store prefix, among the survivors
only (a *partial rebuild*). Broken groups are never destroyed on the recovery path (destroying a
gloo group costs ~10 ms per member); they are parked.
"""
from __future__ import annotations

import hashlib
import threading
from typing import Sequence

import torch
import torch.distributed as dist

from elaswave.comm import backend
from elaswave.interrupt import CommError, Interrupt


class Group:
    """A process group over global ranks ``members``; every call is bounded and interruptible."""

    def __init__(self, pg: dist.ProcessGroup | None, members: Sequence[int], me: int, epoch: int,
                 timeout_s: float, interrupt: Interrupt | None):
        self.pg, self.members, self.me = pg, tuple(members), me
        self.epoch, self.timeout_s, self.interrupt = epoch, timeout_s, interrupt
        self.size = len(self.members)
        self.group_rank = self.members.index(me)
        self.payload_bytes = 0
        """Bytes of the tensors this rank gave the group's collectives (a ring all-reduce moves
        2 (n - 1) / n of them each way): what a step's communication is measured by."""
        self.inflight: list[dist.Work] = []
        """Operations not known to be complete. They live as long as the group: destroying a gloo
        operation that waits on a hung peer blocks until the group's timeout, so when an epoch
        breaks its groups are parked with their operations, whatever else lets go of them."""

    def wait(self, work: dist.Work, what: str) -> None:
        backend.wait(work, self.timeout_s, what, self.interrupt, self.epoch)
        self._done(work)

    def wait_direct(self, work: dist.Work, what: str, timeout_s: float | None = None) -> None:
        """Wait on this thread, at most ``timeout_s`` (default: the group's), for work that is done
        or nearly so; an interrupt cannot cut it short, so no helper thread is needed."""
        self.interrupt.check(self.epoch)
        backend.wait(work, self.timeout_s if timeout_s is None else timeout_s, what)
        self._done(work)

    def _done(self, work: dist.Work) -> None:
        """A waited operation needs no parking: let go of it, and of the tensors it holds (a
        recovery's migration buffers were kept alive by it until the group's next call, or the
        epoch's end where none came)."""
        self.inflight = [w for w in self.inflight if w is not work]

    def _call(self, fn, *args) -> dist.Work:
        try:
            work = fn(self.pg, *args)
        except RuntimeError as exc:  # a group that broke earlier raises at once
            raise CommError(f"{fn.__name__} on group {self.members} failed: {exc}") from exc
        self.inflight = [w for w in self.inflight if not w.is_completed()]
        self.inflight.append(work)
        return work

    def all_reduce_async(self, t: torch.Tensor) -> dist.Work | None:
        if self.size == 1:
            return None
        self.payload_bytes += t.numel() * t.element_size()
        return self._call(backend.all_reduce, t)

    def all_reduce(self, t: torch.Tensor, what: str = "all-reduce") -> None:
        work = self.all_reduce_async(t)
        if work is not None:
            self.wait(work, what)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, what: str = "all-gather") -> None:
        work = self.all_gather_async(out, inp)
        if work is not None:
            self.wait(work, what)

    def all_gather_async(self, out: torch.Tensor, inp: torch.Tensor) -> dist.Work | None:
        if self.size == 1:
            out.copy_(inp)
            return None
        self.payload_bytes += inp.numel() * inp.element_size()
        return self._call(backend.all_gather, out, inp)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, what: str = "reduce-scatter") -> None:
        work = self.reduce_scatter_async(out, inp)
        if work is not None:
            self.wait(work, what)

    def reduce_scatter_async(self, out: torch.Tensor, inp: torch.Tensor) -> dist.Work | None:
        if self.size == 1:
            out.copy_(inp)
            return None
        self.payload_bytes += inp.numel() * inp.element_size()
        return self._call(backend.reduce_scatter, out, inp)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: Sequence[int],
                   in_splits: Sequence[int], what: str = "all-to-all") -> None:
        """Rows ``in_splits[m]`` of ``inp`` go to member m, ``out`` takes ``out_splits[m]`` from
        member m (both in member order); waited for."""
        if self.size == 1:
            out.copy_(inp)
            return
        row_bytes = inp[0].numel() * inp.element_size() if inp.shape[0] else 0
        self.payload_bytes += row_bytes * (sum(in_splits) - in_splits[self.group_rank])  # what leaves this rank
        self.wait(self._call(backend.all_to_all, out, inp, list(out_splits), list(in_splits)), what)

    def isend(self, t: torch.Tensor, dst: int, tag: int) -> dist.Work:
        return self._call(backend.send, t, self.members.index(dst), tag)

    def irecv(self, t: torch.Tensor, src: int, tag: int) -> dist.Work:
        return self._call(backend.recv, t, self.members.index(src), tag)


def job_tag(store) -> str:
    """A name for this job's groups that no other job's are under: the same group of the same epoch
    is ``ew/grp/sb/0/0-1-3/`` in every job, and a process of another job whose store port this one
    reused (a worker left behind, reconnecting) would otherwise write its address among them. From
    the job's record (its nonce), which every process of the job reads; empty without one."""
    record = getattr(store, "job_record", None)
    return hashlib.sha256(record).hexdigest()[:12] if record else ""


def _prefix(tag: str, kind: str, epoch: int, members: Sequence[int]) -> str:
    return f"ew/grp/{tag + '/' if tag else ''}{kind}/{epoch}/{'-'.join(map(str, members))}/"


class Communicator:
    """Owns every group this rank has: the current ones, the standbys, and the parked broken ones."""

    def __init__(self, store: dist.Store, me: int, backend_name: str, device: torch.device,
                 timeout_s: float, interrupt: Interrupt, use_standbys: bool, bind: str | None = None):
        self.store, self.me, self.backend_name, self.device = store, me, backend_name, device
        self.tag = job_tag(store)
        self.bind = bind
        self.timeout_s, self.interrupt = timeout_s, interrupt
        self.use_standbys = use_standbys and backend_name == "gloo"  # NCCL comms hold GPU memory
        self._standby: dict[tuple[int, ...], tuple[threading.Thread, dict]] = {}
        self.parked: list = []
        """Broken process groups, and the groups of finished epochs, kept from their destructors."""
        self.groups: list[Group] = []
        """Every group this rank uses in the current epoch (its world and holder groups)."""
        self.last_source = ""
        """How the last group came to be: 'standby' or 'built' (reported in recovery phases)."""

    def build(self, members: Sequence[int], epoch: int, kind: str = "ep") -> dist.ProcessGroup | None:
        """Connect the group now. A member that dies meanwhile would leave the others waiting in
        the backend until its timeout, so the connecting runs on a helper thread and the wait
        gives up as soon as the control plane declares ``epoch`` broken."""
        members = tuple(members)
        if len(members) == 1:
            return None
        box: dict = {}
        done = threading.Event()
        # Its own store connection: a client serves one blocking request at a time, and a connect
        # given up on (a member died) would hold the rank's main connection until it times out.
        store = self.store.clone()

        def connect() -> None:
            try:
                box["pg"] = backend.make_process_group(store, _prefix(self.tag, kind, epoch, members),
                                                       members.index(self.me), len(members), self.backend_name,
                                                       self.timeout_s, self.device, self.bind)
            except Exception as exc:  # noqa: BLE001 - reported below, on the caller's thread
                box["error"] = exc
            done.set()

        self.interrupt.check(epoch)
        threading.Thread(target=connect, name=f"connect-{kind}-{epoch}", daemon=True).start()
        self.interrupt.register(done, epoch)
        try:
            done.wait(self.timeout_s + 5.0)
            self.interrupt.check(epoch)
        finally:
            self.interrupt.unregister(done)
        if "pg" not in box:
            raise CommError(f"connecting the group of ranks {list(members)} failed: "
                            f"{box.get('error', f'no answer within {self.timeout_s}s')}")
        return box["pg"]

    def standby_ready(self, members: Sequence[int]) -> bool:
        """Whether this rank's standby group for ``members`` is connected (all members must say so
        before any of them uses it, or some would wait in a group the others never join)."""
        entry = self._standby.get(tuple(sorted(members)))
        return entry is not None and entry[1].get("pg") is not None

    def group(self, members: Sequence[int], epoch: int, use_standby: bool = False) -> Group:
        """The group of ``members`` for ``epoch``: the ready standby when every member has it, else built now."""
        members = tuple(sorted(members))
        entry = self._standby.pop(members, None)
        pg = entry[1].get("pg") if entry is not None and use_standby else None
        if pg is not None:
            self.last_source = "standby"
        elif len(members) > 1:
            if entry is not None and entry[1].get("pg") is not None:
                self.parked.append(entry[1]["pg"])
            self.last_source = "built"
            pg = self.build(members, epoch)
        else:
            self.last_source = "none"
        self._park_standbys()
        return self.adopt(pg, members, epoch)

    def adopt(self, pg: dist.ProcessGroup | None, members: Sequence[int], epoch: int) -> Group:
        """A :class:`Group` of ``pg`` for ``epoch``, parked with its epoch when the epoch ends."""
        group = Group(pg, members, self.me, epoch, self.timeout_s, self.interrupt)
        self.groups.append(group)
        return group

    def park_before(self, epoch: int) -> None:
        """Park every group of an epoch before ``epoch`` (an epoch is ending: broken, or replaced)."""
        old = [g for g in self.groups if g.epoch < epoch]
        self.parked.extend(old)
        self.groups = [g for g in self.groups if g.epoch >= epoch]

    def prepare_standbys(self, members: Sequence[int], epoch: int) -> None:
        """Start building, in the background, the group of ``members`` minus each other member.

        One thread builds them one after another in the same order on every rank, over its own
        store connection: a store client serves one blocking request at a time, and groups built
        in different orders on different ranks could wait on each other forever. A new connection
        each epoch: one that dropped since (a network blip) would fail every later build."""
        if not self.use_standbys or len(members) < 3:
            return
        plan = [tuple(r for r in members if r != gone) for gone in members if gone != self.me]
        boxes = {rest: {} for rest in plan}
        thread = threading.Thread(target=self._build_all, args=(boxes, epoch), daemon=True,
                                  name=f"standby-groups-{epoch}")
        thread.start()
        for rest, box in boxes.items():
            self._standby[rest] = (thread, box)

    def _build_all(self, boxes: dict[tuple[int, ...], dict], epoch: int) -> None:
        try:
            store = self.store.clone()
        except Exception as exc:  # noqa: BLE001 - the store is gone: no standby this epoch
            for box in boxes.values():
                box.update(error=exc, done=True)
            return
        for members, box in boxes.items():
            try:
                box["pg"] = backend.make_process_group(
                    store, _prefix(self.tag, "sb", epoch, members), members.index(self.me), len(members),
                    self.backend_name, self.timeout_s, self.device, self.bind)
            except Exception as exc:  # a member died while connecting: this standby is unusable
                box["error"] = exc
            box["done"] = True

    def _park_standbys(self) -> None:
        # Standbys of the old epoch are useless now; keep them referenced so no destructor runs here.
        for thread, box in self._standby.values():
            if box.get("pg") is not None:
                self.parked.append(box["pg"])
        self._standby.clear()

