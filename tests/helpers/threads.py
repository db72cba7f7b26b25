"""Run one function per key at once on threads (ranks of a protocol over a real store)."""
from __future__ import annotations

import threading


def at_once(fn, keys, timeout_s: float = 15.0) -> dict:
    """``{key: fn(key)}``, every call started together; a call still running after ``timeout_s`` is missing."""
    results = {}
    threads = [threading.Thread(target=lambda k=k: results.__setitem__(k, fn(k))) for k in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return results
