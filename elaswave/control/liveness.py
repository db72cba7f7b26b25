"""Proof of death: each rank's liveness port, and the probe that reads it.

A rank that has not checked in for the next epoch is either slow, hung or gone, and agreement must
not wait a fixed time to tell which (issue 20: with nobody reporting the death, that wait was the
whole 1 s of agreement). The kernel answers for the process: a listening socket accepts connects
while its process exists -- even stopped (SIGSTOP), since the kernel completes the handshake --
and refuses them the moment the process is gone, because dying closes every descriptor. So a
refused connect is evidence of death, and an accepted one says only "not dead" (a hang is the
heartbeat's to find). No data ever crosses the port; nothing is read from it.

The port is registered in the store under ``ew/live/<rank>``; a probe that cannot reach the host at
all (a host powered off drops packets instead of refusing) proves nothing and says so (None).

A refusal is the kernel's word only when it is the dead rank's own kernel that speaks, and a
prober knows that only for an address of its own machine (loopback, or an address of its own
network namespace): :func:`elaswave.control.addresses.is_own_address`. From across a network, a firewall that rejects
(``reject with tcp reset``) in front of a live host refuses exactly as a dead process's kernel
would, and a partition that rejects would then look like death from both sides -- each side "the
majority" of the living, two runs (issue 58). So a refusal from another machine is silence
(None); deaths across machines are proven by the dead rank's own agent (a reaped child) or by its
heartbeats.
"""
from __future__ import annotations

import errno
import selectors
import socket
import threading
import time

from elaswave.control import addresses
from elaswave.control.membership import PREFIX
from elaswave.control.partition import REACH_TIMEOUT_S
from elaswave.control.seal import sealed

PROBE_TIMEOUT_S = 0.1
"""How long one probe waits for a host to answer: loopback and live hosts answer in microseconds."""


def _key(rank: int) -> str:
    return f"{PREFIX}live/{rank}"


class LivenessPort:
    """This process's listening socket. Connects never accepted would fill the backlog (then the
    kernel drops SYNs and probes time out), so a daemon thread accepts and closes them."""

    def __init__(self, bind: str | None):
        host = bind or ""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind((host, 0))
        self.sock.listen(128)
        port = self.sock.getsockname()[1]
        self.address = f"{bind or socket.gethostname()}:{port}"
        threading.Thread(target=self._drain, name="elaswave-liveness", daemon=True).start()

    def register(self, store, rank: int) -> None:
        store.set(_key(rank), self.address)

    def _drain(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            conn.close()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept
        except OSError:
            pass
        self.sock.close()


def probe(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool | None:
    """True: the process answers (alive, perhaps hung); False: this machine's own kernel refused
    (it is gone); None: no answer within ``timeout_s``, no route, or a refusal from another machine
    (nothing proven)."""
    return probe_all({0: address}, timeout_s)[0]


def probe_all(addresses: dict[int, str], timeout_s: float) -> dict[int, bool | None]:
    """:func:`probe` of every address at once (non-blocking connects): the whole set answers within
    one ``timeout_s``, however many do not."""
    out: dict[int, bool | None] = {}
    waiting = selectors.DefaultSelector()
    for key, address in addresses.items():
        host, port = address.rsplit(":", 1)
        try:
            family, kind, proto, _, where = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)[0]
            sock = socket.socket(family, kind, proto)
        except OSError:  # a name that does not resolve: no route either
            out[key] = None
            continue
        sock.setblocking(False)
        code = sock.connect_ex(where)
        if code == errno.EINPROGRESS:
            waiting.register(sock, selectors.EVENT_WRITE, (key, where[0]))
            continue
        out[key] = _answer(code, where[0])
        sock.close()
    deadline = time.monotonic() + timeout_s
    while waiting.get_map():
        # A last look with no wait once the time is up: a thread scheduled late must not call a
        # port that answered in time silent.
        left = max(0.0, deadline - time.monotonic())
        ready_now = waiting.select(left)
        if not ready_now and left == 0.0:
            break
        for ready, _ in ready_now:
            key, ip = ready.data
            out[key] = _answer(ready.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR), ip)
            waiting.unregister(ready.fileobj)
            ready.fileobj.close()
    for pending in list(waiting.get_map().values()):  # no answer in time
        out[pending.data[0]] = None
        pending.fileobj.close()
    waiting.close()
    return out


