"""elaswave against the peers a user runs today: each claim measured in one invocation, on the same
model, data and fault, with the real peers.

    python bench/peers.py mttr [--runs 5]       # time to recover: elaswave, torchrun restart, TorchFT
    python bench/peers.py deviation [--runs 5]  # loss after the failure against each one's failure-free run
    python bench/peers.py overhead [--runs 5]   # steady step time against each one's own plain run

The job: dp=3 (TorchFT: three replica groups of one process), pp=1, the default GPT with dropout
off (so TorchFT's own runs can be compared step by step), 12 micro-batches of 4 per step, 30
steps. The fault: rank (replica) 2 SIGKILLed in step 12's backward.

- elaswave: ``elaswave run`` (deterministic where the claim is about the loss).
- torchrun: the same worker under real ``torchrun --max-restarts=1`` with elasticity off and a disk
  checkpoint every 5 steps (``bench/elastic.py``'s restart run).
- TorchFT: ``bench/torchft_replica.py`` per replica, with a lighthouse started here, its default
  heartbeat timeout and one tuned to 1 s; ``--plain`` (torch's DDP under torchrun) is its
  no-fault-tolerance run. torchft is installed into the bench environment only
  (``pip install -e '.[bench]'``), not a dependency of elaswave.

MTTR runs from the kill to the end of the interrupted step done again (elaswave: the recovery
record's ``mttr_s``; torchrun and TorchFT: that step's record's wall time minus the kill's stamp).
Every figure is a median over ``--runs`` runs; ratios are of medians measured in the same
invocation. Results: ``bench/results/peers_CLAIM.{json,md}``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date, timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse runs in this process; its INFO lines are per quorum
from elastic import restart_run  # noqa: E402
from jobs import run_job  # noqa: E402

JOB = ["model.arch=gpt", "parallel.dp=3", "parallel.pp=1", "train.num_micro_batches=12", "train.steps=30", "model.dropout=0"]
REPLICAS, KILL_RANK, KILL_STEP = 3, 2, 12
KILL = f"elastic.inject=kill:rank={KILL_RANK},step={KILL_STEP},phase=backward"
TUNED_HEARTBEAT_MS = 1000


def _steps(records: list[dict]) -> list[dict]:
    return [r for r in records if r["event"] == "step"]


# --- TorchFT -----------------------------------------------------------------------------------

def torchft_run(kill: bool, heartbeat_ms: int | None = None, timeout_s: float = 300) -> dict:
    """Three replicas through a lighthouse on loopback; per step the global loss (the committed
    replicas' token losses over their tokens), replica 0's step time, and the kill's MTTR."""
    from torch.distributed import TCPStore
    from torchft._torchft import LighthouseServer

    tuned = {"heartbeat_timeout_ms": heartbeat_ms} if heartbeat_ms else {}
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=REPLICAS - 1, join_timeout_ms=60000,
                                  quorum_tick_ms=100, **tuned)
    meet = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "replica"
        procs = []
        for r in range(REPLICAS):
            cmd = [sys.executable, str(HERE / "torchft_replica.py"), "--replica", str(r), "--replicas", str(REPLICAS),
                   "--lighthouse", lighthouse.address(), "--ready", f"127.0.0.1:{meet.port}", "--out", str(prefix)]
            cmd += [x for s in JOB for x in ("--set", s)]
            if kill and r == KILL_RANK:
                cmd += ["--kill-at-step", str(KILL_STEP)]
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                                          stderr=open(Path(tmp) / f"err{r}", "w")))
        try:
            deadline = time.monotonic() + timeout_s
            while meet.add("ready", 0) < REPLICAS:  # release them together: one first quorum of all
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError("TorchFT replicas did not start:\n" + _errors(tmp))
                time.sleep(0.05)
            meet.set("go", "1")
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"TorchFT did not finish in {timeout_s}s:\n" + _errors(tmp)) from None
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait()
            lighthouse.shutdown()
        survivors = [r for r in range(REPLICAS) if not (kill and r == KILL_RANK)]
        if any(procs[r].returncode != 0 for r in survivors):
            raise RuntimeError("a TorchFT replica failed:\n" + _errors(tmp))
        records = {r: [json.loads(x) for x in Path(f"{prefix}.{r}.jsonl").read_text().splitlines()]
                   for r in range(REPLICAS) if Path(f"{prefix}.{r}.jsonl").exists()}
    by_step: dict[int, list[dict]] = {}
    for recs in records.values():
        for rec in _steps(recs):
            by_step.setdefault(rec["step"], []).append(rec)
    losses = [sum(r["loss_sum"] for r in by_step[s]) / sum(r["tokens"] for r in by_step[s]) for s in sorted(by_step)]
    out = {"losses": losses, "step_s": statistics.median(r["step_time_s"] for r in _steps(records[0])[5:]),
           "participants": [len(by_step[s]) for s in sorted(by_step)]}
    if kill:
        killed = next(r for r in records[KILL_RANK] if r["event"] == "kill")
        out["mttr_s"] = max(r["wall_time"] for r in by_step[KILL_STEP]) - killed["wall_time"]
    return out


