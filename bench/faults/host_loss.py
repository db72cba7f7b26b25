"""What "a refusal from another host is no proof" costs a whole host lost (issue 58, item 1).

    python bench/faults/host_loss.py --baseline CHECKOUT [--runs 5] [--out host_loss]

Two agents (dp=2 x pp=2, deterministic, the tests' tiny model): node 0 here with the TCPStore,
node 1 in a network namespace (its own kernel). After step 8 every process of host 1 -- its agent
and both workers -- is SIGKILLed: the host's kernel lives on and refuses every connect to the dead
ports, which the old rule took as proof (a quick eviction) and the new one counts as silence (the
heartbeats' timeout and both watchers). Each round runs this checkout and ``--baseline`` (an older
checkout, e.g. ``git worktree add /tmp/base eecc67b``: the code before the change) one after the
other, order alternating; reported per side: the recovery's recorded MTTR and the gap between the
step records around it (the measured one), and whether the run is bit-identical to the reference.
A host lost whole on a real network (its kernel gone too) is silence under both rules.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common, tests.helpers
from bench.common import RESULTS, in_turn, write_results  # noqa: E402
from tests.helpers import netns  # noqa: E402
from tests.helpers.spawn import TINY, Running, free_port, run_reference  # noqa: E402

STEPS, FAULT_STEP = 40, 8
ENV = {"ELASWAVE_TOKEN": "host-loss", "TORCH_CPP_LOG_LEVEL": "ERROR"}


def _sets(bind: str) -> list[str]:
    return [*TINY, "parallel.dp=2", "parallel.pp=2", f"train.steps={STEPS}", "train.num_micro_batches=4",
            "train.deterministic=true", "elastic.respawn_after_s=-1", "parallel.timeout_s=30",
            f"parallel.bind_address={bind}"]


def one(tmp: Path, code: str | None) -> dict:
    """One run; ``code``: a checkout to run instead of this one (run from it: ``python -m`` puts the
    working directory first on the path, and the workers inherit it)."""
    env = {**ENV, **({"PYTHONPATH": code} if code else {})}
    here = ["env", "-C", code] if code else []
    with netns.OtherHost() as host:
        endpoint = f"{host.here_store_ip}:{free_port()}"

        def agent(k: int, bind: str, prefix=()) -> Running:
            args = ["run", *[x for s in _sets(bind) for x in ("--set", s)], "--nnodes", "2", "--node-rank", str(k),
                    "--rdzv-endpoint", endpoint]
            return Running(args, tmp / f"m{k}.jsonl", env=env, prefix=[*prefix, *here])

        with agent(0, host.here_peer_ip) as a0, agent(1, host.peer_ip, host.prefix()) as a1:
            a0.wait_for(rf"step\s+{FAULT_STEP}/", 240)
            killed = time.time()
            os.killpg(a1.proc.pid, signal.SIGKILL)  # the agent and its workers: the host's processes, not its kernel
            res = a0.finish(240)
    steps = {r["step"]: r["wall_time"] for r in res.steps}
    recoveries = [r for r in res.records if r["event"] == "recovery"]
    out = {"code": res.returncode, "recoveries": len(recoveries)}
    if recoveries:
        rec = recoveries[0]
        first = rec["resume_step"]
        out.update(recorded_s=rec["mttr_s"], mttr_from=rec.get("mttr_from"), evidence=rec["evidence"],
                   measured_s=steps[first] - steps[first - 1], first_after_kill_s=steps[first] - killed)
    out["losses"], out["summary"] = res.losses, next((r for r in res.records if r["event"] == "summary"), None)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", required=True, help="a checkout of the code before the change")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default="host_loss")
    args = ap.parse_args(argv)
    why = netns.unavailable()
    if why or not (Path(args.baseline) / "elaswave").is_dir():
        raise SystemExit(f"bench/faults/host_loss.py: {why or f'--baseline={args.baseline!r} has no elaswave/'}")
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        ref = run_reference(Path(tmp), STEPS, deterministic=True)
    sides: dict[str, list[dict]] = {"this": [], "baseline": []}
    for i in range(args.runs):
        for side in in_turn(i, ["this", "baseline"]):
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    run = one(Path(tmp), args.baseline if side == "baseline" else None)
                except Exception as exc:  # noqa: BLE001 - a broken run is a finding
                    run = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
            if "summary" in run:
                run["same_run"] = bool(run["summary"]) and run["losses"] == ref.losses and \
                    run["summary"]["params_sha256"] == ref.summary["params_sha256"]
                del run["losses"], run["summary"]
            sides[side].append(run)
            print(i, side, run, flush=True)
    doc = {"meta": f"`python bench/faults/host_loss.py --baseline {args.baseline} --runs {args.runs}` on {date.today()}, "
                   f"{os.cpu_count()} CPUs, {time.perf_counter() - began:.0f} s", "runs": sides}
    write_results(RESULTS / args.out, doc, _page(doc))
    return 0


def _page(doc: dict) -> list[str]:
    def med(side: str, key: str) -> str:
        vals = [r[key] for r in doc["runs"][side] if key in r]
        return f"{statistics.median(vals):.2f} [{min(vals):.2f}-{max(vals):.2f}]" if vals else "-"
    lines = [doc["meta"], "", "| code | runs | recorded MTTR s | gap between step records s | kill to first step after s "
             "| bit-identical | evidence |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for side in ("baseline", "this"):
        runs = doc["runs"][side]
        evidence = sorted({how.split(" (")[0] for r in runs for how in r.get("evidence", {}).values()})
        lines.append(f"| {side} | {len(runs)} | {med(side, 'recorded_s')} | {med(side, 'measured_s')} | "
                     f"{med(side, 'first_after_kill_s')} | {sum(r.get('same_run', False) for r in runs)} of {len(runs)} | "
                     f"{'; '.join(evidence)} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
