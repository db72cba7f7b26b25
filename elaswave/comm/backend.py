"""The one module that knows the backend: gloo on CPU, NCCL on GPUs.

Groups are built straight from a store (no default process group), so a broken world never has
to be torn down. Every wait is bounded by ``timeout_s`` and gives up early when the epoch's
:class:`~elaswave.interrupt.Interrupt` trips.
"""
from __future__ import annotations

import os
import queue
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from elaswave.control.addresses import check_bind_address, toward
from elaswave.control.link import client
from elaswave.interrupt import CommError, Interrupt


def choose(backend: str) -> tuple[str, torch.device]:
    """(backend name, device) for this process; ``auto`` takes NCCL only where CUDA is present."""
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("parallel.backend=nccl needs CUDA, which this machine lacks; use gloo or auto")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():  # NCCL cannot put two ranks on one GPU either
            raise RuntimeError(f"rank with LOCAL_RANK={local} has no GPU of its own: this host has "
                               f"{torch.cuda.device_count()}; run at most that many ranks per host")
        torch.cuda.set_device(local)
        return "nccl", torch.device("cuda", local)
    return "gloo", torch.device("cpu")


def connect_store(addr: str, timeout_s: float) -> dist.Store:
    """A client of the launcher's TCPStore at ``host:port``."""
    host, port = addr.rsplit(":", 1)
    return client(host, int(port), timeout_s, timeout_s)


def rendezvous_store(timeout_s: float) -> tuple[dist.Store, int, int]:
    """(store, rank, world size) from torchrun's ``env://`` variables, without a process group."""
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
    # A restarted worker group must not meet the dead attempt's keys (gloo addresses, epochs).
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"attempt{attempt}", store), rank, world_size


def make_process_group(store: dist.Store, prefix: str, group_rank: int, size: int, backend: str,
                       timeout_s: float, device: torch.device, bind: str | None = None) -> dist.ProcessGroup:
    """A backend group over ``size`` ranks that meet under ``prefix`` in ``store``; gloo binds to
    ``bind`` (an address or host name) when given.

    Only the members take part, so it can be built while other ranks are dead or busy. gloo
    releases the GIL while it connects, so this also runs in a background thread."""
    sub = dist.PrefixStore(prefix, store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(sub, group_rank, size, opts)
    if bind:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind)]
        return dist.ProcessGroupGloo(sub, group_rank, size, opts)
    return dist.ProcessGroupGloo(sub, group_rank, size, timeout)


def bind_address(configured: str, store_addr: str | None) -> str | None:
    """Where gloo and the rank's listeners bind: the configured address (one of this host's: else
    one line), else loopback when the store is on loopback (a one-host job), else gloo's own choice
    (None)."""
    if configured:
        check_bind_address(configured)
        return configured
    hosts = {m.rsplit(":", 1)[0] for m in _store_members(store_addr)}
    return "127.0.0.1" if hosts <= {"127.0.0.1", "localhost", "::1"} else None


def _store_members(store_addr: str | None) -> list[str]:
    # HOST:PORT (a TCPStore), or etcd://HOST:PORT[,HOST:PORT...]/PREFIX (every member counts)
    return (store_addr or "").removeprefix("etcd://").split("/", 1)[0].split(",")


def listen_address(bind: str | None, store_addr: str | None) -> str:
    """Where a listener the other hosts must reach (a standby store) binds: ``bind``
    (:func:`bind_address`), else this host's address on the route to the store's host. Not the host
    name's: Debian's own name is 127.0.1.1 in /etc/hosts, where no other host reaches."""
    if bind:
        return bind
    first = _store_members(store_addr)[0].rsplit(":", 1)[0]
    return (first and toward(first)) or socket.gethostname()