def _errors(tmp: str) -> str:
    return "\n".join(p.read_text()[-2000:] for p in sorted(Path(tmp).glob("err*")))


def plain_ddp_step_s() -> float:
    """torch's DDP under torchrun, the same loop without fault tolerance: replica 0's median step."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={REPLICAS}",
               str(HERE / "torchft_replica.py"), "--plain", "--out", f"{tmp}/plain"] + [x for s in JOB for x in ("--set", s)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, start_new_session=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo"))
        if proc.returncode != 0:
            raise RuntimeError(f"plain DDP failed:\n{proc.stderr[-3000:]}")
        recs = [json.loads(x) for x in Path(f"{tmp}/plain.0.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in _steps(recs)[5:])


# --- the claims --------------------------------------------------------------------------------

def claim_mttr(runs: int) -> dict:
    out: dict[str, list[float]] = {"elaswave": [], "torchrun_restart": [], "torchft_default": [], "torchft_1s": []}
    for i in range(runs):
        out["elaswave"].append(next(r for r in run_job(JOB + [KILL]) if r["event"] == "recovery")["mttr_s"])
        out["torchrun_restart"].append(restart_run("backward", 5, JOB, REPLICAS)["mttr_s"])
        out["torchft_default"].append(torchft_run(kill=True)["mttr_s"])
        out["torchft_1s"].append(torchft_run(kill=True, heartbeat_ms=TUNED_HEARTBEAT_MS)["mttr_s"])
        print(f"  run {i}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in out.items()), flush=True)
    med = {k: statistics.median(v) for k, v in out.items()}
    return {"runs": out, "median_s": med, "over_elaswave": {k: med[k] / med["elaswave"] for k in med}}


def claim_deviation(runs: int) -> dict:
    """Max |loss - the same system's failure-free loss| over the steps from the kill on."""
    def dev(run, free):
        return max(abs(a - b) for a, b in zip(run[KILL_STEP:], free[KILL_STEP:]))

    ew_free = [r["loss"] for r in _steps(run_job(JOB, deterministic=True))]
    ft_free = torchft_run(kill=False)["losses"]
    ft_free_again = torchft_run(kill=False)["losses"]  # its own run-to-run noise floor
    out: dict[str, list[float]] = {"elaswave": [], "torchft": []}
    participants = []
    for i in range(runs):
        out["elaswave"].append(dev([r["loss"] for r in _steps(run_job(JOB + [KILL], deterministic=True))], ew_free))
        ft = torchft_run(kill=True, heartbeat_ms=TUNED_HEARTBEAT_MS)
        out["torchft"].append(dev(ft["losses"], ft_free))
        participants = ft["participants"]
        print(f"  run {i}: elaswave {out['elaswave'][-1]:.3g}, torchft {out['torchft'][-1]:.3g}", flush=True)
    return {"runs": out, "median_max_abs_dloss": {k: statistics.median(v) for k, v in out.items()},
            "torchft_failure_free_noise": dev(ft_free_again, ft_free), "torchft_participants_per_step": participants}


