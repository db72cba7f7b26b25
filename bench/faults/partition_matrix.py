"""One run, never two: the partition matrix of issue 35, each case ``--runs`` times, on both backends.

    python bench/faults/partition_matrix.py [--runs 20] [--cases all|NAME,NAME] [--steps 40] [--out NAME]

Each case is a real deterministic job (dp=2 x pp=2, the tests' tiny GPT, 6 micro-batches) with a
real fault after step 8; a *side* is what one agent's metrics file holds (the training steps, the
summary):

- ``c10d_cut``: two agents around node 0's TCPStore; host 1 (a network namespace, ranks 2 and 3)
  goes silent (both links down: nothing refused, its processes alive). The store's side goes on.
- ``c10d_cut_holder_silent``: the same cut seen from the other side: node 0, which holds the
  TCPStore, runs in the namespace, so the host that goes silent is the store's. It goes on (half
  the members, with the store); the other host stops.
- ``c10d_holder_stopped``: one host; ``elaswave run`` (which holds the TCPStore) is SIGSTOPped.
  The store moves to a standby and the ranks train on; the launcher is continued after the end.
- ``etcd_cut_majority_host0`` / ``etcd_cut_majority_host1``: two agents on a 3-member etcd
  cluster, one member (resp. two) in host 1's namespace; host 1 goes silent. The side with the
  etcd majority goes on -- in the second case that is host 1, without node 0's agent.
- ``etcd_member_killed`` / ``etcd_member_stopped``: one host on etcd; the member the ranks talk to
  first is SIGKILLed (resp. SIGSTOPped, continued after the end).
- ``c10d_three_hosts_one_cut`` / ``etcd_three_hosts_one_cut``: three agents (dp=3 x pp=2, two ranks
  a host; hosts 1 and 2 namespaces that reach each other through this one), around node 0's
  TCPStore (resp. one etcd member per host); host 2 goes silent. Hosts 0 and 1 go on.
- ``c10d_refusing_cut`` / ``etcd_refusing_cut``: as ``c10d_cut`` / ``etcd_cut_majority_host0``, but
  the cut is a firewall's REJECT (nftables ``reject with tcp reset`` in host 1's namespace, both
  ways): every connect refused, every connection reset, both sides alive (issue 58).
- ``c10d_one_way_cut`` / ``etcd_one_way_cut``: the same hosts; every packet from host 0 to host 1
  is dropped while host 1's packets still reach host 0.
- ``c10d_store_host_alone`` / ``etcd_node0_host_alone``: three agents, node 0 (which holds the
  TCPStore, resp. one of three etcd members) in a namespace of its own; node 0's host goes silent
  alone. Hosts 1 and 2 go on (the store moves to a standby of theirs); every process of node 0's
  side -- its agent too -- exits non-zero.

A run *passes* when at most one side writes a step after the fault, that side's run is bit-identical
to the reference (every step once, the losses, the final parameters and optimizer state), the other
side (if any) stops by itself with a documented code (3: left out, 4: the store lost) within 90 s
of the fault and writes no summary, and nothing hangs. Results: ``bench/results/partition_matrix.{json,md}``.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common, tests.helpers
from bench.common import RESULTS, write_results  # noqa: E402
from elaswave.runtime.metrics import read_jsonl  # noqa: E402
from tests.helpers import netns  # noqa: E402
from tests.helpers.etcd import EtcdCluster  # noqa: E402
from tests.helpers.spawn import TINY, Running, free_port, run_reference, session_members  # noqa: E402

FAULT_STEP = 8
STOP_WITHIN_S = 90.0
DOCUMENTED = (3, 4)
"""The codes a side that must not go on exits with: left out (``EXIT_EXCLUDED``), store lost (``EXIT_STORE_LOST``)."""
ENV = {"ELASWAVE_TOKEN": "partition-matrix", "TORCH_CPP_LOG_LEVEL": "ERROR"}
MICRO_BATCHES = 6
"""Dealt over 2 or 3 replicas alike (the reference is one process: every layout must equal it)."""


def _sets(steps: int, dp: int = 2) -> list[str]:
    return [*TINY, f"parallel.dp={dp}", "parallel.pp=2", f"train.steps={steps}",
            f"train.num_micro_batches={MICRO_BATCHES}", "train.deterministic=true", "elastic.respawn_after_s=-1",
            "parallel.timeout_s=30"]


def _args(sets: list[str], *extra: str) -> list[str]:
    return ["run", *[x for s in sets for x in ("--set", s)], *extra]


def _side(metrics: Path, code: int | None, after_wall: float, stopped_s: float | None) -> dict:
    records = read_jsonl(str(metrics)) if metrics.exists() else []
    steps = [r for r in records if r["event"] == "step"]
    return {"code": code, "steps": [r["step"] for r in steps], "losses": [r["loss"] for r in steps],
            "steps_after_fault": sum(r["wall_time"] > after_wall for r in steps),
            "summary": next((r for r in records if r["event"] == "summary"), None), "stopped_s": stopped_s}


def _finish(jobs: list[Running], since: float, limit_s: float) -> list[tuple[int | None, float | None]]:
    """Each job's exit code and when it exited, in seconds after ``since`` (monotonic); (None,
    None) for one still running after ``limit_s`` (a hang: counted, and killed on leaving its block).
    A hung job's workers are asked for their threads' stacks first (SIGUSR1: faulthandler), and
    every job's stderr goes to ``LOGS`` while a run is being judged."""
    out: list = [None] * len(jobs)
    while any(o is None for o in out) and time.monotonic() - since < limit_s:
        for i, job in enumerate(jobs):
            if out[i] is None and job.proc.poll() is not None:
                out[i] = (job.proc.returncode, time.monotonic() - since)
        time.sleep(0.05)
    for i, job in enumerate(jobs):
        if out[i] is None:
            for pid in session_members(job.proc.pid):
                if pid != job.proc.pid:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGUSR1)
            time.sleep(1.0)
        LOGS.append("".join(job._stderr))
    return [o or (None, None) for o in out]


