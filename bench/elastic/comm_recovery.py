"""Communicator recovery on gloo: standby switch vs partial rebuild vs full rebuild, measured in one run.

For each world size, N real processes train nothing but all-reduces; one SIGKILLs itself
mid-collective. The survivors then get working groups three ways, each timed from a store barrier
to the end of the first all-reduce on the new group (min over survivors: the last one out of the
barrier waits for nobody, so its time is the method's own cost):

- standby: elaswave's way -- the group of the survivors was built while the job ran (as
  ``Communicator.prepare_standbys`` does); recovery only switches to it;
- partial: a new gloo group among the survivors only, over a fresh store prefix;
- full: destroy the default (world) process group and re-init the world over a fresh store prefix.

    python bench/elastic/comm_recovery.py --worlds 4 8 16 --repeats 5
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import bench_args, write_results  # noqa: E402

TIMEOUT = timedelta(seconds=60)


def _barrier(store, name: str, n: int) -> None:
    store.add(name, 1)
    while int(store.add(name, 0)) < n:
        time.sleep(0.0005)


def worker(rank: int, world: int, port: int, victim: int) -> None:
    from elaswave.comm.backend import make_process_group

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    _barrier(store, "started", world)  # 16 processes importing torch on 2 cores start far apart
    dist.init_process_group("gloo", store=dist.PrefixStore("world", store), rank=rank, world_size=world,
                            timeout=timedelta(seconds=5))
    survivors = [r for r in range(world) if r != victim]
    standby = None
    if rank != victim:
        standby = make_process_group(store.clone(), "standby/", survivors.index(rank), len(survivors), "gloo",
                                     60.0, torch.device("cpu"))
    dist.barrier()
    for i in range(10_000):
        if rank == victim and i == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        work = dist.all_reduce(torch.ones(1000), async_op=True)
        # Only the victim's ring neighbours see an error; they tell the others through the store.
        while not work.is_completed() and not store.check(["broken"]):
            time.sleep(0.001)
        try:
            work.wait()  # a collective stuck on the dead peer errors out after the group's 5 s timeout
        except RuntimeError:
            store.set("broken", "1")
            break
        if store.check(["broken"]):
            break
    # Pending collectives are resolved now, so a full rebuild's destroy does not wait on them; the
    # timing below is each method's own cost, not detection (which elaswave does through the store).
    n, me = len(survivors), survivors.index(rank)
    out = {}
    for method in ("standby", "partial", "full"):
        _barrier(store, f"go/{method}", n)
        t = time.perf_counter()
        if method == "standby":
            pg = standby
        elif method == "partial":
            pg = make_process_group(store, "partial/", me, n, "gloo", 60.0, torch.device("cpu"))
        else:
            dist.destroy_process_group()
            dist.init_process_group("gloo", store=dist.PrefixStore("full", store), rank=me, world_size=n,
                                    timeout=TIMEOUT)
            pg = dist.distributed_c10d._get_default_group()
        out[method + "_ready"] = time.perf_counter() - t
        pg.allreduce([torch.ones(1000)]).wait()
        out[method] = time.perf_counter() - t
    store.set(f"result/{rank}", json.dumps(out))
    sys.stdout.flush()
    os._exit(0)


def trial(world: int, victim: int) -> dict[str, float]:
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR")
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(world), str(store.port), str(victim)],
                              env=env, stderr=subprocess.DEVNULL) for r in range(world)]
    try:
        for p in procs:
            p.wait(timeout=600)
        results = [json.loads(store.get(f"result/{r}")) for r in range(world) if r != victim]
        # The last survivor out of the barrier waits for nobody: its time is the method's own cost.
        return {m: min(r[m] for r in results) for m in results[0]}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def main() -> None:
    ap = bench_args(__doc__, out="comm_recovery")
    ap.add_argument("--worlds", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rows = []
    for world in args.worlds:
        trials = [trial(world, victim=(k % (world - 1)) + 1) for k in range(args.repeats)]
        med = {m: statistics.median(t[m] for t in trials) for m in trials[0]}
        rows.append({"world": world, "repeats": args.repeats, "median_s": med,
                     "partial_over_standby": med["partial"] / med["standby"],
                     "full_over_standby": med["full"] / med["standby"],
                     "ready_partial_over_standby": med["partial_ready"] / med["standby_ready"],
                     "ready_full_over_standby": med["full_ready"] / med["standby_ready"], "trials": trials})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "trials"}), flush=True)
    lines = ["| world | measured to | standby (ms) | partial rebuild (ms) | full rebuild (ms) | partial / standby | full / standby |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        m = r["median_s"]
        lines.append(f"| {r['world']} | group ready | {m['standby_ready'] * 1e3:.3f} | {m['partial_ready'] * 1e3:.2f} "
                     f"| {m['full_ready'] * 1e3:.2f} | {r['ready_partial_over_standby']:.0f}x | {r['ready_full_over_standby']:.0f}x |")
        lines.append(f"| {r['world']} | first all-reduce done | {m['standby'] * 1e3:.2f} | {m['partial'] * 1e3:.2f} "
                     f"| {m['full'] * 1e3:.2f} | {r['partial_over_standby']:.1f}x | {r['full_over_standby']:.1f}x |")
    write_results(args.out, {"torch": torch.__version__, "rows": rows}, [
        f"Communicator recovery on gloo, torch {torch.__version__}, medians of {args.repeats} kills; "
        "time from a barrier among the survivors to a usable group, and to the end of the first "
        "all-reduce (4 KB) on it "
        "(the minimum over survivors: the last one out of the barrier waits for nobody).", "", *lines])


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*map(int, sys.argv[2:6]))
    else:
        main()
