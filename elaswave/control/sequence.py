"""Numbered control records without a counter: alerts, join requests, verdicts, rank numbers.

A store's counter (``add``) carries no seal: anyone who reaches the store can raise or lower it.
Read as "how many alerts there are" or "the next rank number", a forged count once steered a job
(issue 58: ``add("ew/epoch", 1000)`` and the job refused to finish). So a sequence here is its
records themselves. Record ``n`` is ``<prefix><n>``, sealed (:mod:`elaswave.control.seal`):

- a writer *claims* the first slot, from where it knows the sequence ends, that holds no genuine
  record -- ``compare_set`` on a sealed record replaces a forged one in its way -- so no writer
  leaves a gap, and a repeated claim after a dropped connection finds its own record;
- a reader's count is the unbroken run of genuine records: a forged record past the end is no
  record, and the next real one replaces it.

A forged count, a forged record or a record replayed from another place (a seal covers the key,
and the store's generation: a record of the store before a move does not open after it) changes
nothing. What is left is denial of service: deleting records, or flooding slots faster than
writers replace them.
"""
from __future__ import annotations

import secrets


def unique(doc: str) -> str:
    """``doc`` made unlike any other writer's (two identical records would both think they won one slot)."""
    return f"{doc}\n{secrets.token_hex(8)}"


def body(raw: bytes) -> bytes:
    """A record's value without what :func:`unique` added."""
    return bytes(raw).rsplit(b"\n", 1)[0]


def append(store, prefix: str, doc: str, after: int = 0) -> int:
    """Put ``doc`` (made :func:`unique` by the caller where two writers could write the same) in the
    first slot after ``after`` (how far the writer knows the sequence is filled) that holds no
    genuine record; returns its number."""
    want, n = doc.encode(), after + 1
    while bytes(store.compare_set(f"{prefix}{n}", "", doc)) != want:
        n += 1
    return n


def count(store, prefix: str, known: int = 0) -> int:
    """How far the sequence is filled: ``known`` (already read) and the genuine records after it,
    up to the first slot that holds none."""
    return extent(lambda n: store.read(f"{prefix}{n}") is not None, known)


def extent(filled, known: int = 0) -> int:
    """The last ``n`` with ``filled(k)`` for every k in known+1..n, in O(log) calls: no writer
    leaves a gap, so the filled slots are one run (forged ones read as empty). A process that
    starts late in a long job (a joiner, a fresh look after a move) would otherwise read every
    record since the start, one request each on etcd, inside a bounded wait."""
    n, step = known, 1
    while filled(n + step):  # the end is at or past n + step
        n, step = n + step, step * 2
    low, high = n, n + step  # filled through low; high is empty
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if filled(mid) else (low, mid)
    return low
