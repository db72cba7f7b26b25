"""Schedules for micro-batches that do not all run down their own pipeline (the reroute baseline).

When a broken pipeline's micro-batches pass through another pipeline's stage, that stage serves two
pipelines and no fixed 1F1B order fits. As ReCycle does, the guest work goes where the host would
otherwise wait: a greedy list schedule over a timing model (forward ``f``, backward ``b`` per
stage), earliest start first, backwards before forwards on a tie, and at most ``stages - s``
micro-batches of each home pipeline in flight on a stage (1F1B's memory bound), 2 more once any
micro-batch takes a detour (with exactly 1F1B's bound a broken pipeline's first stage starves
waiting for its busy hosts; 2 was the best of 0-3 on 4x4, 8x4 and 4x8 layouts). A plan without
detours runs plain 1F1B (:func:`schedule.one_f_one_b`); this greedy schedule does not reproduce it
(with the spare, on uneven stages, it can beat it: 1F1B keeps fewer micro-batches in flight).
Every rank computes
the same schedule from the same inputs. Run with blocking receives and non-blocking sends, each
rank's order is that of a complete simulated execution, so it cannot deadlock.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from elaswave.pipeline.schedule import Action, DeadlockError, Op

SPARE_IN_FLIGHT = 2
EXACT_MAX_RANKS = 256
"""Up to this many ranks, a plan with detours is timed (by the planner and the simulator) by this
module's schedule; above it the schedule gets too slow to build and they bound it analytically."""


def routes_of(pipelines: Sequence[Sequence[int]], micro_batches: Sequence[Sequence[int]],
              detours: Mapping[int, Sequence[int]]) -> tuple[dict[int, Sequence[int]], dict[int, int]]:
    """Every micro-batch's route (its pipeline's ranks, unless it takes a detour) and its home
    pipeline: the two inputs of :func:`routed_schedules`."""
    routes, home = {}, {}
    for d, (pipe, ids) in enumerate(zip(pipelines, micro_batches)):
        for mb in ids:
            routes[mb], home[mb] = detours.get(mb, pipe), d
    return routes, home


def routed_schedules(routes: Mapping[int, Sequence[int]], home: Mapping[int, int],
                     forward_s: Mapping[int, float], backward_factor: float = 2.0,
                     spare: int | None = None) -> tuple[dict[int, list[Action]], float]:
    """``routes[mb]``: the rank of each stage for micro-batch ``mb``; ``home[mb]``: its pipeline;
    ``forward_s[rank]``: a forward's modelled time there; ``spare``: micro-batches in flight beyond
    1F1B's bound (None: :data:`SPARE_IN_FLIGHT` once any micro-batch takes a detour, else 0).
    Returns each rank's actions and the predicted time of the step's compute."""
    free = {r: 0.0 for route in routes.values() for r in route}
    schedules: dict[int, list[Action]] = {r: [] for r in free}
    in_flight: dict[tuple[int, int], int] = {}
    # ready[rank] = [(ready time, is_forward, mb, stage)]
    ready: dict[int, list[tuple[float, bool, int, int]]] = {r: [] for r in free}
    for mb, route in routes.items():
        ready[route[0]].append((0.0, True, mb, 0))
    left = sum(2 * len(route) for route in routes.values())
    seen: dict[int, set] = {}
    for mb, route in routes.items():
        seen.setdefault(home[mb], set()).add(tuple(route))
    if spare is None:
        spare = SPARE_IN_FLIGHT if any(len(rs) > 1 for rs in seen.values()) else 0
    while left:
        best = _pick(ready, free, routes, home, spare, in_flight, limited=True) or \
            _pick(ready, free, routes, home, spare, in_flight, limited=False)
        start, r, task = best
        ready[r].remove(task)
        _, is_forward, mb, s = task
        route = routes[mb]
        last = len(route) - 1
        cost = forward_s[r] * (1.0 if is_forward else backward_factor)
        end = start + cost
        free[r] = end
        key = (r, home[mb])
        if is_forward:
            in_flight[key] = in_flight.get(key, 0) + 1
            if s > 0:
                schedules[r].append(Action(Op.RECV_ACT, mb, route[s - 1]))
            schedules[r].append(Action(Op.FORWARD, mb))
            if s < last:
                schedules[r].append(Action(Op.SEND_ACT, mb, route[s + 1]))
                ready[route[s + 1]].append((end, True, mb, s + 1))
            else:
                ready[r].append((end, False, mb, s))
        else:
            in_flight[key] -= 1
            if s < last:
                schedules[r].append(Action(Op.RECV_GRAD, mb, route[s + 1]))
            schedules[r].append(Action(Op.BACKWARD, mb))
            if s > 0:
                schedules[r].append(Action(Op.SEND_GRAD, mb, route[s - 1]))
                ready[route[s - 1]].append((end, False, mb, s - 1))
        left -= 1
    return schedules, max(free.values(), default=0.0)


def _pick(ready, free, routes, home, spare, in_flight, limited: bool):
    best = None
    for r, tasks in ready.items():
        for task in tasks:
            at, is_forward, mb, s = task
            if limited and is_forward and in_flight.get((r, home[mb]), 0) >= len(routes[mb]) - s + spare:
                continue
            key = (max(at, free[r]), is_forward, mb, r)
            if best is None or key < best[0]:
                best = (key, r, task)
    return None if best is None else (best[0][0], best[1], best[2])


def plan_schedules(plan, backward_factor: float = 2.0) -> dict[int, list[Action]]:
    """Every rank's actions for a plan with detours (``plan.routes``), timed by the plan's layer
    costs and frequency levels."""
    routes, home = routes_of(plan.pipelines, plan.micro_batches, plan.route_of)
    costs = plan.layer_costs or (1.0,) * plan.num_layers
    forward_s = {}
    for r in plan.ranks:
        i, j = plan.layers_of(r)
        forward_s[r] = sum(costs[i:j]) / plan.frequency(r)
    schedules, _ = routed_schedules(routes, home, forward_s, backward_factor)
    return schedules


def check_deadlock_free(schedules: Mapping[int, Sequence[Action]]) -> None:
    """Run every rank's actions symbolically (receives wait for the matching send, sends never
    wait); raise :class:`DeadlockError` if they can get stuck or a message is never received."""
    sent: set[tuple[str, int, int, int]] = set()  # (kind, from, to, micro-batch)
    pos = {r: 0 for r in schedules}
    while True:
        progressed = False
        for r, sched in schedules.items():
            while pos[r] < len(sched):
                a = sched[pos[r]]
                if a.op in (Op.RECV_ACT, Op.RECV_GRAD):
                    key = ("act" if a.op is Op.RECV_ACT else "grad", a.peer, r, a.micro_batch)
                    if key not in sent:
                        break
                    sent.discard(key)
                elif a.op in (Op.SEND_ACT, Op.SEND_GRAD):
                    sent.add(("act" if a.op is Op.SEND_ACT else "grad", r, a.peer, a.micro_batch))
                pos[r] += 1
                progressed = True
        if all(pos[r] == len(s) for r, s in schedules.items()):
            if sent:
                raise DeadlockError(f"messages sent but never received: {sorted(sent)}")
            return
        if not progressed:
            stuck = {r: str(s[pos[r]]) for r, s in schedules.items() if pos[r] < len(s)}
            raise DeadlockError(f"schedule deadlocks; ranks waiting at {stuck}")
