"""A network partition among live ranks: who is left out so that the others can train.

A rank that reaches the store but not its peers checks in like any live rank, so agreement alone
would keep it, and every group built with it would fail again, one collective timeout after
another. So each check-in carries what its rank found when it probed the others' liveness ports
(on the network the collectives use): the ranks that did not answer at all. Together the reports
are a graph of pairs that cannot talk; the next epoch leaves out the fewest ranks that cover it.

A rank checks in first and reports after probing (the report *pending* meanwhile): a rank that
probed before checking in would be late exactly when the network is in question, and the side cut
off -- whose probes fail at once, with no route -- would check in first and, after
``elastic.agree_timeout_s``, agree on an epoch of its own. The decision waits for the pending
reports, at most :data:`REACH_TIMEOUT_S` longer.

Pure functions of the reports, so every rank that computes the decision computes the same one.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Mapping, Sequence


REACH_TIMEOUT_S = 1.5
"""How long the reachability probes of a check-in wait for a port. A rank this slow to answer a
connect is left out of the next epoch, so the wait covers one lost SYN (Linux re-sends it after
1 s); it is paid only when the network is in question."""


def cut(live: Sequence[int], unreachable: Mapping[int, Iterable[int]]) -> dict[int, tuple[int, ...]]:
    """The ranks of ``live`` to leave out, each with the live ranks it could not talk to.

    ``unreachable[r]``: the ranks that rank ``r`` could not reach (None: its report is pending);
    a pair counts when either side reports it (a partition can be one-way). Greedy cover: the rank in the most such pairs goes
    first, ties to the highest rank -- the founding ranks, next to node 0's store, stay. One rank
    cut off from the others costs that rank; a host split in two keeps the side with rank 0."""
    members = set(live)
    pairs = {frozenset((a, b)) for a, bs in unreachable.items() if a in members and bs is not None
             for b in bs if b in members and b != a}
    out: dict[int, tuple[int, ...]] = {}
    while pairs:
        count = Counter(r for pair in pairs for r in pair)
        worst = max(count, key=lambda r: (count[r], r))
        out[worst] = tuple(sorted(r for pair in pairs if worst in pair for r in pair if r != worst))
        pairs = {pair for pair in pairs if worst not in pair}
    return out


def describe(rank: int, peers: Sequence[int]) -> str:
    """Why ``rank`` was left out, for the recovery record and the rank's own exit message."""
    return (f"cut off from ranks {list(peers)}: it reached the store, but it and they could not "
            "connect to each other")
