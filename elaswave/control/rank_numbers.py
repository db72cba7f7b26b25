"""Rank numbers: every process the job ever starts gets one no other process has had.

A founding rank's number is its place (0 .. world size - 1); a joiner's -- a replacement, a spare,
``elaswave join`` -- is claimed by whoever starts it, as a sealed record ``ew/rank/<n>`` holding
the claim's id (:mod:`elaswave.control.sequence`: the first free slot from the store's *floor*,
every number below which is taken). No counter steers it: a count an outsider lowered would once
have handed a member's number to a newcomer.

The floor is written once per store: the world size on the store the job starts, and on a store
it moves to, the numbers the members had seen handed out (:mod:`elaswave.control.failover`). A
joiner the old store numbered after the members last looked was still starting there: it cannot
follow (it was never a member), so its agent, following the store, claims its number there too
(:func:`reclaim`: unless the new store gave it to another first), stops it and starts another,
numbered by the new store. A process that reaches a store with a number claimed elsewhere checks
the claim there first and stops if the number is another's.
"""
from __future__ import annotations

from elaswave.control import sequence
from elaswave.control.seal import PREFIX, sealed

CLAIMS = PREFIX + "rank/"
FLOOR = PREFIX + "rank_floor"
CLAIM_ENV = "ELASWAVE_RANK_CLAIM"
"""Set in a joining worker: the id of the claim on its rank number (it checks the claim is its own)."""


def floor(store) -> int:
    raw = sealed(store).read(FLOOR)
    return int(raw) if raw is not None else 0


def set_floor(store, value: int) -> None:
    """On a new store, once (the first writer's value holds): every number below ``value`` is taken."""
    sealed(store).compare_set(FLOOR, "", str(value))


def claim(store) -> tuple[int, str]:
    """A number no process of the job has had, and the claim's id."""
    doc = sequence.unique("rank")
    return sequence.append(sealed(store), CLAIMS, doc, floor(store) - 1), doc


def count(store, known: int = 0) -> int:
    """How many rank numbers the job has handed out (every number below is taken); ``known``: a
    count read before (it only grows)."""
    return sequence.count(sealed(store), CLAIMS, max(floor(store), known) - 1) + 1


def reclaim(store, rank: int, claim_id: str) -> bool:
    """Whether ``rank`` is this claim's on ``store`` (claimed again there if it was free; a number
    below the floor was counted as handed out when the store began)."""
    if rank < floor(store):
        return True
    return bytes(sealed(store).compare_set(f"{CLAIMS}{rank}", "", claim_id)) == claim_id.encode()
