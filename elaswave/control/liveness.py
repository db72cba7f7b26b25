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
"""
from __future__ import annotations

import socket
import threading

from elaswave.control.membership import PREFIX

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
    """True: the process answers (alive, perhaps hung); False: its host refused (it is gone);
    None: no answer within ``timeout_s`` or no route (nothing proven)."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:  # timed out, no route, host down
        return None


class Prober:
    """Probes ranks by the addresses they registered; an address is read from the store once.

    A refusal proves death only from a port this prober has reached before: a firewall that
    rejects instead of dropping, or a port on an address others cannot reach, refuses a live rank
    too. Each watcher learns the next members in ring order when its view changes (a few connects
    per epoch, off the recovery path), so every rank is known to the ranks just before it."""

    def __init__(self):
        # Shared by a rank's main thread and its watcher, each with its own store connection.
        self._addresses: dict[int, str] = {}
        self._reached: set[int] = set()

    def _address(self, rank: int, store) -> str | None:
        address = self._addresses.get(rank)
        if address is None and store is not None and store.check([_key(rank)]):
            address = self._addresses[rank] = store.get(_key(rank)).decode()
        return address  # None: never registered (a joiner still starting)

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

    def is_gone(self, rank: int, store) -> bool:
        """Whether ``rank`` is shown dead: its port, reached before, now refuses us."""
        address = self._address(rank, store)
        if address is None:
            return False
        answer = probe(address)
        if answer is True:
            self._reached.add(rank)
        return answer is False and rank in self._reached
