"""A rank's connection to the control store, which outlives a dropped connection.

torch's TCPStore client never reconnects: once its socket drops (a network blip, a switch
flapping, a proxy restarting) every later call fails, and the rank would be lost with a healthy
process and a healthy store. A :class:`StoreLink` opens a new connection to the same store and
repeats the call, for as long as ``grace_s`` (the heartbeat timeout, after which its peers would
declare it gone anyway) since the first failure. When the store stays unreachable longer, the
process or host holding it is gone: every link of the process says :class:`StoreLost` from then
on. Then the job either moves its store to a survivor (:meth:`StoreLink.move`, all links of the
process follow; see :mod:`elaswave.control.failover`) or the rank saves what it holds
(:mod:`elaswave.runtime.rescue`).

A call repeated after a dropped connection may have reached the store before the drop. That is
harmless for every call elaswave makes except an ``add`` that counts: such an add may count
twice. The protocol's counters tolerate it (heartbeats only need to move; nothing else is
counted: numbered records are claimed, :mod:`elaswave.control.sequence`, and a repeated claim
finds its own record).
"""
from __future__ import annotations

import errno
import queue
import socket
import threading
import time
from concurrent import futures
from datetime import timedelta

import torch
import torch.distributed as dist


ATTEMPT_S = 0.25
"""The longest one attempt to reconnect may take."""

SILENT_S = 8.0
"""A store that answers no call of a process for this long (or the grace, if longer) is frozen or
cut off. Not less: a live TCPStore under a burst of connections and 16 ranks polling on 2 cores
was seen answering nothing to a process for over 2 s (a new client connection stalls 5 s now and
then: FACTS.md), and a false "lost" moves the store for nothing."""

EXIT_STORE_LOST = 4
"""A worker's exit code when it stopped because the control store was gone (having saved its state)."""
EXIT_GROUP_LEFT = 5
"""A worker's exit code, under elaswave's own launcher or ``elaswave join``, when it left alive with
its tensor-parallel group (the group lost a rank): its device is free for a spare, which the
launcher promotes (under torchrun it exits 0: a non-zero code would restart the job)."""
EXIT_EXCLUDED = 3
"""A worker's exit code when the job went on without it (left out of an epoch, or paused past the
heartbeat timeout and continued): it writes nothing."""


class StoreLost(ConnectionError):
    """The control store stayed unreachable for longer than the grace period."""


class Unanswered(dist.DistNetworkError):
    """A store call got no answer within its deadline: the store is frozen, or its host is silent."""