def _answer(code: int, ip: str) -> bool | None:
    if code == errno.ECONNREFUSED:
        return False if addresses.is_own_address(ip) else None
    return True if code == 0 else None


class Prober:
    """Probes ranks by the addresses they registered; an address is read from the store once.

    A refusal proves death only from a port this prober has reached before (a port on an address
    others cannot reach refuses a live rank too), and only on this machine (:func:`~elaswave.control.addresses.is_own_address`;
    across a network a firewall's REJECT refuses a live rank too). Each watcher learns the next members in ring order when its view changes (a few connects
    per epoch, off the recovery path), so every rank is known to the ranks just before it."""

    def __init__(self):
        # Shared by a rank's main thread and its watcher, each with its own store connection.
        self._addresses: dict[int, str] = {}
        self._reached: set[int] = set()

    def _address(self, rank: int, store) -> str | None:
        address = self._addresses.get(rank)
        if address is None and store is not None and (raw := sealed(store).read(_key(rank))) is not None:
            address = self._addresses[rank] = raw.decode()
        return address  # None: never registered (a joiner still starting)

    def post_known(self, store) -> None:
        """The ports this prober has reached, posted where a rank has not posted its own (a store
        that moved, with members lost on the way: their refusals prove them dead there too)."""
        for rank in self._reached:
            store.compare_set(_key(rank), "", self._addresses[rank])

    def learn(self, ranks, store) -> None:
        """Probe ``ranks`` now, so that a later refusal from them counts."""
        for rank in ranks:
            if rank not in self._reached:
                address = self._address(rank, store)
                if address is not None and probe(address) is True:
                    self._reached.add(rank)

    def is_alive(self, rank: int, store) -> bool:
        """Whether ``rank`` may still be running: its port answers, or its host does not answer at
        all (nothing proven). False for a rank that never registered a port."""
        address = self._address(rank, store)
        return address is not None and probe(address) is not False

    def answers(self, rank: int, store) -> bool:
        """Whether ``rank``'s port answers now: its process exists (it may be hung or blocked)."""
        address = self._address(rank, store)
        return address is not None and probe(address) is True

    def is_silent(self, rank: int, store) -> bool:
        """Whether ``rank``'s port, reached before, now gives no answer at all (no route, or packets
        dropped): alive or not, this rank cannot reach it."""
        return bool(self.unreachable([rank], store, PROBE_TIMEOUT_S))

    def unreachable(self, ranks, store, timeout_s: float = REACH_TIMEOUT_S, reached_only: bool = True) -> list[int]:
        """Those of ``ranks`` whose port does not answer at all within ``timeout_s`` (all probed at
        once): alive or not, this rank cannot reach them over the network its collectives use.
        A refusal on this machine is not counted (the rank is gone: that is the death evidence's
        to say; one from another machine is silence, :func:`probe`), nor is a
        rank that never registered a port, nor -- with ``reached_only`` -- one whose port this
        prober never reached: an address that never worked (a host name that does not resolve
        here) says nothing about the network, only about the address."""
        addresses = {r: a for r in ranks if (a := self._address(r, store)) is not None}
        answers = probe_all(addresses, timeout_s)
        silent = sorted(r for r, a in answers.items() if a is None and (r in self._reached or not reached_only))
        self._reached.update(r for r, a in answers.items() if a is True)
        return silent

    def is_gone(self, rank: int, store) -> bool:
        """Whether ``rank`` is shown dead: its port, reached before, now refuses us."""
        address = self._address(rank, store)
        if address is None:
            return False
        answer = probe(address)
        if answer is True:
            self._reached.add(rank)
        return answer is False and rank in self._reached