LOGS: list[str] = []
"""The agents' stderr of the run being judged (kept in the results for a run that failed)."""


def _two_hosts(tmp: Path, steps: int, etcd_in_host1: int | None, holder_silent: bool = False,
               cut: str = "silence") -> list[dict]:
    """Two agents, host 1 in a namespace; ``etcd_in_host1``: None for the TCPStore, else how many
    of the 3 etcd members run on host 1. ``holder_silent`` (TCPStore): node 0, which holds the
    store, runs in the namespace instead, so the host that goes silent is the store's. ``cut``:
    how the namespace is cut off (``silence``, ``refuse``, ``drop_incoming``: netns.OtherHost).
    Returns both sides (node 0's first)."""
    with netns.OtherHost() as host:
        members = None if etcd_in_host1 is None else EtcdCluster(
            3, hosts=[host.here_store_ip] * (3 - etcd_in_host1) + [host.store_ip] * etcd_in_host1,
            prefixes=[[]] * (3 - etcd_in_host1) + [host.prefix()] * etcd_in_host1)
        with members or contextlib.nullcontext() as etcd:
            rdzv = (["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints] if members else
                    ["--rdzv-endpoint", f"{host.store_ip if holder_silent else host.here_store_ip}:{free_port()}"])

            def agent(k: int, bind: str, prefix=()) -> Running:
                return Running(_args([*_sets(steps), f"parallel.bind_address={bind}"], "--nnodes", "2", "--node-rank",
                                     str(k), *rdzv), tmp / f"m{k}.jsonl", env=ENV, prefix=list(prefix))

            here, there = (host.here_peer_ip, ()), (host.peer_ip, host.prefix())
            node0, node1 = (there, here) if holder_silent else (here, there)
            with agent(0, *node0) as a0, agent(1, *node1) as a1:
                a0.wait_for(rf"step\s+{FAULT_STEP}/", 240)
                getattr(host, cut)()
                wall, since = time.time(), time.monotonic()
                done = _finish([a0, a1], since, STOP_WITHIN_S + 150)
            _etcd_logs(etcd)
    return [_side(tmp / f"m{k}.jsonl", code, wall, s) for k, (code, s) in enumerate(done)]


def _etcd_logs(etcd: EtcdCluster | None) -> None:
    """The last lines of each etcd member's log, after the agents' (for a failed run's file)."""
    if etcd is not None:
        LOGS.extend(f"etcd member {i}:\n" + "\n".join((etcd._dir / f"m{i}.log").read_text().splitlines()[-60:])
                    for i in range(3))


def _three_hosts(tmp: Path, steps: int, etcd_per_host: bool) -> list[dict]:
    """Three agents (dp=3 x pp=2, two ranks a host): node 0 here, nodes 1 and 2 in namespaces that
    reach each other through this one; host 2 goes silent. ``etcd_per_host``: one etcd member on
    each host (else node 0's TCPStore). Hosts 0 and 1 hold 4 of the 6 ranks (and 2 of 3 members)."""
    netns.forward()
    with netns.OtherHost(1) as h1, netns.OtherHost(2) as h2:
        sides = _three_agents(tmp, steps, etcd_per_host, [(h1.here_store_ip, h1.here_peer_ip, ()),
                                                          (h1.store_ip, h1.peer_ip, h1.prefix()),
                                                          (h2.store_ip, h2.peer_ip, h2.prefix())], h2)
    sides[1]["partner"] = True  # host 1 goes on with host 0, whose leader writes the run's metrics
    return sides


def _node0_alone(tmp: Path, steps: int, etcd_per_host: bool) -> list[dict]:
    """Three agents, each host a namespace (node 0 in a third one, with the TCPStore or one of the
    three etcd members); node 0's host goes silent alone. Hosts 1 and 2 go on without it."""
    netns.forward()
    with netns.OtherHost(1) as h1, netns.OtherHost(2) as h2, netns.OtherHost(3) as h0:
        sides = _three_agents(tmp, steps, etcd_per_host, [(h0.store_ip, h0.peer_ip, h0.prefix()),
                                                          (h1.store_ip, h1.peer_ip, h1.prefix()),
                                                          (h2.store_ip, h2.peer_ip, h2.prefix())], h0)
    # Host 1's leader writes the run's metrics after the cut; host 2 ends with it.
    sides[2]["partner"] = True
    return sides


def _three_agents(tmp: Path, steps: int, etcd_per_host: bool, hosts: list[tuple], cut) -> list[dict]:
    """Node k at ``hosts[k]`` = (its store-link address, its peer address, its command prefix): one
    etcd member on each (``etcd_per_host``), else node 0 holds the TCPStore; ``cut`` goes silent
    after step FAULT_STEP."""
    members = EtcdCluster(3, hosts=[h[0] for h in hosts], prefixes=[list(h[2]) for h in hosts]) if etcd_per_host else None
    with members or contextlib.nullcontext() as etcd:
        rdzv = (["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints] if members else
                ["--rdzv-endpoint", f"{hosts[0][0]}:{free_port()}"])

        def agent(k: int) -> Running:
            return Running(_args([*_sets(steps, dp=3), f"parallel.bind_address={hosts[k][1]}"], "--nnodes", "3",
                                 "--node-rank", str(k), *rdzv), tmp / f"m{k}.jsonl", env=ENV, prefix=list(hosts[k][2]))

        with agent(0) as a0, agent(1) as a1, agent(2) as a2:
            a0.wait_for(rf"step\s+{FAULT_STEP}/", 300)
            cut.silence()
            wall, since = time.time(), time.monotonic()
            done = _finish([a0, a1, a2], since, STOP_WITHIN_S + 150)
        _etcd_logs(etcd)
    return [_side(tmp / f"m{k}.jsonl", code, wall, s) for k, (code, s) in enumerate(done)]


def _one_host(tmp: Path, steps: int, fault: str) -> list[dict]:
    """One host; ``fault``: holder_stopped (SIGSTOP the launcher), member_killed or member_stopped."""
    metrics = tmp / "run.jsonl"
    members = EtcdCluster(3) if fault.startswith("member") else None
    with members or contextlib.nullcontext() as etcd:
        rdzv = ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints] if etcd else []
        with Running(_args(_sets(steps), *rdzv), metrics, env=ENV) as job:
            job.wait_for(rf"step\s+{FAULT_STEP}/", 240)
            wall, since = time.time(), time.monotonic()
            if fault == "holder_stopped":
                os.kill(job.proc.pid, signal.SIGSTOP)
            elif fault == "member_killed":
                etcd.kill(0)
            else:
                etcd.stop(0)
            deadline = time.monotonic() + STOP_WITHIN_S + 150
            while time.monotonic() < deadline and not _has_summary(metrics):
                time.sleep(0.2)
            if fault == "holder_stopped":
                os.kill(job.proc.pid, signal.SIGCONT)
            elif fault == "member_stopped":
                etcd.cont(0)
            ((code, took),) = _finish([job], since, time.monotonic() - since + STOP_WITHIN_S)
    return [_side(metrics, code, wall, took)]


def _has_summary(metrics: Path) -> bool:
    return metrics.exists() and '"summary"' in metrics.read_text()


CASES = {
    "c10d_cut": lambda tmp, steps: _two_hosts(tmp, steps, None),
    "c10d_cut_holder_silent": lambda tmp, steps: _two_hosts(tmp, steps, None, holder_silent=True),
    "c10d_holder_stopped": lambda tmp, steps: _one_host(tmp, steps, "holder_stopped"),
    "c10d_three_hosts_one_cut": lambda tmp, steps: _three_hosts(tmp, steps, False),
    "etcd_cut_majority_host0": lambda tmp, steps: _two_hosts(tmp, steps, 1),
    "etcd_cut_majority_host1": lambda tmp, steps: _two_hosts(tmp, steps, 2),
    "etcd_member_killed": lambda tmp, steps: _one_host(tmp, steps, "member_killed"),
    "etcd_member_stopped": lambda tmp, steps: _one_host(tmp, steps, "member_stopped"),
    "etcd_three_hosts_one_cut": lambda tmp, steps: _three_hosts(tmp, steps, True),
    "c10d_refusing_cut": lambda tmp, steps: _two_hosts(tmp, steps, None, cut="refuse"),
    "etcd_refusing_cut": lambda tmp, steps: _two_hosts(tmp, steps, 1, cut="refuse"),
    "c10d_one_way_cut": lambda tmp, steps: _two_hosts(tmp, steps, None, cut="drop_incoming"),
    "etcd_one_way_cut": lambda tmp, steps: _two_hosts(tmp, steps, 1, cut="drop_incoming"),
    "c10d_store_host_alone": lambda tmp, steps: _node0_alone(tmp, steps, False),
    "etcd_node0_host_alone": lambda tmp, steps: _node0_alone(tmp, steps, True),
}
FIREWALL = ("refusing", "one_way")
"""Cases that need nftables."""


def judge(sides: list[dict], reference: dict, steps: int) -> dict:
    """Whether one run kept the promise, and if not, why."""
    writing = [s for s in sides if s["steps_after_fault"]]
    went_on = [s for s in sides if s["summary"] is not None]
    problems = []
    if len(writing) > 1:
        problems.append(f"{len(writing)} sides wrote steps after the fault: two runs")
    if len(went_on) != 1:
        problems.append(f"{len(went_on)} sides finished (wrote a summary); one must")
    for s in went_on:
        if s["steps"] != list(range(steps)) or s["losses"] != reference["losses"] or \
                s["summary"]["params_sha256"] != reference["params_sha256"] or \
                s["summary"]["state_sha256"] != reference["state_sha256"]:
            problems.append("the side that went on is not bit-identical to the reference")
    for s in sides:
        if s["code"] is None:
            problems.append("a side hung (did not exit)")
        elif s.get("partner"):  # a host of the side that goes on: it ends with it
            if s["code"] != 0:
                problems.append(f"a host of the side that went on exited with {s['code']}")
        elif s["summary"] is None and (s["code"] not in DOCUMENTED or (s["stopped_s"] or 0) > STOP_WITHIN_S):
            problems.append(f"a side stopped with code {s['code']} after {s['stopped_s']:.1f} s (want "
                            f"{DOCUMENTED} within {STOP_WITHIN_S:g} s)")
    return {"passed": not problems, "problems": problems,
            "codes": [s["code"] for s in sides], "stopped_s": [s["stopped_s"] for s in sides],
            "steps_after_fault": [s["steps_after_fault"] for s in sides]}


def markdown(doc: dict) -> list[str]:
    """The table: per case, the runs that kept the promise, and how the side that had to stop stopped."""
    lines = [doc["meta"], "", "| case | passed | the stopping side's exit codes | it stopped after s (median, max) "
             "| the going-on side finished after s (median) | problems |", "| --- | --- | --- | --- | --- | --- |"]
    for name, res in doc["cases"].items():
        if "skipped" in res:
            lines.append(f"| {name} | skipped: {res['skipped']} | | | | |")
            continue
        sides = [(c, t) for r in res["runs"] for c, t in zip(r["codes"], r["stopped_s"])]
        stops = [t for c, t in sides if c not in (0, None)]
        done = [t for c, t in sides if c == 0]  # (a three-host case's two going-on hosts both count)
        codes = sorted({c for c, _ in sides if c not in (0, None)})
        problems = sorted({p for r in res["runs"] for p in r["problems"]})
        stopped = f"{statistics.median(stops):.1f}, {max(stops):.1f}" if stops else "-"
        finished = f"{statistics.median(done):.1f}" if done else "-"
        lines.append(f"| {name} | {res['passed']} of {len(res['runs'])} | {codes or '- (one side)'} | {stopped} | "
                     f"{finished} | {'; '.join(problems) or '-'} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--cases", default="all")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default="partition_matrix", help="the results' name under bench/results (a subset of the "
                                                               "cases would replace the whole matrix's)")
    args = ap.parse_args(argv)
    names = list(CASES) if args.cases == "all" else [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in names if c not in CASES]
    if bad or args.runs < 1 or args.steps <= FAULT_STEP + 2:
        raise SystemExit(f"bench/faults/partition_matrix.py: --cases {bad} unknown (one of {', '.join(CASES)}), or "
                         f"--runs={args.runs} < 1, or --steps={args.steps} <= {FAULT_STEP + 2}")
    reason = netns.unavailable()
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        ref = run_reference(Path(tmp), args.steps, deterministic=True, num_micro_batches=MICRO_BATCHES)
    reference = {"losses": ref.losses, "params_sha256": ref.summary["params_sha256"],
                 "state_sha256": ref.summary["state_sha256"]}
    out: dict = {}
    for name in names:
        why = (netns.firewall_unavailable() if any(f in name for f in FIREWALL) else reason) \
            if ("cut" in name or "alone" in name) else None
        if why:
            out[name] = {"skipped": why}
            continue
        runs = []
        for i in range(args.runs):
            LOGS.clear()
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    verdict = judge(CASES[name](Path(tmp), args.steps), reference, args.steps)
                except Exception as exc:  # noqa: BLE001 - a run that broke (its cluster, its namespace) is a failed run
                    verdict = {"passed": False, "problems": [f"the run broke: {type(exc).__name__}: "
                                                             f"{str(exc).splitlines()[0] if str(exc) else ''}"],
                               "codes": [], "stopped_s": [], "steps_after_fault": []}
            if not verdict["passed"]:  # what each side said, for whoever looks into it
                failed = RESULTS / f"{args.out}_failures" / f"{name}_run{i}.log"
                failed.parent.mkdir(parents=True, exist_ok=True)
                failed.write_text("\n\n".join(f"== agent {k} ==\n{log}" for k, log in enumerate(LOGS)))
                verdict["log"] = str(failed.relative_to(RESULTS.parent.parent))
            runs.append(verdict)
            print(f"  {name} run {i}: {'pass' if verdict['passed'] else 'FAIL ' + '; '.join(verdict['problems'])} "
                  f"(codes {verdict['codes']}, stopped after {verdict['stopped_s']} s)", flush=True)
        out[name] = {"runs": runs, "passed": sum(r["passed"] for r in runs)}
        _write(args, out, began)  # after each case: a long matrix cut short keeps what it measured
    return 0 if all("skipped" in r or r["passed"] == len(r["runs"]) for r in out.values()) else 1


def _write(args, out: dict, began: float) -> None:
    import torch
    meta = (f"`python bench/faults/partition_matrix.py --runs {args.runs} --cases {args.cases} --steps {args.steps} "
            f"--out {args.out}` on {date.today()}, {platform.machine()}, {os.cpu_count()} CPUs, torch "
            f"{torch.__version__}, {time.perf_counter() - began:.0f} s; fault after step {FAULT_STEP} of {args.steps}.")
    doc = {"meta": meta, "cases": out}
    write_results(RESULTS / args.out, doc, markdown(doc))


if __name__ == "__main__":
    sys.exit(main())