class _Watched:
    """A Work whose completion is being watched: ``done`` is set when it completes, by its future
    or -- gloo's send/recv works have none and may be waited on only once -- by a helper thread
    that does that one wait. If the peer is dead the helper stays blocked until the group's
    timeout, harmlessly (daemon)."""

    def __init__(self, work: dist.Work, timeout_s: float):
        self.work, self.done = work, threading.Event()
        self.error: BaseException | None = None
        self.finished = False
        """The work ended (``done`` is also set by an interrupt's trip)."""
        self.has_future = True
        try:
            work.get_future().add_done_callback(lambda _: self._end())
        except RuntimeError:
            self.has_future = False
            _WAITERS.submit(self._wait_once, timeout_s)

    def _end(self) -> None:
        self.finished = True
        self.done.set()

    def _wait_once(self, timeout_s: float) -> None:
        try:
            self.work.wait(timeout=timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            self.error = exc
        self._end()


def wait(work: dist.Work, timeout_s: float, what: str, interrupt: Interrupt | None = None,
         epoch: int = 0) -> None:
    """Wait for ``work`` at most ``timeout_s``, and not at all once ``interrupt`` trips for ``epoch``.

    Raises CommError on a backend error or timeout, EpochBroken on an interrupt."""
    if interrupt is None:
        _wait_now(work, timeout_s, what)
        return
    interrupt.check(epoch)
    watched = _Watched(work, timeout_s)
    interrupt.register(watched.done, epoch)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if not watched.done.wait(max(0.0, deadline - time.monotonic())):
                raise CommError(f"{what} did not complete within {timeout_s}s")
            interrupt.check(epoch)
            if watched.finished:
                break
            # Woken by a trip of an older epoch (epochs also advance without one: a join, a
            # rebalance): this epoch's work goes on. Cleared, then looked at again, so that an end
            # or a trip between the two is not lost.
            watched.done.clear()
            if watched.finished or interrupt.is_broken(epoch):
                watched.done.set()
    finally:
        interrupt.unregister(watched.done)
    if watched.has_future:
        _wait_now(watched.work, timeout_s, what)  # completed: raises if it failed
    elif watched.error is not None:
        raise CommError(f"{what} failed: {watched.error}") from watched.error


class _Waiters:
    """Daemon threads that each wait on one Work at a time: reused (a thread per wait cost more than
    the wait), and one more is started whenever all are busy, e.g. stuck on a dead peer."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, fn, *args) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1
            else:
                threading.Thread(target=self._serve, name="elaswave-wait", daemon=True).start()
        self._jobs.put((fn, args))

    def _serve(self) -> None:
        while True:
            fn, args = self._jobs.get()
            fn(*args)
            with self._lock:
                self._idle += 1


_WAITERS = _Waiters()


def _wait_now(work: dist.Work, timeout_s: float, what: str) -> None:
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise CommError(f"{what} failed: {exc}") from exc


def reduce_scatter_is_all_reduce(backend_name: str) -> bool:
    """gloo builds reduce-scatter from a full all-reduce plus a slice: calling all-reduce costs the
    same and leaves every holder the whole sum (NCCL's reduce-scatter really moves half the bytes)."""
    return backend_name == "gloo"


def all_reduce(pg: dist.ProcessGroup, t: torch.Tensor) -> dist.Work:
    return pg.allreduce([t])


def all_gather(pg: dist.ProcessGroup, out: torch.Tensor, inp: torch.Tensor) -> dist.Work:
    """``out`` = every member's ``inp``, concatenated in group-rank order."""
    return pg._allgather_base(out, inp)


def reduce_scatter(pg: dist.ProcessGroup, out: torch.Tensor, inp: torch.Tensor) -> dist.Work:
    """``out`` = this member's 1/n slice of the sum of every member's ``inp``."""
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    return pg._reduce_scatter_base(out, inp, opts)


def all_to_all(pg: dist.ProcessGroup, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
               in_splits: list[int]) -> dist.Work:
    """Rows ``in_splits[m]`` of ``inp`` (in order) to member m; ``out`` takes ``out_splits[m]`` rows
    from member m, in member order."""
    return pg.alltoall_base(out, inp, out_splits, in_splits, dist.AllToAllOptions())


def send(pg: dist.ProcessGroup, t: torch.Tensor, dst_group_rank: int, tag: int) -> dist.Work:
    return pg.send([t], dst_group_rank, tag)


def recv(pg: dist.ProcessGroup, t: torch.Tensor, src_group_rank: int, tag: int) -> dist.Work:
    return pg.recv([t], src_group_rank, tag)