def claim_overhead(runs: int) -> dict:
    """Median over back-to-back pairs of (with fault tolerance) / (without) median step time."""
    pairs: dict[str, list[float]] = {"elaswave": [], "torchft": []}
    steps: dict[str, list[float]] = {"elaswave_on": [], "elaswave_off": [], "torchft": [], "plain_ddp": []}
    for i in range(runs):
        order = (True, False) if i % 2 == 0 else (False, True)
        med = {}
        for on in order:
            recs = run_job(JOB + [f"elastic.enabled={'true' if on else 'false'}"])
            med[on] = statistics.median(r["step_time_s"] for r in _steps(recs)[5:])
        steps["elaswave_on"].append(med[True])
        steps["elaswave_off"].append(med[False])
        pairs["elaswave"].append(med[True] / med[False])
        peer = {}
        for name in (("torchft", "plain_ddp") if i % 2 == 0 else ("plain_ddp", "torchft")):
            peer[name] = torchft_run(kill=False)["step_s"] if name == "torchft" else plain_ddp_step_s()
            steps[name].append(peer[name])
        pairs["torchft"].append(peer["torchft"] / peer["plain_ddp"])
        print(f"  pair {i}: elaswave on/off {pairs['elaswave'][-1]:.3f}, torchft/DDP {pairs['torchft'][-1]:.3f}",
              flush=True)
    return {"pair_ratios": pairs, "median_ratio": {k: statistics.median(v) for k, v in pairs.items()},
            "median_step_s": {k: statistics.median(v) for k, v in steps.items()}}


def _markdown(claim: str, res: dict) -> list[str]:
    if claim == "mttr":
        m, x = res["median_s"], res["over_elaswave"]
        return ["| system | median MTTR (s) | over elaswave | every run (s) |", "| --- | --- | --- | --- |"] + [
            f"| {NAMES[k]} | {m[k]:.3f} | {x[k]:.1f}x | {', '.join(f'{v:.2f}' for v in res['runs'][k])} |" for k in m]
    if claim == "deviation":
        d = res["median_max_abs_dloss"]
        return ["| system | median of max abs loss difference after the kill |", "| --- | --- |",
                f"| elaswave (deterministic) | {d['elaswave']:.3g} |", f"| TorchFT (1 s heartbeat) | {d['torchft']:.3g} |",
                "", f"TorchFT's own noise floor (two failure-free runs): {res['torchft_failure_free_noise']:.3g}; "
                    f"replicas per committed step in its last killed run: {res['torchft_participants_per_step']}."]
    r, s = res["median_ratio"], res["median_step_s"]
    context = s["elaswave_on"] / s["plain_ddp"]
    return ["| system | median step with / without fault tolerance | with (s) | without (s) |", "| --- | --- | --- | --- |",
            f"| elaswave (elastic on / off) | {r['elaswave']:.3f}x | {s['elaswave_on']:.4f} | {s['elaswave_off']:.4f} |",
            f"| TorchFT / plain DDP | {r['torchft']:.3f}x | {s['torchft']:.4f} | {s['plain_ddp']:.4f} |",
            "", "Ratios of back-to-back pairs (the box's speed drifts by more than the effect over minutes): "
            + "; ".join(f"{k} " + ", ".join(f"{v:.3f}" for v in vs) for k, vs in res["pair_ratios"].items())
            + f". For context, across systems: elaswave's median step over plain DDP's is {context:.3f}x "
              "(a ZeRO-1 step: a gradient all-reduce plus a parameter all-gather, against DDP's one all-reduce)."]