class StoreLink:
    """Duck-types the :class:`torch.distributed.Store` calls elaswave makes (``clone`` gives a raw
    store on a new connection, for process groups); :meth:`separate` gives another link."""

    def __init__(self, store: dist.Store, addr: str | None, timeout_s: float, grace_s: float,
                 shared: "_Endpoint | None" = None):
        """``addr``: HOST:PORT of a TCPStore to reconnect to, or None to reconnect by ``clone()``
        (a store from torchrun's rendezvous, under its prefix)."""
        self._store, self.timeout_s, self.grace_s = store, timeout_s, grace_s
        # Shared by the process's links: once one has given up, the others fail at once; once the
        # store has moved, each reconnects to the new one at its next call.
        self._lost = shared or _Endpoint(addr)
        self._generation = self._lost.generation
        self._caller: _Caller | None = None
        self.reconnects = 0
        """Connections this link re-opened (a dropped one that came back)."""

    @property
    def addr(self) -> str | None:
        return self._lost.addr

    @property
    def generation(self) -> int:
        """The generation of the job's store this link reaches: how many times it has moved (0: it
        is where the job started it). Seals bind it (:mod:`elaswave.control.seal`)."""
        return self._lost.generation

    def adopt(self, generation: int) -> None:
        """The store this process connected to is of ``generation`` (a process that started after a
        move): no move of its own, nothing to reconnect."""
        self._lost.generation = self._generation = generation

    def move(self, addr: str, generation: int | None = None) -> None:
        """Every link of this process goes to the TCPStore at ``addr`` from now on: the job's store
        moved there (:mod:`elaswave.control.failover`), its ``generation`` (default: the next).
        Connects this link at once."""
        self._lost.move(addr, self._lost.generation + 1 if generation is None else generation)
        self._follow()

    def separate(self) -> "StoreLink":
        """Another link over its own connection (a client serves one blocking call at a time)."""
        self._follow()
        return StoreLink(self._store.clone(), self.addr, self.timeout_s, self.grace_s, self._lost)

    @property
    def lost(self) -> threading.Event:
        return self._lost.event

    @property
    def lost_reason(self) -> str:
        return self._lost.reason

    @property
    def answered_wall(self) -> float:
        """When (time.time()) the store last answered a call of this process: after a loss, the
        store's last sign of life as this process saw it."""
        return time.time() - (time.monotonic() - self._lost.answered_at)

    @property
    def lost_wall(self) -> float | None:
        """When (time.time()) a link of this process gave up; None while the store answers."""
        return self._lost.wall

    def clone(self) -> dist.Store:
        """A raw store on a new connection (a process group's). Its connect gets the grace, as a
        reconnect does: TCPStore's own clone retries a store that is gone for the store's whole
        timeout (``parallel.timeout_s``), and a rank building a group when the store died sat out
        that minute where it should have moved the store (issue 58). Tried for ``SILENT_S`` at
        least (a group build is no reason to call a slow store lost), and no longer than until
        another link of the process -- its watcher's, beating -- gives up on the store."""
        self._follow()
        if self.addr is None:
            return self._store.clone()
        return self._open(time.monotonic(), grace_s=max(self.grace_s, SILENT_S))

    def fresh(self, within_s: float) -> dist.Store:
        """A new plain connection to where the store is now, whatever this link thinks of it (to
        ask once more after giving up); its constructor bounded by ``within_s``, not its calls."""
        if self.addr is None:
            return self._store.clone()
        host, port = self.addr.rsplit(":", 1)
        # Asked when the store may be gone with its host: a plain connect first, since c10d's own
        # failed attempts each log a C++ backtrace (dozens in a survivor's log after the first
        # node's loss). (Not in every client(): a plain connect before each first connection of a
        # job's start-up left node 0's store deaf to new ones in 2 of 3 runs of a four-host test.)
        check_listening(host, int(port), within_s)
        return client(host, int(port), within_s, within_s)

    def _follow(self) -> None:
        """On this link's first use after the store moved: a connection to where it is now."""
        if self._generation != self._lost.generation:
            self._reconnect(time.monotonic())  # the moved-store branch there starts its grace

    def __getattr__(self, name: str):
        method = getattr(self._store, name)
        if not callable(method):
            return method

        def call(*args, **kwargs):
            failed_at = None
            while True:
                if self.lost.is_set():
                    raise StoreLost(self.lost_reason or "the control store is unreachable")
                began = time.monotonic()
                try:
                    self._follow()
                    return self._bounded(name, args, kwargs)
                except dist.DistNetworkError as exc:
                    # Unanswered: the store has been silent since the call began, not since it timed out.
                    failed_at = failed_at or (began if isinstance(exc, Unanswered) else time.monotonic())
                    self._reconnect(failed_at, exc)
        return call

    def _bounded(self, name: str, args: tuple, kwargs: dict):
        """The call, or :class:`Unanswered` once the store has answered nothing at all -- no call of
        any link of this process -- for ``SILENT_S`` (or the grace, if longer), past the call's own wait (``wait``'s timeout;
        ``get``'s, which waits for its key). A TCPStore client blocked on a frozen server (SIGSTOP)
        or a silent host outlives its own timeout for good, so the call runs on this link's caller
        thread, which the link abandons then (with its connection). A store that is only slow (a
        loaded host, a burst of new connections) still answers someone, so nothing is abandoned."""
        store = self._store

        def run():
            out = getattr(store, name)(*args, **kwargs)
            if name == "set":
                # TCPStore's set has no reply: on a connection the other end has closed the bytes
                # are accepted by the kernel and lost. A call that has one, on the same stream,
                # proves the set arrived (or fails, and the set is repeated).
                store.check([args[0] if args else kwargs["key"]])
            return out
        waits = (args[1] if len(args) > 1 else kwargs.get("timeout")) if name == "wait" else None
        own_s = (waits.total_seconds() if waits is not None else
                 self.timeout_s if name in ("wait", "get", "multi_get") else 0.0)
        if self._caller is None:
            self._caller = _Caller()
        silent_s = max(self.grace_s, SILENT_S)
        began = time.monotonic()
        pending = self._caller.submit(run)
        while not futures.wait([pending], 0.05).done:
            if self.lost.is_set():  # another link of this process gave up on this store
                self._caller = None
                raise StoreLost(self.lost_reason)
            now = time.monotonic()
            if now - began > own_s + silent_s and now - self._lost.answered_at > silent_s:
                self._caller = None  # its thread stays blocked on the silent connection: never reused
                raise Unanswered(f"the control store answered nothing for {silent_s:g} s ({name} pending)")
        self._lost.answered_at = time.monotonic()
        return pending.result()

    def _reconnect(self, failed_at: float, cause: Exception | None = None) -> None:
        """A new connection to the same store, tried until ``grace_s`` after the first failure
        (``cause``; none when the store moved, which is the cause then)."""
        self._store = self._open(failed_at, cause)
        self.reconnects += 1

    def _open(self, failed_at: float, cause: Exception | None = None, grace_s: float | None = None) -> dist.Store:
        """A new connection to where the store is, tried until ``grace_s`` (default: the link's)
        after ``failed_at``; :class:`StoreLost` (for every link of the process) after that."""
        grace_s = self.grace_s if grace_s is None else grace_s
        while True:
            if self.lost.is_set():  # another link of this process gave up already
                raise StoreLost(self.lost_reason) from None
            if self._generation != self._lost.generation:
                # The store moved while this link was trying (another link gave up on the old one,
                # and the process moved before this one looked again): the new store gets a grace of
                # its own. Measured from the old failure, it would be declared lost unasked.
                self._generation, failed_at = self._lost.generation, time.monotonic()
                cause = ConnectionError(f"the store moved to {self.addr}")
            left = grace_s - (time.monotonic() - failed_at)
            if left <= 0:
                where = self.addr or getattr(self._store, "description", "torchrun's rendezvous store")
                reason = (f"the control store at {where} has not answered for {grace_s:g} s "
                                    f"(elastic.heartbeat_timeout_s, on etcd at least a leader change; last error: {str(cause).splitlines()[0]})")
                self._lost.declare(reason)
                raise StoreLost(reason) from None
            try:
                store = self._connect(left)
                self._lost.answered_at = time.monotonic()  # a new connection's handshake was answered
                return store
            except Exception as exc:  # noqa: BLE001 - refused or timed out: the store is not back yet
                cause = cause or exc
                time.sleep(min(0.05, max(0.0, left)))

    def _connect(self, within_s: float) -> dist.Store:
        if self.addr is None:
            return self._store.clone()
        host, port = self.addr.rsplit(":", 1)
        # A plain connect first: a refused one is cheap and quiet, where a TCPStore that cannot
        # connect logs a C++ backtrace.
        attempt_s = max(0.05, min(within_s, ATTEMPT_S))
        check_listening(host, int(port), attempt_s)
        # Short attempts: the constructor backs off between its own retries, which would keep a
        # store that is back waiting for up to the whole grace.
        return client(host, int(port), attempt_s, self.timeout_s)


