"""The store link against a real TCPStore behind a real loopback proxy that drops connections."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from elaswave.control.link import SILENT_S, StoreLink, StoreLost
from tests.helpers.proxy import Proxy


@pytest.fixture
def server():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    yield store


def _link(addr: str, grace_s: float) -> StoreLink:
    host, port = addr.rsplit(":", 1)
    raw = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5))
    return StoreLink(raw, addr, timeout_s=5.0, grace_s=grace_s)


def test_a_dropped_connection_that_comes_back_within_the_grace_keeps_working(server):
    with Proxy(server.port) as proxy:
        link = _link(proxy.addr, grace_s=2.0)
        assert link.add("n", 1) == 1
        proxy.refuse()
        proxy.cut()  # the connection drops and, for a while, the store seems gone
        threading.Timer(0.5, proxy.allow).start()
        began = time.monotonic()
        assert link.add("n", 1) == 2  # repeated on a new connection once the store answers again
        assert 0.4 < time.monotonic() - began < 2.0
        assert link.reconnects >= 1 and proxy.cuts == 1
        assert server.get("n") == b"2"
        assert link.get("n") == b"2" and not link.lost.is_set()


@pytest.mark.parametrize("silence", ["refuse", "stall"])
def test_a_store_that_stays_away_is_lost_within_the_grace_and_every_link_says_so(server, silence):
    """Refused (its process dead) or stalled (frozen on a host that still accepts connections: a
    TCPStore client's constructor would wait for its answer for good, so each reconnect attempt is
    bounded): either way the link gives up within the grace."""
    with Proxy(server.port) as proxy:
        link = _link(proxy.addr, grace_s=0.6)
        other = link.separate()
        link.set("k", "v")
        getattr(proxy, silence)()
        proxy.cut()
        began = time.monotonic()
        with pytest.raises(StoreLost, match=r"has not answered for 0.6 s"):
            link.get("k")
        assert 0.5 < time.monotonic() - began < 1.5
        began = time.monotonic()
        with pytest.raises(StoreLost):  # the process's other links give up at once
            other.add("hb", 1)
        assert time.monotonic() - began < 0.1
        proxy.allow()
        with pytest.raises(StoreLost):  # lost stays lost: the rank has begun saving its state
            link.get("k")


def test_a_clone_for_a_process_group_gives_up_with_the_process_not_after_the_stores_timeout():
    """A rank building a process group when the store died: TCPStore's clone retried the dead store
    for its whole timeout (a minute in the job of issue 58, where the rank should have moved the
    store). Now the clone ends with the process's other links -- the watcher's, which beat."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    link = StoreLink(dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30)),
                     f"127.0.0.1:{store.port}", timeout_s=30.0, grace_s=0.6)
    watcher_link = link.separate()
    assert link.clone().add("n", 1) == 1  # a live store: a working connection
    del store  # its process is gone

    def beat():
        with pytest.raises(StoreLost):
            while True:
                watcher_link.add("hb", 1)
                time.sleep(0.05)
    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    began = time.monotonic()
    with pytest.raises(StoreLost):
        link.clone()
    assert time.monotonic() - began < 3.0  # the watcher's grace (0.6 s), not the store's 30 s
    beating.join(5)
    assert link.lost.is_set()


def test_a_waits_timeout_is_not_a_lost_store(server):
    link = _link(f"127.0.0.1:{server.port}", grace_s=0.5)
    with pytest.raises(RuntimeError, match="(?i)timeout|timed out|wait"):
        link.wait(["never"], timedelta(seconds=0.2))
    assert not link.lost.is_set()


def test_a_set_on_a_connection_that_was_cut_is_not_lost(server):
    # TCPStore's set expects no reply, so on a dropped connection it "succeeds" and vanishes;
    # the link proves each set arrived and repeats it on a new connection when it did not.
    with Proxy(server.port) as proxy:
        link = _link(proxy.addr, grace_s=2.0)
        link.set("a", "1")
        proxy.cut()
        link.set("b", "2")
        assert server.get("b") == b"2" and link.reconnects == 1



def test_a_link_whose_failure_predates_a_move_gives_the_new_store_a_grace_of_its_own(server):
    """The race behind a survivor that gave up on the store it had just moved to: its watcher's link
    failed on the old store a moment before the main thread's link gave up and moved the store, and
    was still in its reconnect loop, its grace running out just after the move. Measured from the
    old failure, that grace would declare the new store lost; the new store gets one of its own."""
    new = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    with Proxy(server.port) as proxy:
        link = _link(proxy.addr, grace_s=0.6)
        watcher = link.separate()
        proxy.refuse()
        proxy.cut()
        with pytest.raises(StoreLost):
            link.get("k")
        link.move(f"127.0.0.1:{new.port}")
        # The watcher's loop, looking again after the move, a whole grace after its own failure.
        watcher._reconnect(time.monotonic() - 0.6, ConnectionError("Failed to recv, got 0 bytes"))
        new.set("x", "1")
        assert watcher.get("x") == b"1" and link.get("x") == b"1"
        assert not link.lost.is_set()


def _state(pid: int) -> str:
    """A process's state letter in /proc (T: stopped)."""
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


def test_a_frozen_store_is_lost_within_the_grace_not_never():
    # A real store process SIGSTOPped after the link connected: its kernel keeps the connection
    # open, so a TCPStore call waits for good (past its own timeout). The link's deadline ends it.
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time, datetime, torch.distributed as d;"
        "s = d.TCPStore('127.0.0.1', 0, world_size=None, is_master=True, wait_for_workers=False,"
        " timeout=datetime.timedelta(seconds=30)); print(s.port, flush=True); time.sleep(600)")],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        port = int(holder.stdout.readline())
        link = StoreLink(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30)),
                         f"127.0.0.1:{port}", timeout_s=30, grace_s=1.0)
        assert link.add("n", 1) == 1
        os.killpg(holder.pid, signal.SIGSTOP)
        # A SIGSTOP lands asynchronously: under load the store once answered the next call first.
        deadline = time.monotonic() + 10
        while _state(holder.pid) not in ("T", "t") and time.monotonic() < deadline:
            time.sleep(0.01)
        began = time.monotonic()
        with pytest.raises(StoreLost, match="has not answered for 1 s"):
            link.add("n", 1)
        took = time.monotonic() - began  # its silence (SILENT_S), then it is lost: not the 30 s timeout, not never
        assert SILENT_S - 0.5 < took < SILENT_S + 3, took
        with pytest.raises(StoreLost):  # and it stays lost for every later call, at once
            link.check(["n"])
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
