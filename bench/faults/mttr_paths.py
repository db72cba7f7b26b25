"""MTTR on record against the step records, on every path where nobody injected the fault for the
job to see (issue 58, item 6).

    python bench/faults/mttr_paths.py [--runs 3] [--paths all|NAME,NAME] [--out mttr_paths]

A recovery's or a store move's ``mttr_s`` is what an operator reads; the step records show what
the job lost: the gap from the last step completed before the fault to the first completed after,
of which up to one step's time was under way when the fault struck. Each path is a real
deterministic job (the tests' tiny GPT, dp=2 x pp=2 unless said) with a real fault after step 8:

- ``store_holder_killed``: one host; ``elaswave run``, which holds the TCPStore, SIGKILLed (its
  workers live on and move the store to a standby).
- ``store_holder_frozen``: the same launcher SIGSTOPped (continued after the end).
- ``store_host_killed``: two agents on loopback; node 0's whole host (its agent with the store and
  its two workers) SIGKILLed at once.
- ``store_host_silent``: three agents (dp=3), each host a network namespace; node 0's host, with
  the TCPStore, goes silent (both links down); hosts 1 and 2 move the store and go on.
- ``etcd_kill_in_leader_change``: one host on a 3-member etcd; a worker and the etcd leader
  SIGKILLed at once.

Reported per path: recorded MTTR, the gap, one step, and recorded / (gap - one step) -- the tests'
bar (tests/helpers/spawn.assert_honest_mttr) is 0.9; a ratio far above 1 would be a record that
overstates.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.*, tests.helpers
from bench.common import RESULTS, short_error, write_results  # noqa: E402
from bench.faults import partition_matrix  # noqa: E402
from elaswave.runtime.metrics import read_jsonl  # noqa: E402
from tests.helpers.etcd import EtcdCluster  # noqa: E402
from tests.helpers.mttr import mttr_against_steps  # noqa: E402
from tests.helpers.spawn import (TINY, Running, children, free_port, rank_of, sigkill_launcher,  # noqa: E402
                                 wait_gone)

STEPS, FAULT_STEP = 40, 8
ENV = {"ELASWAVE_TOKEN": "mttr-paths", "TORCH_CPP_LOG_LEVEL": "ERROR"}


def _sets() -> list[str]:
    return [*TINY, "parallel.dp=2", "parallel.pp=2", f"train.steps={STEPS}", "train.num_micro_batches=4",
            "train.deterministic=true", "elastic.respawn_after_s=-1", "parallel.timeout_s=30"]


def _run(*extra: str) -> list[str]:
    return ["run", *[x for s in _sets() for x in ("--set", s)], *extra]


def store_holder_killed(tmp: Path) -> list[dict]:
    with Running(_run(), tmp / "run.jsonl", env=ENV) as job:
        workers, _, _ = sigkill_launcher(job, FAULT_STEP)
        wait_gone(workers, 180)
    return read_jsonl(str(tmp / "run.jsonl"))


def store_holder_frozen(tmp: Path) -> list[dict]:
    with Running(_run(), tmp / "run.jsonl", env=ENV) as job:
        job.wait_for(rf"step\s+{FAULT_STEP}/", 180)
        os.kill(job.proc.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 180
            while '"summary"' not in (tmp / "run.jsonl").read_text() and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            os.kill(job.proc.pid, signal.SIGCONT)
    return read_jsonl(str(tmp / "run.jsonl"))


def store_host_killed(tmp: Path) -> list[dict]:
    endpoint = f"127.0.0.1:{free_port()}"

    def agent(k: int) -> Running:
        return Running(_run("--nnodes", "2", "--node-rank", str(k), "--rdzv-endpoint", endpoint), tmp / "run.jsonl",
                       env=ENV)
    with agent(0) as host0, agent(1) as host1:
        host0.wait_for(rf"step\s+{FAULT_STEP}/", 180)
        os.killpg(host0.proc.pid, signal.SIGKILL)
        host1.finish(240)
    return read_jsonl(str(tmp / "run.jsonl"))


def store_host_silent(tmp: Path) -> list[dict]:
    partition_matrix._node0_alone(tmp, STEPS, False)
    return read_jsonl(str(tmp / "m1.jsonl"))  # host 1's leader writes the run's records after the cut


def etcd_kill_in_leader_change(tmp: Path) -> list[dict]:
    with EtcdCluster(3) as etcd, Running(_run("--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints),
                                         tmp / "run.jsonl", env=ENV) as job:
        job.wait_for(rf"step\s+{FAULT_STEP}/", 180)
        victim = next(p for p in children(job.proc.pid) if rank_of(p) == 3)
        leader = etcd.leader()
        os.kill(victim, signal.SIGKILL)
        etcd.kill(leader)
        job.finish(240)
    return read_jsonl(str(tmp / "run.jsonl"))


PATHS = {f.__name__: f for f in (store_holder_killed, store_holder_frozen, store_host_killed, store_host_silent,
                                 etcd_kill_in_leader_change)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--paths", default="all")
    ap.add_argument("--out", default="mttr_paths")
    args = ap.parse_args(argv)
    names = list(PATHS) if args.paths == "all" else args.paths.split(",")
    unknown = [n for n in names if n not in PATHS]
    if unknown:
        ap.error(f"--paths {','.join(unknown)} is invalid: use all or names from {', '.join(PATHS)}")
    began = time.perf_counter()
    out: dict[str, list] = {}
    for name in names:
        out[name] = []
        for i in range(args.runs):
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    rows = mttr_against_steps(PATHS[name](Path(tmp)))
                    for row in rows:
                        row["evidence"] = row.pop("record").get("evidence")
                    run = {"rows": rows}
                except Exception as exc:  # noqa: BLE001 - a broken run is a finding
                    run = {"error": short_error(exc)}
            out[name].append(run)
            print(name, i, run, flush=True)
    doc = {"meta": f"`python bench/faults/mttr_paths.py --runs {args.runs} --paths {args.paths}` on {date.today()}, "
                   f"{os.cpu_count()} CPUs, {time.perf_counter() - began:.0f} s; fault after step {FAULT_STEP} "
                   f"of {STEPS}", "paths": out}
    write_results(RESULTS / args.out, doc, _page(doc))
    return 0


def _page(doc: dict) -> list[str]:
    def med(vals: list[float]) -> str:
        return f"{statistics.median(vals):.2f} [{min(vals):.2f}-{max(vals):.2f}]" if vals else "-"
    lines = [doc["meta"], "", "| path | record | runs | recorded MTTR s | gap between step records s | one step s "
             "| recorded / (gap - step) | timed from |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, runs in doc["paths"].items():
        rows = [row for run in runs for row in run.get("rows", [])]
        broken = sum("error" in run for run in runs)
        for event in sorted({row["event"] for row in rows}):
            mine = [row for row in rows if row["event"] == event]
            ratios = [row["recorded_s"] / (row["gap_s"] - row["step_s"]) for row in mine if row["gap_s"] > row["step_s"]]
            lines.append(f"| {name} | {event} | {len(mine)} | {med([r['recorded_s'] for r in mine])} | "
                         f"{med([r['gap_s'] for r in mine])} | {med([r['step_s'] for r in mine])} | {med(ratios)} | "
                         f"{', '.join(sorted({str(r['from']) for r in mine}))} |")
        if broken or not rows:
            lines.append(f"| {name} | (runs that broke: {broken}; with no record: {sum(not run.get('rows') for run in runs)}) "
                         "| | | | | | |")
    return lines


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
