"""A design study, not a path elaswave runs: could detours finer than a micro-batch close issue 53 item 6 under interleaved 1F1B?

After one rank of an interleaved pipeline is lost, elaswave today stands the pipeline by and deals
its micro-batches to others: some pipeline runs one more (17 for 16 at Llama 3 405B's layout,
16,384 GPUs), (m + 1 + (p - 1) / V) / (m + (p - 1) / V) of the step. drop_replica's after/before
there is 127 / 128 = 0.9922. The alternative studied here keeps the broken pipeline running its
micro-batches and sends only the lost rank's chunks (virtual stages ``v`` with ``v % p == s``) --
whole, or in pieces of 1/g chunk (layers) -- each to the same stage's rank of another pipeline
(its *host*: every pipeline holds the same layers), inserted into the host's Megatron order where
its ideal time falls. Every rank's actions are then timed with their dependencies (a forward after
the previous hop's, a backward after the next hop's), forward 1/V and backward 2/V a chunk, no
communication time: what is left is the schedules' own cost.

Measured here (p 16, V 4, m 16, uniform chunks): failure-free 59.25; one more micro-batch 62.25
(0.952); detours of whole chunks over 127 hosts 60.00 (0.9875), of half chunks over 127 or 128
hosts 60.00 (0.9875), of quarter chunks over 127 hosts 61.31 -- both the broken pipeline and most
hosts end late, since each pipeline's interleaved timeline has no slack where a guest lands. With
each guest's weight pass deferred to its host's end (ZB-H1's W, half its backward), 59.75
(0.9916), whole chunks or halves: the broken pipeline, waiting for its guests' input gradients,
ends last. So at this layout, with this insertion, detours stay below drop_replica's 0.9922.

Under plain 1F1B (``--virtual-stages 1``; session 55) the same holds: whole stages over 127 hosts
0.9688 (stage 5 lost), 0.9789 (stage 1), 0.9490 (stage 10); halves and quarters the same, eighths
lower; with guests' W deferred 0.9894 (stages 1 and 5), 0.9789 (stage 10) -- in each the broken
pipeline ends last.

    python bench/sim/detour_grain.py [--lost-stage 5] [--virtual-stages 4]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import bench_args, write_results  # noqa: E402
from elaswave.pipeline.schedule import Op, stage_schedule  # noqa: E402

P, V, M = 16, 4, 16
CASES = ((127, 1, False), (127, 2, False), (128, 2, False), (127, 4, False), (127, 1, True), (127, 2, True))
"""(hosts, pieces a chunk, guests' weight passes deferred to their hosts' end)"""


def _order(p: int, v: int, m: int, s: int) -> list[tuple[str, int, int]]:
    """Rank ``s``'s computations in Megatron's interleaved order: (F or B, micro-batch, virtual stage)."""
    return [("F" if a.op is Op.FORWARD else "B", a.micro_batch, a.chunk * p + s)
            for a in stage_schedule("interleaved" if v > 1 else "1f1b", s, p, range(m), v)
            if a.op in (Op.FORWARD, Op.BACKWARD)]


def _timed(ranks: dict, routes: dict, f: float, b: float, deferred: bool = False) -> dict:
    """End time of every action ``(kind, pipe, mb, hop)``: each rank's in its order, a forward
    after its previous hop's forward, a backward after its next hop's backward (the last hop's
    after its own forward), a deferred weight pass (``W``) after its backward; a hop takes its
    share of a chunk's time. ``deferred``: a guest's backward is its input gradient's half, its
    ``W`` the other half."""
    done, at, free = {}, {r: 0 for r in ranks}, {r: 0.0 for r in ranks}
    pending, moved = set(ranks), True
    while pending and moved:
        moved = False
        for r in list(pending):
            acts = ranks[r]
            while at[r] < len(acts):
                kind, pipe, mb, hop = a = acts[at[r]]
                last = len(routes[pipe, mb]) - 1
                dep = (("F", pipe, mb, hop - 1) if hop else None) if kind == "F" else ("B", pipe, mb, hop) if kind == "W" \
                    else ("B", pipe, mb, hop + 1) if hop < last else ("F", pipe, mb, hop)
                if dep is not None and dep not in done:
                    break
                share = routes[pipe, mb][hop][1]
                cost = f if kind == "F" else b / 2 if kind == "W" or (deferred and r[0] != pipe) else b
                end = max(free[r], done[dep] if dep else 0.0) + cost * share
                done[a], free[r], at[r], moved = end, end, at[r] + 1, True
            if at[r] == len(acts):
                pending.discard(r)
    if pending:
        raise RuntimeError("the schedules deadlock")
    return done


def study(p: int, v: int, m: int, lost: int, hosts: int, pieces: int, deferred: bool = False) -> dict:
    """``deferred``: each guest's weight pass runs at its host's end (ZB-H1's W, in the cool-down)."""
    f, b, broken = 1.0 / v, 2.0 / v, hosts
    whole = [(k, 1.0) for k in range(p * v)]
    routes = {(0, mb): whole for mb in range(m)}
    ideal = _timed({r: [(k, 0, mb, h) for k, mb, h in _order(p, v, m, r)] for r in range(p)}, routes, f, b)
    step = max(ideal.values())
    ranks, turn = {}, 0
    for d in range(hosts + 1):
        for mb in range(m):
            routes[d, mb] = whole
        for r in range(p):
            if (d, r) != (broken, lost):
                ranks[d, r] = [(k, d, mb, h) for k, mb, h in _order(p, v, m, r)]
    for mb in range(m):
        hops, where = [], []
        for k in range(p * v):
            parts = pieces if k % p == lost else 1
            for _ in range(parts):
                hops.append((k, 1.0 / parts))
                where.append((turn % hosts, lost) if k % p == lost else None)
                turn += k % p == lost
        routes[broken, mb] = hops
        for hop, ((k, _), host) in enumerate(zip(hops, where)):
            if host is None:
                continue
            own = ranks[host]
            for kind in ("F", "B"):
                t = ideal[kind, 0, mb, k]
                at = next((j for j, (k2, d2, mb2, h2) in enumerate(own) if d2 != broken and ideal[k2, 0, mb2, h2] > t),
                          len(own))
                own.insert(at, (kind, broken, mb, hop))
            if deferred:
                own.append(("W", broken, mb, hop))
    for r in range(p):  # the broken pipeline's own computations by hop, not virtual stage
        if r != lost:
            ranks[broken, r] = [(k, d, mb, next(h for h, (kk, share) in enumerate(routes[broken, mb])
                                                if kk == vs and share == 1.0)) for k, d, mb, vs in ranks[broken, r]]
    done = _timed(ranks, routes, f, b, deferred)
    ends: dict[int, float] = {}
    for (_, d, _, _), t in done.items():
        ends[d] = max(ends.get(d, 0.0), t)
    routes.update({(-1, mb): whole for mb in range(m + 1)})
    more = _timed({r: [(k, -1, mb, h) for k, mb, h in _order(p, v, m + 1, r)] for r in range(p)}, routes, f, b)
    return {"failure_free": step, "detours": max(ends.values()), "broken_ends": ends[broken],
            "hosts_late": sum(1 for d, t in ends.items() if d != broken and t > step + 1e-9),
            "one_more_micro_batch": max(more.values())}


def main() -> int:
    ap = bench_args(__doc__, out="detour_grain")
    ap.add_argument("--lost-stage", type=int, default=5)
    ap.add_argument("--virtual-stages", type=int, default=V, help="1: plain 1F1B")
    args = ap.parse_args()
    v = args.virtual_stages
    rows, doc = [], {}
    for hosts, pieces, deferred in CASES:
        res = study(P, v, M, args.lost_stage, hosts, pieces, deferred)
        doc[f"{hosts} hosts, 1/{pieces} chunk{', W deferred' if deferred else ''}"] = res
        t = res["failure_free"]
        rows.append(f"| {hosts} | 1/{pieces} | {'yes' if deferred else 'no'} | {t:.2f} | {res['detours']:.2f} | {t / res['detours']:.4f} | "
                    f"{res['broken_ends']:.2f} | {res['hosts_late']} | {t / res['one_more_micro_batch']:.4f} |")
    lines = [f"p {P}, V {v}, m {M}, stage {args.lost_stage} lost; drop_replica at 128 pipelines: {127 / 128:.4f}", "",
             "| hosts | piece | guests' W deferred | step before | step with detours | after/before | broken pipeline ends | hosts late "
             "| one more micro-batch: after/before |", "| --- " * 9 + "|", *rows]
    write_results(args.out, doc, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
