"""How a broken epoch reaches a rank that is waiting: one flag, tripped by the control plane.

gloo does not unblock a collective whose peer died (only the dead rank's ring neighbours see an
error; the others wait for the group's timeout). So no wait in elaswave blocks on a collective
alone: it waits for *either* the collective's completion *or* this flag, whichever comes first.
"""
from __future__ import annotations

import threading


class Disruption(Exception):
    """The current epoch cannot go on: a member died, hung or left. The step is redone after recovery."""


class EpochBroken(Disruption):
    """The control plane says the epoch is broken (another rank's error, a missed heartbeat, a death)."""


class CommError(Disruption):
    """A collective or p2p transfer failed or timed out on this rank."""


class Interrupt:
    """Tripped with an epoch number: every wait of that epoch (or an older one) gives up at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._broken_epoch = -1
        self._waiters: set[threading.Event] = set()

    @property
    def broken_epoch(self) -> int:
        return self._broken_epoch

    def trip(self, epoch: int, unless=None) -> None:
        """Every wait of ``epoch`` or older gives up; not if ``unless()`` (read under the lock) says
        the cause is void -- the store whose loss this trip reports has moved since (:meth:`rearm`)."""
        with self._lock:
            if epoch <= self._broken_epoch or (unless is not None and unless()):
                return
            self._broken_epoch = epoch
            waiters = list(self._waiters)
        for ev in waiters:
            ev.set()

    def rearm(self, epoch: int) -> None:
        """The epochs after ``epoch`` are unbroken again: the job's store moved after its loss broke
        the epoch a recovery was building on it, and the survivors agree the epochs after ``epoch``
        anew on the moved store (:meth:`elaswave.runtime.context.Context.relocate_store`). Called
        just before the move, with the rank's agreed epoch lowered to ``epoch``: a later trip for
        the lost store breaks nothing new, or sees the move (:meth:`trip`'s ``unless``) and does nothing,
        and no trip an alert on the new store makes comes before it."""
        with self._lock:
            self._broken_epoch = min(self._broken_epoch, epoch)

    def is_broken(self, epoch: int) -> bool:
        return self._broken_epoch >= epoch

    def check(self, epoch: int) -> None:
        if self.is_broken(epoch):
            raise EpochBroken(f"epoch {epoch} was declared broken by the control plane")

    def register(self, ev: threading.Event, epoch: int) -> None:
        """``ev`` is set by the next trip of ``epoch`` or newer -- or now, where one came already: a
        wait that checked before it registered would miss a trip in between and sit out its whole
        timeout (a SIGKILLed peer's recovery waited 120 s for one rank under a loaded suite)."""
        with self._lock:
            self._waiters.add(ev)
            if self._broken_epoch >= epoch:
                ev.set()

    def unregister(self, ev: threading.Event) -> None:
        with self._lock:
            self._waiters.discard(ev)
