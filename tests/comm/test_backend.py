"""Waits on gloo work (comm/backend.py): bounded, and cut short by the control plane's interrupt."""
import time

import torch

from elaswave.comm import backend
from elaswave.interrupt import CommError, EpochBroken, Interrupt
from tests.helpers.spawn import run_group

ME = "tests.comm.test_backend"


class TripsAsItRegisters(Interrupt):
    """The control plane's trip landing between a wait's first check and its registering: the
    window a loaded host widens (a helper thread starts in it)."""

    def register(self, ev, epoch):
        self.trip(epoch)
        super().register(ev, epoch)


def late_trip_rank(group, hold_s: float):
    if group.me == 1:
        time.sleep(hold_s)  # alive and sending nothing: rank 0's receive can only end by the interrupt
        return None
    work = group.pg.recv([torch.zeros(1)], 1, 0)
    start = time.monotonic()
    try:
        backend.wait(work, 60.0, "a receive from a silent peer", TripsAsItRegisters(), 0)
    except EpochBroken:
        return "broken", time.monotonic() - start
    except CommError:
        return "comm error", time.monotonic() - start
    return "done", time.monotonic() - start


def older_trip_rank(group, send_after_s: float):
    if group.me == 1:
        time.sleep(send_after_s)
        group.pg.send([torch.full((4,), 7.0)], 0, 0).wait()
        time.sleep(1.0)  # (alive until its peer has the tensor)
        return None
    interrupt, got = Interrupt(), torch.zeros(4)
    work = group.pg.recv([got], 1, 0)
    import threading
    threading.Timer(0.3, interrupt.trip, (2,)).start()  # an older epoch's trip, late
    start = time.monotonic()
    backend.wait(work, 60.0, "a receive in epoch 3", interrupt, 3)
    return time.monotonic() - start, got.tolist()


def test_a_late_trip_of_an_older_epoch_does_not_end_a_newer_epochs_wait(tmp_path):
    """Epochs also advance without a trip (a join, a rebalance). A trip of epoch 2 arriving while a
    receive of epoch 3 waits woke it, and a receive (no future on gloo) returned as if it were
    complete, its buffer still empty; it now waits on until its tensor is in."""
    took, got = run_group(f"{ME}:older_trip_rank", 2, tmp_path, timeout_s=60.0, send_after_s=1.5)[0]
    assert got == [7.0] * 4 and took > 1.0, (took, got)


def test_a_trip_just_before_a_wait_registers_ends_the_wait_at_once(tmp_path):
    """Before the fix such a wait sat out its timeout: one rank's recovery took 120 s (the group's
    timeout) in a green suite under load; here it would end only when the silent peer exits."""
    how, took = run_group(f"{ME}:late_trip_rank", 2, tmp_path, timeout_s=60.0, hold_s=6.0)[0]
    assert how == "broken" and took < 2.0, (how, took)


def test_a_trip_before_registering_sets_the_event_and_an_older_one_does_not():
    import threading
    interrupt = Interrupt()
    interrupt.trip(3)
    older, newer = threading.Event(), threading.Event()
    interrupt.register(older, 3)
    interrupt.register(newer, 4)
    assert older.is_set() and not newer.is_set()
    interrupt.trip(4)
    assert newer.is_set()
