"""A watcher whose store is lost, on a real TCPStore behind a real loopback proxy."""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from elaswave.control.heartbeat import Watcher
from elaswave.control.link import StoreLink
from elaswave.interrupt import Interrupt
from tests.helpers.proxy import Proxy


def _link(addr: str) -> StoreLink:
    host, port = addr.rsplit(":", 1)
    return StoreLink(dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5)), addr,
                     timeout_s=5.0, grace_s=0.6)


def _server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))


@pytest.mark.parametrize("moved", [False, True])
def test_a_lost_store_breaks_the_epoch_a_recovery_builds_until_the_store_moves(moved):
    """Trained in epoch 0, agreed on epoch 1 (a recovery migrating state): the store dies. The
    rank's main thread may be blocked in epoch 1's migration, whose peers left to move the store:
    its watcher breaks epoch 1, not only 0 (it broke 0 alone, and a live rank waited out the
    group's timeout and was left out: issue 58). Once this rank has moved the store, the epochs
    after 0 are agreed anew there: epoch 1 is whole again and the old loss breaks nothing more."""
    server, successor = _server(), _server()
    interrupt, agreed = Interrupt(), 1
    with Proxy(server.port) as proxy:
        link = _link(proxy.addr)
        watcher = Watcher(link.separate(), 0, lambda: (0, (0, 1)), interrupt, interval_s=0.05, timeout_s=0.6,
                          agreed=lambda: agreed)
        watcher.start()
        try:
            time.sleep(0.3)
            proxy.refuse()
            proxy.cut()
            deadline = time.monotonic() + 10
            while not link.lost.is_set() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert link.lost.is_set()
            while not interrupt.is_broken(1) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert interrupt.is_broken(1), interrupt.broken_epoch
            if moved:  # what Context.relocate_store does
                agreed = 0
                interrupt.rearm(0)
                link.move(f"127.0.0.1:{successor.port}")
                time.sleep(1.5)  # over twice the watcher's timeout: the old loss trips nothing again
                assert interrupt.is_broken(0) and not interrupt.is_broken(1), interrupt.broken_epoch
        finally:
            watcher.stop()
            watcher.join(5)


def test_a_trip_for_a_store_since_replaced_does_nothing_and_rearm_undoes_one_before():
    interrupt = Interrupt()
    interrupt.trip(2, unless=lambda: True)
    assert not interrupt.is_broken(0)
    interrupt.trip(2, unless=lambda: False)
    assert interrupt.is_broken(2)
    interrupt.rearm(0)
    assert interrupt.is_broken(0) and not interrupt.is_broken(1)
    interrupt.trip(1)
    assert interrupt.is_broken(1)
