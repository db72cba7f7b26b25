"""A loopback TCP proxy for network faults: real sockets, cut and refused on command.

Everything a client sends through it reaches the target unchanged. :meth:`Proxy.cut` closes every
connection it carries (both ends see the connection drop, as when a link or a switch fails), and
while :meth:`Proxy.refuse` is on, new connections are accepted and closed at once (the target
seems gone); while :meth:`Proxy.stall` is on, they are accepted and never answered (a host gone
silent: each attempt waits out its timeout). :meth:`Proxy.allow` lets them through again.
"""
from __future__ import annotations

import socket
import threading


class Proxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1"):
        self.target = (host, target_port)
        self._listen = socket.create_server((host, 0))
        self.port = self._listen.getsockname()[1]
        self.addr = f"{host}:{self.port}"
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._held: list[socket.socket] = []
        self._refusing = self._stalling = False
        self.cuts = 0
        """Connections closed by :meth:`cut`."""
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True, name="proxy-accept").start()

    def cut(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
            held, self._held = self._held, []
        for s in conns + held:
            _close(s)
        self.cuts += len(conns) // 2

    def refuse(self) -> None:
        self._refusing = True

    def stall(self) -> None:
        self._stalling = True

    def allow(self) -> None:
        self._refusing = self._stalling = False

    def close(self) -> None:
        self.refuse()
        self.cut()
        _close(self._listen)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listen.accept()
            except OSError:
                return  # closed
            if self._refusing:
                _close(client)
                continue
            if self._stalling:
                with self._lock:
                    self._held.append(client)  # open, never answered; closed by cut or close
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._conns += [client, upstream]
                self.accepted += 1
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True, name="proxy-pipe").start()

    def __enter__(self) -> "Proxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _pipe(a: socket.socket, b: socket.socket) -> None:
    try:
        while True:
            data = a.recv(1 << 16)
            if not data:
                break
            b.sendall(data)
    except OSError:
        pass
    finally:
        _close(a)
        _close(b)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
