"""The reroute baseline's routes (ReCycle-style): a broken pipeline's micro-batches pass through the
complete pipelines' same stages; and whether a pipeline's layer ranges cover the model."""
from __future__ import annotations

from typing import Sequence

from elaswave.plan.errors import PlanError


def covers(ranges: Sequence[tuple[int, int]], num_layers: int) -> bool:
    ends = [0, *(j for _, j in ranges)]
    return all(i == at for (i, _), at in zip(ranges, ends)) and ends[-1] == num_layers


def detour_routes(prev, pipelines, ranges, complete, mbs, epoch: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """Routes for the micro-batches of broken pipelines: their own survivors where they have the
    stage, else the rank holding that stage in the next complete pipeline (round robin)."""
    layouts = {tuple(rng) for rng, ok in zip(ranges, complete) if ok}
    if len(layouts) != 1:
        raise PlanError(f"epoch {epoch}: elastic.policy=reroute needs the complete pipelines to share one layout, "
                        f"they have {sorted(layouts)}")
    layout = layouts.pop()
    hosts = [pipe for pipe, ok in zip(pipelines, complete) if ok]
    routes, turn = [], 0
    for pipe, rng, ok, ids in zip(pipelines, ranges, complete, mbs):
        if ok:
            continue
        # With model chunks a pipeline's ranges go round its ranks once a chunk (virtual stage v on
        # rank v % p), and so does a route: the rank of each virtual stage, a detoured one's on the host.
        own = dict(zip(rng, (pipe[k % len(pipe)] for k in range(len(rng)))))
        if any(r not in layout for r in rng):
            raise PlanError(f"epoch {epoch}: elastic.policy=reroute cannot route through stages {list(rng)}: "
                            f"they differ from the layout {list(layout)}")
        # A micro-batch's chunks each to the next host in turn: with model chunks a host then takes
        # one chunk's work where it would take all of a micro-batch's (Llama 3 405B at 16,384 GPUs:
        # 64 chunk-works over 127 hosts; each host's work, not the whole micro-batch's, delays it).
        v_of = len(layout) // len(hosts[0])
        for mb in ids:
            routes.append((mb, tuple(own.get(r, hosts[(turn + v // len(hosts[0])) % len(hosts)][v % len(hosts[0])])
                                     for v, r in enumerate(layout))))
            turn += v_of
    return tuple(routes)
