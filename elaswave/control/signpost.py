"""Where the job's store is now, asked at any host of a Slurm job.

Node 0's agent holds the job's store at the port every host derives from the job id
(:mod:`elaswave.control.slurm`). When node 0 is lost, the store moves to a member's standby at a port
of its own (:mod:`elaswave.control.failover`), which a replacement started later cannot guess. So
each other agent of the job answers at that same port on its own host: a TCPStore holding one key,
the store's address now, which the agent changes when it follows a move. A joiner asks the job's
hosts in Slurm's order. What it finds is a pointer, not proof: the store there must still open with
the job's token (:mod:`elaswave.control.seal`), so a forged pointer leads nowhere.
"""
from __future__ import annotations

import sys
import time
from typing import Sequence

from elaswave.control.link import CannotListen, check_listening, client, serve

KEY = "ew/signpost/store"
CONNECT_S = 0.5


class Signpost:
    """This agent's answer, at ``addr`` (its own host, the job's store port)."""

    def __init__(self, addr: str, store_addr: str, timeout_s: float):
        host, port = addr.rsplit(":", 1)
        self.addr, self.server = addr, serve(host, int(port), timeout_s)
        self.point(store_addr)

    def point(self, store_addr: str) -> None:
        self.server.set(KEY, store_addr)


def open_signpost(addr: str | None, store_addr: str, timeout_s: float) -> Signpost | None:
    """This agent's signpost, or None (none asked for, or the port is taken here: the joiners then
    find the store only where it started)."""
    if addr is None:
        return None
    try:
        return Signpost(addr, store_addr, timeout_s)
    except (CannotListen, RuntimeError, OSError) as exc:
        print(f"elaswave: no signpost at {addr} ({str(exc).splitlines()[0]}): a replacement finds the job's store "
              "only where it started", file=sys.stderr, flush=True)
        return None


def _listens(addr: str) -> bool:
    host, port = addr.rsplit(":", 1)
    try:
        check_listening(host.strip("[]"), int(port), CONNECT_S)
        return True
    except OSError:
        return False


def find_store(hosts: Sequence[str], port: int, within_s: float) -> str | None:
    """The job's store: the first of ``hosts`` that answers at ``port`` is the store itself (node 0,
    still there) or a signpost to it, followed only to a store that answers. Tried again until
    ``within_s`` (an agent follows a moved store within its heartbeat timeout); None if nothing did."""
    deadline = time.monotonic() + within_s
    while True:
        for host in hosts:
            addr = f"{host}:{port}"
            if not _listens(addr):
                continue
            try:
                there = client(host, port, CONNECT_S, within_s)
                pointed = there.get(KEY).decode() if there.check([KEY]) else addr
            except (RuntimeError, OSError, TimeoutError):
                continue
            if _listens(pointed):
                return pointed
        if time.monotonic() > deadline:
            return None
        time.sleep(0.5)