CLAIMS = {"mttr": claim_mttr, "deviation": claim_deviation, "overhead": claim_overhead}
NAMES = {"elaswave": "elaswave", "torchrun_restart": "torchrun restart from a checkpoint (every 5 steps)",
         "torchft_default": "TorchFT, default lighthouse heartbeat timeout",
         "torchft_1s": f"TorchFT, heartbeat timeout {TUNED_HEARTBEAT_MS / 1000:g} s"}
TITLES = {"mttr": "Time to recover from a SIGKILL (MTTR)",
          "deviation": "Loss after the failure, against the same system's failure-free run",
          "overhead": "Steady-state cost of fault tolerance when nothing fails"}


def write_benchmarks() -> Path:
    """BENCHMARKS.md at the repository's root, from every claim's latest results."""
    out = ["# Benchmarks: elaswave against its peers", "",
           "Written by `python bench/peers.py CLAIM` (or `elaswave bench CLAIM`) from `bench/results/peers_*.json`; "
           "every claim measured in one invocation, elaswave and the peers on the same model, data and fault, "
           "each figure a median over the runs. How each system is run, and what is timed: the docstring of "
           "`bench/peers.py`. TorchFT runs with a lighthouse of `min_replicas` 2, `join_timeout_ms` 60000 and "
           "`quorum_tick_ms` 100, each replica's `Manager` with 30 s operation and quorum timeouts and torchft's "
           "`ProcessGroupGloo` (30 s timeout); its manager and checkpoint servers are pointed at 127.0.0.1 and "
           "gloo at `lo`.", ""]
    for claim in CLAIMS:
        path = HERE / "results" / f"peers_{claim}.json"
        if not path.exists():
            continue
        res = json.loads(path.read_text())
        out += [f"## {TITLES[claim]}", "",
                f"`python bench/peers.py {claim} --runs {res['runs']}` on {res['date']}, {res['machine']}, "
                f"torch {res.get('torch', '?')}, torchft-nightly {res.get('torchft', '?')}, gloo on loopback, "
                f"{res['wall_s']:.0f} s. Job: {' '.join(res['job'])}; "
                + ("nothing fails." if claim == "overhead" else
                   f"rank/replica {res['kill']['rank']} SIGKILLed in step {res['kill']['step']}."), ""]
        out += _markdown(claim, res["result"]) + [""]
    target = HERE.parent / "BENCHMARKS.md"
    target.write_text("\n".join(out))
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("claim", choices=[*CLAIMS, "all", "page"], help="page: only rewrite BENCHMARKS.md from results")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error(f"--runs {args.runs} is invalid: at least 1 (medians want 5)")
    if args.claim == "page":
        print(f"written: {write_benchmarks()}")
        return 0
    if importlib.util.find_spec("torchft") is None:
        print("bench/peers.py needs TorchFT in this environment: pip install -e '.[bench]' "
              "(torchft-nightly; not a dependency of elaswave itself)", file=sys.stderr)
        return 2
    for claim in (CLAIMS if args.claim == "all" else [args.claim]):
        print(f"{claim} ({args.runs} runs) ...", flush=True)
        started = time.time()
        res = {"claim": claim, "job": JOB, "kill": {"rank": KILL_RANK, "step": KILL_STEP}, "runs": args.runs,
               "date": date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
               "result": CLAIMS[claim](args.runs)}
        res["wall_s"] = time.time() - started
        res["torch"], res["torchft"] = _version("torch"), _version("torchft-nightly")
        (HERE / "results" / f"peers_{claim}.json").write_text(json.dumps(res, indent=1))
        md = _markdown(claim, res["result"])
        (HERE / "results" / f"peers_{claim}.md").write_text("\n".join(md) + "\n")
        print("\n".join(md), flush=True)
    print(f"written: {write_benchmarks()}", flush=True)
    return 0


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    sys.exit(main())
