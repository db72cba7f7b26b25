"""MTTR on every detection path, and MTTR against the detection timeout for elaswave and TorchFT.

    python bench/elastic/detection.py [--runs 5] [--timeouts 0.5,1,2,4] [--interval 0.1] [--ticks 20,100,500]
                                      [--only silent_host [--backend c10d|etcd]]

A rank (replica) dies in the same job as ``bench/peers/peers.py`` (dp=3, GPT, dropout off, 12
micro-batches; rank 2 in step 12), and MTTR runs from the fault to the end of the first step done
on the new membership. The paths:

- **reported**: the worker's parent (``elaswave run``'s launcher) reaps it and tells the control
  plane at once (the default on one host).
- **unreported**: nobody tells (``elastic.launcher_reports_deaths=false``), as when a host is lost
  with its agent: a collective error alerts the survivors, and the dead rank is shown dead by its
  refused liveness port.
- **host lost (torchrun)**: two real torchrun agents on loopback, two workers each (dp=2 x pp=2);
  the host without the rendezvous store is SIGKILLed whole, agent and workers, after step 8.
  MTTR from the kill's wall time (taken here) to the end of the first step of the new epoch.
- **hang**: SIGSTOP instead of SIGKILL: the process lives, its port answers, and only its stale
  heartbeat shows it (``elastic.heartbeat_timeout_s``).
- **silent host**: a dead host that refuses nothing (power, kernel panic, NIC, cable). Two
  ``elaswave run`` agents (dp=2 x pp=2, two workers each); host 1 is a network namespace whose
  links go down after step 8 (``tests/helpers/netns.py``): every packet to it is dropped, its
  processes live on. Host 0 holds the store and, with half the members, goes on; host 1 stops by
  itself. MTTR from the cut (taken here) to the end of host 0's first step of the new epoch, at
  each heartbeat timeout; the recovery record's own ``mttr_s`` (from the last heartbeat seen:
  ``mttr_from``) beside it. Goal (issue 35): within the heartbeat timeout + 0.5 s. Needs root
  (network namespaces); ``--only silent_host`` runs this path alone and updates the stored results;
  ``--backend etcd`` runs it on a 3-member etcd cluster on host 0 (host 1's ranks are then shown
  dead by their leases' expiry, :mod:`elaswave.control.leases`; etcd grants at least 2 s).
- **TorchFT**: the real peer (``bench/peers/torchft_job.py``'s replicas, torchft-nightly), SIGKILL: the
  lighthouse's heartbeat timeout, then a quorum at its next tick.

The sweep sets elaswave's ``elastic.heartbeat_timeout_s`` and TorchFT's lighthouse
``heartbeat_timeout_ms`` to each timeout (elaswave's heartbeat interval fixed at ``--interval``;
TorchFT's quorum tick at 100 ms), then TorchFT's quorum tick at a 1 s heartbeat. Every point is the
median (and range) of ``--runs`` runs. Results: ``bench/results/detection.{json,md,png}``.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common, tests.helpers
from bench.common import RESULTS, run_job, write_results  # noqa: E402
from bench.peers.torchft_job import JOB, KILL_RANK, KILL_STEP, torchft_run  # noqa: E402
from elaswave.runtime.metrics import read_jsonl  # noqa: E402
from tests.helpers import netns  # noqa: E402
from tests.helpers.etcd import EtcdCluster  # noqa: E402
from tests.helpers.spawn import TINY, Running, TorchrunNode, free_port  # noqa: E402

STEPS = 16
ELASWAVE_JOB = [s for s in JOB if not s.startswith("train.steps=")] + [f"train.steps={STEPS}"]


def _fault(kind: str) -> str:
    return f"elastic.inject={kind}:rank={KILL_RANK},step={KILL_STEP},phase=backward"


def elaswave_mttr(kind: str, reported: bool, timeout_s: float, interval_s: float) -> dict:
    sets = [*ELASWAVE_JOB, _fault(kind), f"elastic.heartbeat_timeout_s={timeout_s}",
            f"elastic.heartbeat_interval_s={interval_s}", f"elastic.launcher_reports_deaths={str(reported).lower()}"]
    records = run_job(sets, deterministic=True)
    (rec,) = [r for r in records if r["event"] == "recovery"]
    return {"mttr_s": rec["mttr_s"], "phases_s": rec["phases_s"], "evidence": rec["evidence"]}


def torchrun_host_mttr(timeout_s: float = 240) -> dict:
    """Two torchrun agents; the second host killed whole after step 8. MTTR from the kill."""
    sets = ["model.arch=gpt", "model.dropout=0", "parallel.dp=2", "parallel.pp=2", "train.steps=20",
            "train.num_micro_batches=8", "train.deterministic=true"]
    endpoint = f"127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "run.jsonl"

        def records():
            return read_jsonl(str(metrics)) if metrics.exists() else []

        with TorchrunNode(2, 2, endpoint, True, sets, metrics, Path(tmp) / "host0.log"), \
                TorchrunNode(2, 2, endpoint, False, sets, metrics, Path(tmp) / "host1.log") as lost:
            deadline = time.monotonic() + timeout_s
            while sum(r["event"] == "step" for r in records()) <= 8:
                if time.monotonic() > deadline:
                    raise RuntimeError("the torchrun job did not reach step 8")
                time.sleep(0.05)
            killed_at = time.time()
            lost.kill()
            while not any(r["event"] == "recovery" for r in records()) or not any(
                    r["event"] == "step" and r["epoch"] > 0 for r in records()):
                if time.monotonic() > deadline:
                    raise RuntimeError("the surviving host did not recover")
                time.sleep(0.05)
            done = records()
    rec = next(r for r in done if r["event"] == "recovery")
    first = min((r for r in done if r["event"] == "step" and r["epoch"] == rec["epoch"]), key=lambda r: r["step"])
    return {"mttr_s": first["wall_time"] - killed_at, "phases_s": rec["phases_s"], "evidence": rec["evidence"]}


def silent_host_mttr(timeout_s: float, interval_s: float, limit_s: float = 240, backend: str = "c10d") -> dict:
    """Two agents; host 1 (a namespace) goes silent after step 8. MTTR from the cut. ``backend``
    etcd: the control plane on a 3-member etcd cluster on host 0 (host 1's ranks' leases expire)."""
    sets = [*TINY, "parallel.dp=2", "parallel.pp=2", "train.steps=60", "train.num_micro_batches=4",
            "train.deterministic=true", "elastic.respawn_after_s=-1", "parallel.timeout_s=30",
            f"elastic.heartbeat_timeout_s={timeout_s}", f"elastic.heartbeat_interval_s={interval_s}"]
    env = {"ELASWAVE_TOKEN": "detection-bench", "TORCH_CPP_LOG_LEVEL": "ERROR"}

    def agent(node_rank: int, bind: str, rdzv: list[str], metrics: Path, prefix=()) -> Running:
        args = ["run", *[x for s in [*sets, f"parallel.bind_address={bind}"] for x in ("--set", s)],
                "--nnodes", "2", "--node-rank", str(node_rank), *rdzv]
        return Running(args, metrics, env=env, prefix=list(prefix))

    with tempfile.TemporaryDirectory() as tmp, netns.OtherHost() as host, \
            (EtcdCluster(3, hosts=[host.here_store_ip] * 3) if backend == "etcd" else contextlib.nullcontext()) as etcd:
        rdzv = (["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints] if etcd is not None else
                ["--rdzv-endpoint", f"{host.here_store_ip}:{free_port()}"])
        with agent(0, host.here_peer_ip, rdzv, Path(tmp) / "m0.jsonl") as host0, \
                agent(1, host.peer_ip, rdzv, Path(tmp) / "m1.jsonl", host.prefix()) as host1:
            host0.wait_for(r"step\s+8/", limit_s)
            host.silence()
            cut_at = time.time()
            res = host0.finish(limit_s)
            host1.finish(limit_s)
    if res.returncode != 0:
        raise RuntimeError(f"host 0 did not finish: {res.stderr[-2000:]}")
    rec = next(r for r in res.records if r["event"] == "recovery")
    first = min((r for r in res.records if r["event"] == "step" and r["epoch"] == rec["epoch"]), key=lambda r: r["step"])
    return {"mttr_s": first["wall_time"] - cut_at, "recorded_mttr_s": rec["mttr_s"], "mttr_from": rec["mttr_from"],
            "phases_s": rec["phases_s"], "evidence": rec["evidence"], "lost_ranks": rec["lost_ranks"]}


def silent_host_sweep(runs: int, timeouts: list[float], interval_s: float, backend: str = "c10d") -> dict:
    """The silent host at each heartbeat timeout; empty, with the reason, where namespaces are unavailable."""
    reason = netns.unavailable()
    if reason:
        print(f"  silent host: skipped ({reason})", flush=True)
        return {"skipped": reason}
    return {f"{t:g}": _repeat(runs, f"silent host ({backend}), timeout {t:g} s",
                              lambda: silent_host_mttr(t, interval_s, backend=backend))
            for t in timeouts}


def _summary(values: list[float]) -> dict:
    return {"median_s": statistics.median(values), "min_s": min(values), "max_s": max(values), "runs_s": values}


def _repeat(runs: int, what: str, fn) -> dict:
    values, details = [], []
    for i in range(runs):
        out = fn()
        values.append(out["mttr_s"])
        details.append(out)
        print(f"  {what} run {i}: MTTR {out['mttr_s']:.3f} s", flush=True)
    return {**_summary(values), "last": details[-1], "details": details}


def measure(runs: int, timeouts: list[float], interval_s: float, ticks: list[int]) -> dict:
    default = 2.0
    paths = {
        "reported": _repeat(runs, "reported", lambda: elaswave_mttr("kill", True, default, interval_s)),
        "unreported": _repeat(runs, "unreported", lambda: elaswave_mttr("kill", False, default, interval_s)),
        "host_lost_torchrun": _repeat(runs, "host lost (torchrun)", torchrun_host_mttr),
        "hang": _repeat(runs, "hang", lambda: elaswave_mttr("stop", True, default, interval_s)),
        "torchft_1s": _repeat(runs, "TorchFT 1 s", lambda: torchft_run(kill=True, heartbeat_ms=1000)),
    }
    sweep: dict[str, dict[str, dict]] = {"elaswave_kill_unreported": {}, "elaswave_hang": {}, "torchft_kill": {}}
    for t in timeouts:
        key = f"{t:g}"
        sweep["elaswave_kill_unreported"][key] = _repeat(
            runs, f"unreported kill, timeout {t:g} s", lambda: elaswave_mttr("kill", False, t, interval_s))
        sweep["elaswave_hang"][key] = _repeat(runs, f"hang, timeout {t:g} s",
                                              lambda: elaswave_mttr("stop", True, t, interval_s))
        sweep["torchft_kill"][key] = _repeat(runs, f"TorchFT, heartbeat {t:g} s",
                                             lambda: torchft_run(kill=True, heartbeat_ms=int(t * 1000)))
    tick_sweep = {str(q): _repeat(runs, f"TorchFT, 1 s heartbeat, tick {q} ms",
                                  lambda: torchft_run(kill=True, heartbeat_ms=1000, quorum_tick_ms=q)) for q in ticks}
    return {"paths": paths, "timeout_sweep": sweep, "quorum_tick_sweep_1s": tick_sweep,
            "silent_host": silent_host_sweep(runs, timeouts, interval_s),
            "heartbeat_interval_s": interval_s, "default_heartbeat_timeout_s": default}


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = {"elaswave_kill_unreported": "elaswave, SIGKILL nobody reports",
             "elaswave_hang": "elaswave, SIGSTOP (heartbeat)", "torchft_kill": "TorchFT, SIGKILL (lighthouse heartbeat)"}
    for key, label in names.items():
        pts = sorted((float(t), v) for t, v in res["timeout_sweep"][key].items())
        xs = [t for t, _ in pts]
        med = [v["median_s"] for _, v in pts]
        lo = [v["median_s"] - v["min_s"] for _, v in pts]
        hi = [v["max_s"] - v["median_s"] for _, v in pts]
        ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=label)
    ax.set_yscale("log")  # TorchFT's 30 s outliers (a kill mid-allreduce waits out its gloo timeout)
    ax.set_xlabel("detection timeout (s): elaswave heartbeat timeout / TorchFT lighthouse heartbeat timeout")
    ax.set_ylabel("MTTR (s), median and range")
    ax.set_title("MTTR against the detection timeout (dp=3, one rank lost)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(res: dict, meta: str) -> list[str]:
    p = res["paths"]
    rows = [("a worker's death, reported by its launcher", "reported"),
            ("a worker's death nobody reports (collective error + refused probe)", "unreported"),
            ("a whole host lost under torchrun (agent and workers SIGKILLed)", "host_lost_torchrun"),
            (f"a hang (SIGSTOP), heartbeat timeout {res['default_heartbeat_timeout_s']:g} s", "hang"),
            ("TorchFT, SIGKILL, lighthouse heartbeat 1 s", "torchft_1s")]
    md = [meta, "", "**MTTR per detection path** (median, range):", "", "| path | MTTR s | range s | evidence (last run) |",
          "| --- | --- | --- | --- |"]
    for label, key in rows:
        v = p[key]
        ev = "; ".join(f"rank {r}: {how}" for r, how in v["last"].get("evidence", {}).items()) or "-"
        md.append(f"| {label} | {v['median_s']:.3f} | {v['min_s']:.3f}-{v['max_s']:.3f} | {ev} |")
    md += ["", "**MTTR against the detection timeout** (`detection.png`; median, range):", "",
           "| timeout s | elaswave SIGKILL, unreported | elaswave SIGSTOP | TorchFT SIGKILL |", "| --- | --- | --- | --- |"]
    sweep = res["timeout_sweep"]
    for t in sweep["torchft_kill"]:
        cells = [f"{sweep[k][t]['median_s']:.3f} ({sweep[k][t]['min_s']:.2f}-{sweep[k][t]['max_s']:.2f})"
                 for k in ("elaswave_kill_unreported", "elaswave_hang", "torchft_kill")]
        md.append(f"| {t} | " + " | ".join(cells) + " |")
    md += ["", "**TorchFT's quorum tick** at a 1 s heartbeat:", "", "| quorum tick ms | MTTR s | range s |", "| --- | --- | --- |"]
    md += [f"| {q} | {v['median_s']:.3f} | {v['min_s']:.3f}-{v['max_s']:.3f} |" for q, v in res["quorum_tick_sweep_1s"].items()]
    return (md + silent_markdown(res.get("silent_host", {}), res.get("silent_host_meta"))
            + silent_markdown(res.get("silent_host_etcd", {}), res.get("silent_host_etcd_meta"), "on etcd"))


def silent_markdown(silent: dict, meta: str | None, where: str = "") -> list[str]:
    title = f"**A silent host{' ' + where if where else ''}**"
    if not silent or "skipped" in silent:
        return ["", f"{title}: not measured ({silent.get('skipped', 'not run')})."]
    md = ["", f"{title} (both links of host 1 down after step 8: nothing refused; dp=2 x pp=2 over two "
          "agents; MTTR from the cut to host 0's first step of the new epoch; median, range):"]
    md += ["", meta] if meta else []
    md += ["", "| heartbeat timeout s | MTTR s | range s | over timeout + 0.5 s | record's mttr_s (from) | "
           "detect / agree s (last run) |", "| --- | --- | --- | --- | --- | --- |"]
    for t, v in silent.items():
        last = v["last"]
        over = sum(m > float(t) + 0.5 for m in v["runs_s"])
        md.append(f"| {t} | {v['median_s']:.3f} | {v['min_s']:.3f}-{v['max_s']:.3f} | {over} of {len(v['runs_s'])} | "
                  f"{last['recorded_mttr_s']:.3f} ({last['mttr_from']}) | "
                  f"{last['phases_s'].get('detect', 0):.3f} / {last['phases_s'].get('agree', 0):.3f} |")
    return md


def _floats(text: str, what: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x]
    except ValueError:
        raise SystemExit(f"bench/elastic/detection.py: {what}={text!r} is not a comma-separated list of numbers") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--timeouts", default="0.5,1,2,4")
    ap.add_argument("--interval", type=float, default=0.1)
    ap.add_argument("--ticks", default="20,100,500")
    ap.add_argument("--only", choices=["silent_host"], help="measure this path alone; update the stored results")
    ap.add_argument("--backend", choices=["c10d", "etcd"], default="c10d",
                    help="the control store of --only silent_host: the embedded TCPStore, or 3 etcd members on host 0")
    args = ap.parse_args(argv)
    timeouts, ticks = _floats(args.timeouts, "--timeouts"), [int(q) for q in _floats(args.ticks, "--ticks")]
    if args.runs < 1 or args.interval <= 0:
        raise SystemExit(f"bench/elastic/detection.py: --runs={args.runs} must be >= 1 and --interval={args.interval} > 0")
    too_short = [t for t in timeouts if t < 2 * args.interval]
    if too_short:  # a heartbeat must be able to go stale between beats
        raise SystemExit(f"bench/elastic/detection.py: --timeouts {too_short} are below 2 x --interval={args.interval}: "
                         "every timeout must be at least two heartbeat intervals")
    if any(q <= 0 for q in ticks):
        raise SystemExit(f"bench/elastic/detection.py: --ticks={args.ticks} must be positive milliseconds")
    began = time.perf_counter()
    if args.only == "silent_host":
        return _only_silent_host(args, timeouts, began)
    res = measure(args.runs, timeouts, args.interval, ticks)
    wall = time.perf_counter() - began
    import torch
    meta = (f"`python bench/elastic/detection.py --runs {args.runs} --timeouts {args.timeouts} --interval {args.interval} "
            f"--ticks {args.ticks}` on {date.today()}, {platform.machine()}, {os.cpu_count()} CPUs, torch "
            f"{torch.__version__}, gloo on loopback, {wall:.0f} s. Job as bench/peers/peers.py (dp=3 GPT, rank 2 lost in "
            f"step {KILL_STEP}'s backward), {STEPS} steps; elaswave heartbeat interval {args.interval:g} s.")
    res["meta"] = meta
    write_results(RESULTS / "detection", res, markdown(res, meta))
    plot(res, RESULTS / "detection.png")
    return 0


def _only_silent_host(args, timeouts: list[float], began: float) -> int:
    import json

    import torch
    path = RESULTS / "detection.json"
    res = json.loads(path.read_text()) if path.exists() else {}
    key = "silent_host" if args.backend == "c10d" else "silent_host_etcd"
    res[key] = silent_host_sweep(args.runs, timeouts, args.interval, args.backend)
    res[f"{key}_meta"] = (
        f"`python bench/elastic/detection.py --only silent_host --backend {args.backend} --runs {args.runs} "
        f"--timeouts {args.timeouts} --interval {args.interval}` on {date.today()}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, {time.perf_counter() - began:.0f} s.")
    lines = markdown(res, res["meta"]) if "paths" in res else (
        silent_markdown(res.get("silent_host", {}), res.get("silent_host_meta"))
        + silent_markdown(res.get("silent_host_etcd", {}), res.get("silent_host_etcd_meta"), "on etcd"))
    write_results(RESULTS / "detection", res, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