def client(host: str, port: int, within_s: float, timeout_s: float) -> dist.Store:
    """A TCPStore client whose calls get ``timeout_s`` (a frozen server outlasts it: see
    :mod:`elaswave.control.failover`), or TimeoutError after about ``within_s``. The constructor waits for the server's answer to its first ping with no timeout
    of its own: a store whose process is frozen (SIGSTOP, a stall) while its kernel still accepts
    would hold the caller for good. The attempt left behind ends when that server answers or closes."""
    made: dict = {}

    def connect() -> None:
        try:
            made["store"] = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=within_s))
        except Exception as exc:  # noqa: BLE001 - raised in the caller's thread below
            made["error"] = exc
    attempt = threading.Thread(target=connect, daemon=True, name="store-connect")
    attempt.start()
    attempt.join(2 * within_s)  # the connect itself is bounded by within_s; its ping gets as long again
    if attempt.is_alive():
        raise TimeoutError(f"the store at {host}:{port} accepted a connection but did not answer within {2 * within_s:g} s")
    if "error" in made:
        raise made["error"]
    made["store"].set_timeout(timedelta(seconds=timeout_s))
    return made["store"]


class CannotListen(OSError):
    """A store cannot listen at the address it was given (not an address of this host, or taken)."""


def serve(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A TCPStore server that listens at ``host`` alone (``port`` 0: a free one). torch binds its
    server to every interface whatever host it is given (measured: reachable through any of the
    host's addresses), so anyone on any network the host is on could write the job's counters.
    Handed a socket already bound (``master_listen_fd``), it listens there only, and owns it."""
    try:
        family, kind, proto, _, where = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    except OSError as exc:
        raise CannotListen(f"{host!r} does not resolve here ({exc.strerror or exc})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        why = "not an address of this host" if exc.errno == errno.EADDRNOTAVAIL else exc.strerror or str(exc)
        raise CannotListen(f"cannot listen at {host}:{port}: {why}") from None
    bound = sock.getsockname()[1]
    return dist.TCPStore(host, bound, world_size=None, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s), master_listen_fd=sock.detach(),
                         use_libuv=_LIBUV_TAKES_A_SOCKET)


# torch's libuv server listens on a socket it is handed from torch 2.8 (pytorch PR 150215); before,
# it never accepted on one, and the older server, which always could, is the one to use.
_LIBUV_TAKES_A_SOCKET = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 8)


def check_listening(host: str, port: int, timeout_s: float) -> None:
    """Raises ConnectionRefusedError unless something listens at ``host:port``. A connect to a
    loopback port nobody listens on can meet itself (TCP's simultaneous open, when the kernel
    picks that same port as the source): that is no store, and a TCPStore client would wait out
    its timeout on it, logging a C++ backtrace."""
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        if sock.getsockname() == sock.getpeername():
            raise ConnectionRefusedError(f"nothing listens at {host}:{port} (the connect met itself)")


class _Endpoint:
    """Where a process's links go, and whether they gave up on it."""

    def __init__(self, addr: str | None) -> None:
        self.addr, self.generation = addr, 0
        self.event = threading.Event()
        self.reason = ""
        self.wall: float | None = None
        self.answered_at = time.monotonic()
        """When a call of any of the process's links last got an answer (monotonic)."""

    def declare(self, reason: str) -> None:
        if not self.event.is_set():
            self.reason, self.wall = reason, time.time()
            self.event.set()

    def move(self, addr: str, generation: int) -> None:
        self.answered_at = time.monotonic()
        self.addr, self.generation = addr, generation
        self.reason, self.wall = "", None
        self.event.clear()


class _Caller:
    """One daemon thread that makes a link's store calls, one at a time, so that the link can stop
    waiting for one: a thread hand-off per call, a few tens of microseconds."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, daemon=True, name="store-call").start()

    def _serve(self) -> None:
        while True:
            fn, future = self._jobs.get()
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                future.set_exception(exc)

    def submit(self, fn) -> futures.Future:
        future: futures.Future = futures.Future()
        self._jobs.put((fn, future))
        return future
