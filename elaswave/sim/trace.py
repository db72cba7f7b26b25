"""Failure traces: when devices fail and come back (pure).

A trace is a sorted list of events ``(time_s, kind, device)`` with kind ``fail`` or ``join``.
Synthetic traces draw failures as a Poisson process (each live device fails at rate 1/MTBF), and
bring a failed device back after a repair time; files replay a recorded trace (JSON lines
``{"t_s": …, "kind": "fail"|"join", "device": …}``, or CSV ``t_s,kind,device``).
"""
from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass
from typing import Sequence

KINDS = ("fail", "join")


@dataclass(frozen=True, order=True)
class Event:
    t_s: float
    kind: str
    device: int


class TraceError(ValueError):
    """A trace file or trace parameters are invalid; the message names what and where."""


def poisson(devices: int, mtbf_device_h: float, hours: float, repair_h: float | None, seed: int,
            node_share: float = 0.0, per_node: int = 8) -> list[Event]:
    """Failures of ``devices`` devices, each failing at rate 1/``mtbf_device_h`` while it is up, over
    ``hours``; a failed device rejoins ``repair_h`` later (never, with None). ``node_share``: the
    share of failures that take the device's whole node (``per_node`` devices, numbered
    node-major) down with it -- a host's power, kernel or NIC -- and back together."""
    if devices < 1 or mtbf_device_h <= 0 or hours <= 0 or (repair_h is not None and repair_h < 0):
        raise TraceError(f"need devices >= 1, mtbf > 0, hours > 0 and repair >= 0; got devices={devices}, "
                         f"mtbf_device_h={mtbf_device_h}, hours={hours}, repair_h={repair_h}")
    if not 0 <= node_share <= 1 or per_node < 1:
        raise TraceError(f"node_share={node_share} is invalid: a share of failures, in [0, 1] (per_node={per_node})")
    r = random.Random(seed)
    end, t = hours * 3600.0, 0.0
    up = list(range(devices))
    returns: list[Event] = []
    events: list[Event] = []
    while True:
        # The next failure among the devices up now; repairs that land first change the rate.
        t_next = t + r.expovariate(len(up) / (mtbf_device_h * 3600.0)) if up else float("inf")
        back = [e for e in returns if e.t_s <= t_next]
        if back:
            e = min(back)
            returns.remove(e)
            if e.t_s >= end:
                break
            events.append(e)
            up.append(e.device)
            t = e.t_s
            continue
        if t_next >= end:
            break
        t = t_next
        device = up.pop(r.randrange(len(up)))
        lost = [device]
        # Drawn only when asked for, so a trace without node failures is the one it always was.
        if node_share and r.random() < node_share:
            node = device // per_node
            lost += [d for d in up if d // per_node == node]
            up = [d for d in up if d // per_node != node]
        for d in sorted(lost):
            events.append(Event(t, "fail", d))
            if repair_h is not None:
                returns.append(Event(t + repair_h * 3600.0, "join", d))
    return sorted(events)


def load(path: str, devices: int) -> list[Event]:
    """A trace from a file (see module doc); every device must be in ``0..devices-1``."""
    try:
        with open(path) as fh:
            text = fh.read()
    except OSError as exc:
        raise TraceError(f"--trace {path}: {exc.strerror}") from None
    rows: list[dict] = []
    if path.endswith(".csv"):
        for n, row in enumerate(csv.reader(text.splitlines()), 1):
            if not row or row[0].startswith("#") or row[0] == "t_s":
                continue
            if len(row) != 3:
                raise TraceError(f"--trace {path}:{n}: {row} has {len(row)} columns, not 3: t_s,kind,device")
            rows.append(dict(t_s=row[0], kind=row[1], device=row[2]))
    else:
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise TraceError(f"--trace {path}:{n}: not JSON ({exc.msg})") from None
    events = []
    for n, row in enumerate(rows, 1):
        try:
            e = Event(float(row["t_s"]), str(row["kind"]), int(row["device"]))
        except (KeyError, TypeError, ValueError):
            raise TraceError(f"--trace {path}: event {n} ({row}) needs t_s (number), kind and device (integer)") from None
        if e.kind not in KINDS or not 0 <= e.device < devices or e.t_s < 0:
            raise TraceError(f"--trace {path}: event {n} ({row}) is invalid: kind must be fail or join, device in "
                             f"0..{devices - 1}, t_s >= 0")
        events.append(e)
    return sorted(events)


def single_failure(device: int, at_s: float) -> list[Event]:
    return [Event(at_s, "fail", device)]


def check(events: Sequence[Event], devices: int) -> None:
    """Each failure is of a device that is up, each join of one that is down."""
    down: set[int] = set()
    for e in events:
        if e.kind == "fail" and e.device in down or e.kind == "join" and e.device not in down:
            raise TraceError(f"event {e} does not fit: device {e.device} is {'down' if e.device in down else 'up'}")
        (down.add if e.kind == "fail" else down.discard)(e.device)
    if len(down) >= devices:
        raise TraceError("the trace takes every device down at once")


def groups(events: Sequence[Event], size: int) -> list[Event]:
    """A GPU trace as its TP groups of ``size`` GPUs (GPU ``g`` in group ``g // size``) see it: a
    group fails with the first of its GPUs and joins again when the last of them is back."""
    if size == 1:
        return list(events)
    down: dict[int, set[int]] = {}
    out = []
    for e in events:
        g = e.device // size
        gone = down.setdefault(g, set())
        was_up = not gone
        (gone.add if e.kind == "fail" else gone.discard)(e.device)
        if was_up != (not gone):
            out.append(Event(e.t_s, e.kind, g))
    return out
