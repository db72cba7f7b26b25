"""Schedules for micro-batches that do not all run down their own pipeline (detours: elaswave's
when they are its fastest plan, and the reroute baseline's).

When a broken pipeline's micro-batches pass through another pipeline's stage, that stage serves two
pipelines and no fixed order fits. Each rank keeps its own pipeline's order (1F1B, or interleaved
1F1B over model chunks: a route then names the rank of each virtual stage), and each guest goes
into its host's order where the host's own computation of the same place in its pipeline's order
is: the k-th forward or backward of its home's order at that stage just before the host's own k-th
(with equal counts, its forward before the forward of the host's micro-batch of the same place, its
backward before that one's backward, the same chunk's with chunks). A guest then runs about when its own pipeline's schedule wants it, and
where the host's stage is not its pipeline's slowest, the host's wait for that stage absorbs part of
it (the simulator's Llama 3 405B 1F1B stages, one guest a host: a step 2.2 % longer than before
the loss, against 7.8 % for the list schedule below: ``tests/pipeline/test_routed.py``).
Pipelines no detour touches run their plain schedule.

Where that order would deadlock (a broken pipeline's survivor that hosts too can make it), every
rank's computations go by when each ends in its home's own schedule run alone, which cannot
deadlock (:func:`_with_guests`). Without model chunks the greedy list schedule below is also timed
and the shorter run (and it alone where a rank holds only guests), as ReCycle does: earliest start
first, backwards before forwards on a tie, and at most ``stages - s`` micro-batches of each home
pipeline in flight on a stage (1F1B's memory bound), 2 more once any micro-batch takes a detour
(with exactly 1F1B's bound a broken pipeline's first stage starves waiting for its busy hosts; 2
was the best of 0-3 on 4x4, 8x4 and 4x8 layouts). With chunks a rank holding only guests has no
schedule: the plan is refused (:class:`DeadlockError`).

Every rank computes the same schedule from the same inputs. Run with blocking receives and
non-blocking sends, each rank's order is that of a complete simulated execution, so it cannot
deadlock.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

from elaswave.pipeline.schedule import BACKWARD_INPUT_SHARE, Action, DeadlockError, Op, stage_schedule, timeline

_COMPUTE = (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)
_NEEDS = {Op.BACKWARD: Op.FORWARD, Op.BACKWARD_INPUT: Op.FORWARD, Op.BACKWARD_WEIGHT: Op.BACKWARD_INPUT}
_SHARE = {Op.BACKWARD: 1.0, Op.BACKWARD_INPUT: BACKWARD_INPUT_SHARE, Op.BACKWARD_WEIGHT: 1.0 - BACKWARD_INPUT_SHARE}
"""A backward's share of the whole: ZB-H1's B and W split it as the executor times them."""
SPARE_IN_FLIGHT = 2
EXACT_MAX_RANKS = 2048
"""Up to this many ranks in a connected set of routes (a broken pipeline and the pipelines hosting
its micro-batches: 1,040 for Llama 3 405B's interleaved layout at 16,384 GPUs, timed in about a
second), a plan with detours is timed (by the planner and the simulator) by this module's
schedule; above it they bound it analytically. (The list schedule, quadratic in ranks, takes
seconds from a few hundred: it runs only where the inserted order fails.)"""


def guests_in_flight(plan, rank: int, window: int) -> int:
    """The most guests ``rank`` holds at once under ``plan``'s detours: each is alive from before its
    host's own forward of the same place in the pipelines' orders to before that one's backward (its
    W under ZB-H1), and under 1F1B a stage ``window`` from its pipeline's end runs ``window``
    forwards ahead of its backwards (under ZB-H1 every stage holds ``window`` = the pipeline's
    depth, as its own), so guests whose places are less than ``window`` apart overlap."""
    places = [j for j, _ in plan.guest_places.get(rank, ())] if getattr(plan, "routes", ()) else ()
    return max((sum(1 for q in places if p - window < q <= p) for p in places), default=0)


def layout_stage(plan, rank: int, stage: int, depth: int) -> tuple[int, int]:
    """(stage, stages) of ``rank`` in its pipeline's whole layout: a broken pipeline's survivor that
    its micro-batches' routes still pass keeps its place there (their ring's, its schedule's), not
    its place among the survivors (``stage`` of ``depth``, the rest's)."""
    d = plan.position(rank)[0]
    route = plan.route_of.get(plan.micro_batches[d][0]) if plan.routes and plan.micro_batches[d] else None
    if route is None or rank not in route:
        return stage, depth
    whole = len(route) // plan.virtual_stages
    return route.index(rank) % whole, whole


def routes_of(pipelines: Sequence[Sequence[int]], micro_batches: Sequence[Sequence[int]],
              detours: Mapping[int, Sequence[int]], num_chunks: int = 1) -> tuple[dict[int, Sequence[int]], dict[int, int]]:
    """Every micro-batch's route (the rank of each virtual stage: its pipeline's ranks, ``num_chunks``
    times round, unless it takes a detour) and its home pipeline: the inputs of :func:`routed_schedules`."""
    routes, home = {}, {}
    for d, (pipe, ids) in enumerate(zip(pipelines, micro_batches)):
        for mb in ids:
            routes[mb], home[mb] = detours.get(mb, tuple(pipe) * num_chunks), d
    return routes, home


def routed_schedules(routes: Mapping[int, Sequence[int]], home: Mapping[int, int],
                     forward_s: Mapping[int, float | tuple[float, ...]], backward_factor: float = 2.0,
                     spare: int | None = None, num_chunks: int = 1,
                     schedule: str = "1f1b") -> tuple[dict[int, list[Action]], float]:
    """``routes[mb]``: the rank of each stage for micro-batch ``mb``; ``home[mb]``: its pipeline;
    ``forward_s[rank]``: a forward's modelled time there (with ``num_chunks`` chunks a rank, each
    chunk's); ``spare``: micro-batches in flight beyond 1F1B's bound in the list schedule (None:
    :data:`SPARE_IN_FLIGHT` once any micro-batch takes a detour, else 0); ``schedule``: each
    pipeline's own (``parallel.schedule``: 1f1b or zb-h1; interleaved with chunks).
    Returns each rank's actions and the predicted time of the step's compute.

    Micro-batches whose routes share no rank never wait for each other, so each connected set of
    them is scheduled alone -- the same actions as scheduling all at once, since a rank's next
    action depends only on its own set's state and ties break by micro-batch and rank, whose order
    the sets keep -- and sets alike in shape and times once: at 16,384 GPUs only the broken
    pipelines and their hosts differ from one intact pipeline."""
    schedules: dict[int, list[Action]] = {}
    makespan = 0.0
    for mbs, ranks, (alike, span, _) in _by_component(routes, home, forward_s, backward_factor, spare,
                                                      num_chunks=num_chunks, schedule=schedule):
        makespan = max(makespan, span)
        for i, r in enumerate(ranks):
            schedules[r] = [replace(a, micro_batch=mbs[a.micro_batch], peer=None if a.peer is None else ranks[a.peer])
                            for a in alike[i]]
    return schedules, makespan


def routed_timing(routes: Mapping[int, Sequence[int]], home: Mapping[int, int],
                  forward_s: Mapping[int, float | tuple[float, ...]], backward_factor: float = 2.0,
                  released: Mapping[int, float] | None = None, num_chunks: int = 1,
                  schedule: str = "1f1b") -> tuple[float, dict[int, tuple[float, ...]]] | None:
    """The routed schedule's compute time and when each rank's last backward (or W) of each of its
    chunks ends, its actions in :func:`routed_schedules`' order with each rank's forwards after
    ``released[rank]`` (its parameters' all-gather); or None where a connected set of routes spans
    more than :data:`EXACT_MAX_RANKS` ranks (too slow to schedule: bound it)."""
    sets = _components(routes)
    if max((len(ranks) for _, ranks in sets), default=0) > EXACT_MAX_RANKS:
        return None
    makespan, ends = 0.0, {}
    for _, ranks, (_, span, local) in _by_component(routes, home, forward_s, backward_factor, None, sets, released,
                                                    num_chunks, schedule):
        makespan = max(makespan, span)
        ends.update((r, local[i]) for i, r in enumerate(ranks))
    return makespan, ends


def _components(routes: Mapping[int, Sequence[int]]) -> list[tuple[list[int], list[int]]]:
    """(micro-batches, ranks) of each set of routes connected by a shared rank, both sorted."""
    parent: dict[int, int] = {}

    def root(r: int) -> int:
        while parent.setdefault(r, r) != r:
            parent[r] = r = parent[parent[r]]
        return r
    for route in routes.values():
        for r in route[1:]:
            parent[root(r)] = root(route[0])
    mbs: dict[int, list[int]] = {}
    for mb in sorted(routes):
        mbs.setdefault(root(routes[mb][0]), []).append(mb)
    return [(ids, sorted({r for mb in ids for r in routes[mb]})) for ids in mbs.values()]


def _by_component(routes, home, forward_s, backward_factor, spare, sets=None, released=None, num_chunks=1,
                  schedule="1f1b"):
    """Each connected set's (micro-batches, ranks, (actions by rank index, makespan, each rank
    index's end)), scheduled with micro-batches and ranks renumbered in their order, each distinct
    set once; timed with its forwards after ``released``."""
    if spare is None:
        seen: dict[int, set] = {}
        for mb, route in routes.items():
            seen.setdefault(home[mb], set()).add(tuple(route))
        spare = SPARE_IN_FLIGHT if any(len(rs) > 1 for rs in seen.values()) else 0
    done: dict[tuple, tuple[dict[int, list[Action]], float]] = {}
    for mbs, ranks in sets if sets is not None else _components(routes):
        at = {r: i for i, r in enumerate(ranks)}
        homes = {h: i for i, h in enumerate(sorted({home[mb] for mb in mbs}))}
        local = tuple(tuple(at[r] for r in routes[mb]) for mb in mbs)
        waits = tuple((released or {}).get(r, 0.0) for r in ranks)
        key = (local, tuple(homes[home[mb]] for mb in mbs), tuple(forward_s[r] for r in ranks), waits, num_chunks,
               schedule)
        if key not in done:
            args = dict(enumerate(local)), dict(enumerate(key[1])), dict(enumerate(key[2])), backward_factor
            found = _inserted(*args, num_chunks, schedule=schedule)
            if found is None:  # (a broken pipeline's survivor that hosts too can deadlock both anchorings)
                found = _inserted(*args, num_chunks, by_time=True, schedule=schedule)
                if num_chunks == 1:
                    listed = _greedy(*args, spare)
                    found = listed if found is None or listed[1] < found[1] else found
            if found is None:
                raise DeadlockError(f"no schedule for detours between pipelines of {num_chunks} chunks a rank: "
                                    "a rank would hold only guests")
            actions, span, ends = found
            if any(waits):
                span, ends = _timed(actions, dict(enumerate(key[2])), backward_factor, dict(enumerate(waits)))
            done[key] = actions, span, ends
        yield mbs, ranks, done[key]


def _inserted(routes, home, forward_s, backward_factor: float, num_chunks: int = 1, by_time: bool = False,
              schedule: str = "1f1b"):
    """Each rank's own pipeline's order (``schedule``: 1F1B or ZB-H1, or interleaved 1F1B over
    ``num_chunks`` chunks: a route then names the rank of each virtual stage) with its guests
    inserted (the module's doc), timed; None where a rank holds only guests or the order would
    deadlock. ``by_time``: anchored by time (:func:`_with_guests`), which cannot deadlock."""
    by_home: dict[int, list[int]] = {}
    for mb in sorted(routes):
        by_home.setdefault(home[mb], []).append(mb)
    own: dict[int, tuple[int, int, int]] = {}  # rank -> (its pipeline, its stage, stages): on every route of it
    for h, mbs in by_home.items():
        p = len(routes[mbs[0]]) // num_chunks
        for s, r in enumerate(routes[mbs[0]][:p]):
            if all(routes[mb][c * p + s] == r for mb in mbs for c in range(num_chunks)):
                own[r] = (h, s, p)
    ranks = {r for route in routes.values() for r in route}
    if set(own) != ranks or any(len(set(route)) * num_chunks < len(route) for route in routes.values()):
        return None
    kind = "interleaved" if num_chunks > 1 else "zb-h1" if schedule == "zb-h1" else "1f1b"

    def stage_order(mbs: list[int], s: int, p: int) -> list[tuple[Op, int, int]]:
        return [(a.op, a.micro_batch, a.chunk) for a in stage_schedule(kind, s, p, mbs, num_chunks) if a.op in _COMPUTE]

    mine = {r: stage_order(by_home[h], s, p) for r, (h, s, p) in own.items()}
    found = None
    # Homes of unlike counts or depths: each anchoring is timed and the shorter taken (random
    # layouts: either may be up to ~30 % shorter; by micro-batch can deadlock; by place did not in
    # ~12,000 layouts of one broken pipeline nor 1,500 of two sharing hosts, but can where a broken
    # pipeline's survivor hosts too: the caller then anchors by time). Alike homes: the same schedules.
    shapes = {(len(mbs), len(routes[mbs[0]])) for mbs in by_home.values()}
    if by_time:
        ideal = _ideal_ends(routes, by_home, kind, num_chunks, backward_factor)
        return _shorter(None, _actions(_with_guests(routes, by_home, own, mine, stage_order, num_chunks, "time", ideal),
                                       routes, own), forward_s, backward_factor)
    for anchoring in ("place", "micro_batch") if len(shapes) > 1 else ("place",):
        found = _shorter(found, _actions(_with_guests(routes, by_home, own, mine, stage_order, num_chunks, anchoring),
                                         routes, own), forward_s, backward_factor)
    return found


def _shorter(found, schedules, forward_s, backward_factor: float):
    """``found`` or ``schedules`` timed, whichever is shorter; ``found`` where ``schedules`` deadlock."""
    try:
        span, ends = _timed(schedules, forward_s, backward_factor, {})
    except DeadlockError:
        return found
    return found if found is not None and found[1] <= span else (schedules, span, ends)


def _ideal_ends(routes, by_home, kind: str, num_chunks: int, backward_factor: float) -> dict[tuple, float]:
    """(op, micro-batch, chunk, stage) -> when that computation ends in its home's own
    schedule run alone, a forward taking 1: a time that grows along every micro-batch's route
    (a computation ends before any that needs its output starts)."""
    ends = {}
    for mbs in by_home.values():
        p = len(routes[mbs[0]]) // num_chunks
        done, _ = timeline([stage_schedule(kind, s, p, mbs, num_chunks) for s in range(p)],
                           [1.0 + backward_factor] * (p * num_chunks), backward_factor)
        for (op, k, mb), end in done.items():
            ends[op, mb, k // p, k % p] = end
    return ends


def _with_guests(routes, by_home, own, mine, stage_order, num_chunks: int, anchoring: str,
                 ideal: Mapping[tuple, float] | None = None) -> dict[int, list]:
    """Each rank's order of (op, micro-batch, chunk): its own (``mine``) with its guests in.
    ``anchoring``: ``place``, the k-th computation of a home's order at a stage goes just before
    its host's own k-th (those past the host's count after its end, still by place, so two homes'
    tails keep one order on every host they share), and a host's guests keep their home's order;
    ``micro_batch``, before the host's own computation of the micro-batch of the guest's index in
    its home (the same where homes are alike in count and depth; a guest past the host's count at
    the end, which can deadlock); ``time``, every rank's computations by when each ends in its
    home's own schedule (``ideal``, :func:`_ideal_ends`), guests first on a tie. That one cannot
    deadlock: every computation a rank waits for comes earlier in that time than the one waiting,
    and each rank runs its computations in that time's order, so no ring of waits can close."""
    guests = _guests(routes, by_home, own, stage_order, num_chunks)
    if anchoring == "time":
        timed = {r: [((ideal[(*op, own[r][1])], 1, 0), op) for op in ops] for r, ops in mine.items()}
        for r, _, turn, _, op, s in guests:
            timed[r].append(((ideal[(*op, s)], 0, turn), op))
        return {r: [op for _, op in sorted(items, key=lambda item: item[0])] for r, items in timed.items()}
    if anchoring == "place":  # by place, then guests before the host's own, then home by home
        placed = {r: [((k, 1, 0), op) for k, op in enumerate(ops)] for r, ops in mine.items()}
        for r, k, turn, _, op, _ in guests:
            placed[r].append(((k, 0, turn), op))
        return {r: [op for _, op in sorted(items, key=lambda item: item[0])] for r, items in placed.items()}
    order = {r: list(ops) for r, ops in mine.items()}
    for r, _, _, j, (op, mb, c), _ in guests:
        ops, theirs = order[r], by_home[own[r][0]]
        at = ops.index((op, theirs[j], c)) if j < len(theirs) else len(ops)
        if op is not Op.FORWARD:  # after what it needs: its forward (a W: its B)
            at = max(at, ops.index((_NEEDS[op], mb, c)) + 1)
        ops.insert(at, (op, mb, c))
    return order


def _guests(routes, by_home, own, stage_order, num_chunks: int):
    """Every guest computation, home by home and stage by stage in its home's order: (its host,
    its place k in that order, its home's turn, its micro-batch's index in its home, (op,
    micro-batch, chunk), its stage in its home)."""
    for turn, (g, mbs) in enumerate(by_home.items()):
        p = len(routes[mbs[0]]) // num_chunks
        index = {mb: j for j, mb in enumerate(mbs)}
        for s in range(p):
            for k, (op, mb, c) in enumerate(stage_order(mbs, s, p)):
                r = routes[mb][c * p + s]
                if own[r][0] != g:
                    yield r, k, turn, index[mb], (op, mb, c), s


def _actions(order, routes, own) -> dict[int, list[Action]]:
    """Each rank's computations with their receives and sends."""
    schedules = {}
    for r, ops in order.items():
        acts = schedules[r] = []
        p = own[r][2]
        for op, mb, c in ops:
            route = routes[mb]
            v, last = c * p + own[r][1], len(route) - 1
            if op is Op.FORWARD:
                acts += ([Action(Op.RECV_ACT, mb, route[v - 1], c)] if v else []) + [Action(Op.FORWARD, mb, None, c)] + \
                    ([Action(Op.SEND_ACT, mb, route[v + 1], c)] if v < last else [])
            elif op is Op.BACKWARD_WEIGHT:  # nobody waits for it, and it waits for nobody
                acts.append(Action(op, mb, None, c))
            else:
                acts += ([Action(Op.RECV_GRAD, mb, route[v + 1], c)] if v < last else []) + \
                    [Action(op, mb, None, c)] + ([Action(Op.SEND_GRAD, mb, route[v - 1], c)] if v else [])
    return schedules


def _cost(forward_s: float | tuple[float, ...], chunk: int) -> float:
    """A forward's time: a rank's, or with model chunks its chunk's."""
    return forward_s[chunk] if isinstance(forward_s, tuple) else forward_s


def _timed(schedules: Mapping[int, Sequence[Action]], forward_s: Mapping[int, float | tuple[float, ...]],
           backward_factor: float, released: Mapping[int, float]) -> tuple[float, dict[int, tuple[float, ...]]]:
    """Every rank's actions run in their order, a receive after its send (sends never wait), a
    rank's forwards after ``released``: (the last end, when each rank's last backward of each of
    its chunks ends); :class:`DeadlockError` where they get stuck or a message is never received."""
    sent: dict[tuple[bool, int, int, int], float] = {}  # (activation, from, to, micro-batch) -> when
    whole: dict[tuple[int, int], float] = {}  # (rank, chunk) -> when its last backward ends
    at, free = {r: 0 for r in schedules}, {r: 0.0 for r in schedules}
    while any(at[r] < len(a) for r, a in schedules.items()):
        moved = False
        for r, actions in schedules.items():
            while at[r] < len(actions):
                a = actions[at[r]]
                if a.op in (Op.RECV_ACT, Op.RECV_GRAD):
                    key = (a.op is Op.RECV_ACT, a.peer, r, a.micro_batch)
                    if key not in sent:
                        break
                    free[r] = max(free[r], sent.pop(key))
                elif a.op in (Op.SEND_ACT, Op.SEND_GRAD):
                    sent[(a.op is Op.SEND_ACT, r, a.peer, a.micro_batch)] = free[r]
                elif a.op is Op.FORWARD:
                    free[r] = max(free[r], released.get(r, 0.0)) + _cost(forward_s[r], a.chunk)
                else:
                    free[r] += _cost(forward_s[r], a.chunk) * backward_factor * _SHARE[a.op]
                    if a.op is not Op.BACKWARD_INPUT:  # (a B leaves the weights' gradients to its W)
                        whole[r, a.chunk] = free[r]
                at[r], moved = at[r] + 1, True
        if not moved:
            stuck = {r: str(a[at[r]]) for r, a in schedules.items() if at[r] < len(a)}
            raise DeadlockError(f"schedule deadlocks; ranks waiting at {stuck}")
    if sent:
        raise DeadlockError(f"messages sent but never received: {sorted(sent)}")
    chunks = 1 + max((c for _, c in whole), default=0)
    return max(free.values(), default=0.0), {r: tuple(whole.get((r, c), 0.0) for c in range(chunks)) for r in schedules}


def _greedy(routes, home, forward_s, backward_factor: float, spare: int) -> tuple[dict[int, list[Action]], float, dict]:
    free = {r: 0.0 for route in routes.values() for r in route}
    schedules: dict[int, list[Action]] = {r: [] for r in free}
    in_flight: dict[tuple[int, int], int] = {}
    # ready[rank] = [(ready time, is_forward, mb, stage)]
    ready: dict[int, list[tuple[float, bool, int, int]]] = {r: [] for r in free}
    for mb, route in routes.items():
        ready[route[0]].append((0.0, True, mb, 0))
    left = sum(2 * len(route) for route in routes.values())
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
    return schedules, max(free.values(), default=0.0), {r: (t,) for r, t in free.items()}


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


def plan_schedules(plan, backward_factor: float = 2.0, schedule: str = "1f1b") -> dict[int, list[Action]]:
    """Every rank's actions for a plan with detours (``plan.routes``), timed by the plan's layer
    costs and frequency levels; ``schedule``: the pipelines' own (``parallel.schedule``)."""
    routes, home = routes_of(plan.pipelines, plan.micro_batches, plan.route_of, plan.virtual_stages)
    costs = plan.layer_costs or (1.0,) * plan.num_layers
    forward_s = {}
    for r in plan.ranks:
        chunks = tuple(sum(costs[i:j]) / plan.frequency(r) for i, j in plan.chunk_ranges(r))
        forward_s[r] = chunks if plan.virtual_stages > 1 else chunks[0]
    schedules, _ = routed_schedules(routes, home, forward_s, backward_factor, num_chunks=plan.virtual_stages,
                                    schedule=schedule)
    return schedules


def check_deadlock_free(schedules: Mapping[int, Sequence[Action]]) -> None:
    """Run every rank's actions symbolically (receives wait for the matching send, sends never
    wait); raise :class:`DeadlockError` if they can get stuck or a message is never received."""
    _timed(schedules, dict.fromkeys(schedules, 0.0), 0.0, {})
