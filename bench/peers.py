"""elaswave against the peers a user runs today: each claim measured in one invocation, on the same
model, data and fault, with the real peers.

    python bench/peers.py mttr [--runs 5]       # time to recover: elaswave, torchrun restart, TorchFT
    python bench/peers.py deviation [--runs 5]  # held-out loss after the failure against each one's failure-free run
    python bench/peers.py overhead [--runs 5]   # steady step time against each one's own plain run

The job: dp=3 (TorchFT: three replica groups of one process), pp=1, the default GPT with dropout
off (so TorchFT's own runs can be compared step by step), 12 micro-batches of 4 per step, 30
steps. The fault: rank (replica) 2 SIGKILLed in step 12's backward.

- elaswave: ``elaswave run`` (fast mode: not ``--deterministic``).
- torchrun: the same worker under real ``torchrun --max-restarts=1`` with elasticity off and a disk
  checkpoint every 5 steps (``bench/elastic.py``'s restart run).
- TorchFT: ``bench/torchft_replica.py`` per replica, with a lighthouse started here, its default
  heartbeat timeout and one tuned to 1 s; ``--plain`` (torch's DDP under torchrun) is its
  no-fault-tolerance run. Its replicas start from the same seeded model (``init_sync=False``) and
  decay only matrices, as elaswave's optimizer does, so a failure-free TorchFT run trains what a
  failure-free elaswave run trains. torchft is installed into the bench environment only
  (``pip install -e '.[bench]'``), not a dependency of elaswave.

MTTR runs from the kill to the end of the interrupted step done again (elaswave: the recovery
record's ``mttr_s``; torchrun and TorchFT: that step's record's wall time minus the kill's stamp).

Deviation scores parameters, not a training loss: every system trains on the same prepared corpus
(``bench/heldout.py``: standard-library folders, ``elaswave prepare --tokenizer bytes
--eval-fraction 0.1``), and after every step its parameters are scored on the same fixed held-out
windows (``train.eval_batches=HELDOUT_BATCHES`` full batches of the eval split, every window of
each, none ever trained on): the mean token cross-entropy as elaswave's evaluation computes it.
elaswave's parameters come from a disk checkpoint written after every step (the same scorer, in
this process; elaswave's own evaluation runs too and is checked against it where it scores every
window: under ``drop_replica`` it scores only the live replicas' micro-batches after the kill);
TorchFT's replica 0 scores its own after every committed step. Three systems: elaswave's fast mode
(not ``--deterministic``; the dead rank's micro-batches re-sharded, the global batch kept),
elaswave with ``elastic.policy=drop_replica`` (the dead replica's micro-batches skipped, as TorchFT
does) and TorchFT with the 1 s heartbeat. Each killed run is compared with its own system's
failure-free run: max and mean |held-out loss - failure-free held-out loss| over the states after
``KILL_STEP`` .. ``train.steps`` steps (the state the killed step started from, which a recovery
that rolls back a step also changes, and every state after it); a second failure-free run against
the first is each system's noise floor. The training loss's difference (each run's mean over the
micro-batches it trained on: 8 of 12 after the kill for drop-replica and TorchFT, so it differs
even at equal parameters) is kept as a secondary column, labelled as such.
Every figure is a median over ``--runs`` runs; ratios are of medians measured in the same
invocation. Results: ``bench/results/peers_CLAIM.{json,md}``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
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
from heldout import Scorer, prepare_corpus  # noqa: E402
from jobs import run_job  # noqa: E402

JOB = ["model.arch=gpt", "parallel.dp=3", "parallel.pp=1", "train.num_micro_batches=12", "train.steps=30", "model.dropout=0"]
REPLICAS, KILL_RANK, KILL_STEP = 3, 2, 12
KILL = f"elastic.inject=kill:rank={KILL_RANK},step={KILL_STEP},phase=backward"
TUNED_HEARTBEAT_MS = 1000
HELDOUT_BATCHES = 4  # held-out batches of 12 x 4 windows: 192 windows, 12,288 scored tokens


def _steps(records: list[dict]) -> list[dict]:
    return [r for r in records if r["event"] == "step"]


# --- TorchFT -----------------------------------------------------------------------------------

def torchft_run(kill: bool, heartbeat_ms: int | None = None, timeout_s: float = 300, sets: list[str] = (),
                heldout: bool = False, quorum_tick_ms: int = 100) -> dict:
    """Three replicas through a lighthouse on loopback; per step the global loss (the committed
    replicas' token losses over their tokens), replica 0's step time, and the kill's MTTR; with
    ``heldout``, replica 0's held-out loss after each committed step (``heldout[s - 1]``: after ``s``
    steps). ``sets``: items added to ``JOB``."""
    from torch.distributed import TCPStore
    from torchft._torchft import LighthouseServer

    tuned = {"heartbeat_timeout_ms": heartbeat_ms} if heartbeat_ms else {}
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=REPLICAS - 1, join_timeout_ms=60000,
                                  quorum_tick_ms=quorum_tick_ms, **tuned)
    meet = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "replica"
        procs = []
        for r in range(REPLICAS):
            cmd = [sys.executable, str(HERE / "torchft_replica.py"), "--replica", str(r), "--replicas", str(REPLICAS),
                   "--lighthouse", lighthouse.address(), "--ready", f"127.0.0.1:{meet.port}", "--out", str(prefix)]
            cmd += [x for s in [*JOB, *sets] for x in ("--set", s)] + (["--heldout"] if heldout else [])
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
    if heldout:
        out["heldout"] = [r["heldout_loss"] for r in _steps(records[0])]
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


def elaswave_heldout_run(sets: list[str], scorer: Scorer) -> dict:
    """``elaswave run`` (fast mode) with a disk checkpoint after every step and its own evaluation
    after every step; each checkpoint scored by ``scorer`` (``heldout[s - 1]``: after ``s`` steps)."""
    from elaswave.checkpoint.disk import step_dir

    steps = scorer.cfg.train.steps
    with tempfile.TemporaryDirectory() as tmp:
        records = run_job(sets + [f"checkpoint.dir={tmp}/ckpt", "checkpoint.every_steps=1",
                                  f"checkpoint.keep={steps + 1}", "train.eval_every=1",
                                  f"train.eval_batches={scorer.cfg.train.eval_batches}"])
        heldout = [scorer.checkpoint(step_dir(f"{tmp}/ckpt", s)) for s in range(1, steps + 1)]
    evals = {r["step"]: r for r in records if r["event"] == "eval"}
    recovery = next((r for r in records if r["event"] == "recovery"), None)
    return {"heldout": heldout, "losses": [r["loss"] for r in _steps(records)],
            "builtin_eval": [evals[s]["eval_loss"] for s in range(1, steps + 1)],
            "builtin_eval_tokens": [evals[s]["eval_tokens"] for s in range(1, steps + 1)],
            "resume_step": recovery["resume_step"] if recovery else None}


DEVIATION_SYSTEMS = {"elaswave": "elaswave, fast mode (global batch kept)",
                     "drop_replica": "elaswave, elastic.policy=drop_replica (TorchFT's policy)",
                     "torchft": f"TorchFT, heartbeat timeout {TUNED_HEARTBEAT_MS / 1000:g} s"}


def _abs_dev(run: list[float], free: list[float], first: int) -> dict:
    """Max and mean |run - free| over entries ``first..`` (0-based)."""
    d = [abs(a - b) for a, b in zip(run[first:], free[first:], strict=True)]
    return {"max": max(d), "mean": statistics.fmean(d)}


def claim_deviation(runs: int) -> dict:
    """Each system's held-out loss after the kill against its own failure-free run (see the docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        corpus = prepare_corpus(Path(tmp) / "corpus")
        data = [f"data.path={corpus}"]
        scorer = Scorer(_config(JOB + data + [f"train.eval_batches={HELDOUT_BATCHES}"]))
        ft_sets = data + [f"train.eval_batches={HELDOUT_BATCHES}"]
        run_system = {
            "elaswave": lambda kill: elaswave_heldout_run(JOB + data + ([KILL] if kill else []), scorer),
            "drop_replica": lambda kill: elaswave_heldout_run(
                JOB + data + ["elastic.policy=drop_replica"] + ([KILL] if kill else []), scorer),
            "torchft": lambda kill: torchft_run(kill=kill, heartbeat_ms=TUNED_HEARTBEAT_MS, sets=ft_sets,
                                                heldout=True)}
        failures: list[dict] = []

        def attempt(system: str, kill: bool, label: str, tries: int = 3) -> dict:
            for k in range(tries):
                try:
                    res = run_system[system](kill)
                    if not all(math.isfinite(x) for x in res["heldout"] + res["losses"]):
                        raise RuntimeError("a loss is not finite: held-out "
                                           f"{res['heldout'][KILL_STEP - 1:KILL_STEP + 2]}..., training "
                                           f"{res['losses'][KILL_STEP - 1:KILL_STEP + 2]}..., "
                                           f"resume_step {res.get('resume_step')}")
                    return res
                except RuntimeError as exc:
                    failures.append({"system": system, "run": label, "attempt": k, "error": str(exc)[-1500:]})
                    print(f"  {system} {label} attempt {k} FAILED: {str(exc)[-300:]}", flush=True)
            raise RuntimeError(f"{system} {label}: failed {tries} times")

        free, noise = {}, {}
        for system in run_system:
            free[system] = attempt(system, False, "failure-free")
            again = attempt(system, False, "failure-free again")
            noise[system] = {"heldout": _abs_dev(again["heldout"], free[system]["heldout"], KILL_STEP - 1),
                             "train_loss": _abs_dev(again["losses"], free[system]["losses"], KILL_STEP)}
            print(f"  {system} noise floor: held-out max {noise[system]['heldout']['max']:.3g}", flush=True)
        out: dict[str, list[dict]] = {k: [] for k in run_system}
        last: dict[str, dict] = {}
        for i in range(runs):
            for system in run_system:
                res = last[system] = attempt(system, True, f"run {i}")
                out[system].append({"heldout": _abs_dev(res["heldout"], free[system]["heldout"], KILL_STEP - 1),
                                    "train_loss": _abs_dev(res["losses"], free[system]["losses"], KILL_STEP),
                                    "resume_step": res.get("resume_step")})
            print(f"  run {i}: " + ", ".join(f"{k} {v[-1]['heldout']['max']:.3g}/{v[-1]['heldout']['mean']:.3g}"
                                            for k, v in out.items()) + " (held-out max/mean)", flush=True)
        elaswave_runs = [free["elaswave"], last["elaswave"], free["drop_replica"], last["drop_replica"]]
        full = scorer.tokens
        manifest = json.loads((corpus / "manifest.json").read_text())
    median = {k: {f"{m}_{stat}": statistics.median(r[m][stat] for r in v) for m in ("heldout", "train_loss")
                  for stat in ("max", "mean")} for k, v in out.items()}
    return {
        "metric": (f"|held-out loss - the same system's failure-free held-out loss| over the states after "
                   f"{KILL_STEP}..{scorer.cfg.train.steps} steps; held-out: {HELDOUT_BATCHES} batches x "
                   f"{scorer.cfg.train.num_micro_batches} micro-batches x {scorer.cfg.train.micro_batch_size} windows of the eval split "
                   f"({scorer.tokens} scored tokens), every window of each batch"),
        "heldout_tokens": scorer.tokens,
        "corpus": {"stdlib_folders": manifest["inputs"], "eval_fraction": manifest["eval_fraction"],
                   "train_tokens": manifest["splits"]["train"]["tokens"],
                   "eval_tokens": manifest["splits"]["eval"]["tokens"]},
        "runs": out, "median": median, "noise_floor": noise, "failures": failures,
        "sanity": {
            "elaswave_vs_torchft_failure_free_heldout_max_abs": max(
                abs(a - b) for a, b in zip(free["elaswave"]["heldout"], free["torchft"]["heldout"], strict=True)),
            "failure_free_heldout": {k: free[k]["heldout"] for k in free},
            "builtin_eval_vs_scorer_max_abs": max(
                abs(a - b) for r in elaswave_runs for a, b, n in
                zip(r["builtin_eval"], r["heldout"], r["builtin_eval_tokens"], strict=True) if n == full),
            "drop_replica_builtin_eval_tokens": last["drop_replica"]["builtin_eval_tokens"]},
        "torchft_participants_per_step": last["torchft"]["participants"]}


def _config(sets: list[str]):
    from elaswave import config

    return config.load(None, sets)


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
        return _deviation_markdown(res)
    r, s = res["median_ratio"], res["median_step_s"]
    context = s["elaswave_on"] / s["plain_ddp"]
    return ["| system | median step with / without fault tolerance | with (s) | without (s) |", "| --- | --- | --- | --- |",
            f"| elaswave (elastic on / off) | {r['elaswave']:.3f}x | {s['elaswave_on']:.4f} | {s['elaswave_off']:.4f} |",
            f"| TorchFT / plain DDP | {r['torchft']:.3f}x | {s['torchft']:.4f} | {s['plain_ddp']:.4f} |",
            "", "Ratios of back-to-back pairs (the box's speed drifts by more than the effect over minutes): "
            + "; ".join(f"{k} " + ", ".join(f"{v:.3f}" for v in vs) for k, vs in res["pair_ratios"].items())
            + f". For context, across systems: elaswave's median step over plain DDP's is {context:.3f}x "
              "(a ZeRO-1 step: a gradient all-reduce plus a parameter all-gather, against DDP's one all-reduce)."]


def _g(x: float) -> str:
    return f"{x:.3g}"


def _deviation_markdown(res: dict) -> list[str]:
    med, noise, sanity = res["median"], res["noise_floor"], res["sanity"]
    n = len(next(iter(res["runs"].values())))
    lines = [f"| system | max abs delta held-out loss (median of {n}) | mean abs delta held-out loss (median) | "
             "noise floor, max / mean (two failure-free runs) | secondary: max abs delta of the training loss, "
             "a mean over the micro-batches each run trained on (median) |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {DEVIATION_SYSTEMS[k]} | {_g(m['heldout_max'])} | {_g(m['heldout_mean'])} | "
              f"{_g(noise[k]['heldout']['max'])} / {_g(noise[k]['heldout']['mean'])} | {_g(m['train_loss_max'])} |"
              for k, m in med.items()]
    lines += ["", f"Metric: {res['metric']}. Each killed run against its own system's failure-free run, the same "
              "scorer for every system (`bench/heldout.py`); elaswave runs in fast mode (not `--deterministic`).",
              "", "Every run, held-out max / mean: " + "; ".join(
                  f"{k} " + ", ".join(f"{_g(r['heldout']['max'])} / {_g(r['heldout']['mean'])}" for r in v)
                  for k, v in res["runs"].items()) + ". Recoveries resumed at step: " + "; ".join(
                  f"{k} {[r['resume_step'] for r in res['runs'][k]]}" for k in ("elaswave", "drop_replica")) + ".",
              "", f"Checks: elaswave's own evaluation against this scorer on the same checkpoints, where it scores "
              f"every window: max abs difference {_g(sanity['builtin_eval_vs_scorer_max_abs'])}; elaswave's and "
              f"TorchFT's failure-free held-out losses (two implementations of the same training) differ by at most "
              f"{_g(sanity['elaswave_vs_torchft_failure_free_heldout_max_abs'])} over the "
              f"{len(sanity['failure_free_heldout']['elaswave'])} steps "
              f"(after the last: elaswave {sanity['failure_free_heldout']['elaswave'][-1]:.4f}, TorchFT "
              f"{sanity['failure_free_heldout']['torchft'][-1]:.4f}). Under drop_replica elaswave's own evaluation "
              f"scores only the live replicas' micro-batches after the kill (held-out tokens per step in the last "
              f"killed run: {sorted(set(sanity['drop_replica_builtin_eval_tokens']))}), which is why the held-out "
              f"loss here comes from checkpoints. TorchFT replicas per committed step in its last killed run: "
              f"{res['torchft_participants_per_step']}."]
    if res["failures"]:
        lines += ["", f"Failed attempts (retried; not in the medians): {len(res['failures'])}: " + "; ".join(
            f"{f['system']} {f['run']}: {f['error'].strip().splitlines()[-1][:200]}" for f in res["failures"]) + "."]
    lines += ["", "This supersedes the figure published on 2026-11-22 (\"elaswave 0 vs TorchFT 0.123\", issue 20): "
              "it compared training losses, each a mean over the micro-batches the run trained on (8 of 12 after "
              "the kill for TorchFT, against 12 failure-free), which differ by up to 0.112 at identical "
              "parameters; and its TorchFT replicas synchronised their weights at step 0 (torchft's `init_sync`), "
              "after which replicas 1 and 2 held parameters of their own, never equal to replica 0's."]
    return lines


CLAIMS = {"mttr": claim_mttr, "deviation": claim_deviation, "overhead": claim_overhead}
NAMES = {"elaswave": "elaswave", "torchrun_restart": "torchrun restart from a checkpoint (every 5 steps)",
         "torchft_default": "TorchFT, default lighthouse heartbeat timeout",
         "torchft_1s": f"TorchFT, heartbeat timeout {TUNED_HEARTBEAT_MS / 1000:g} s"}
TITLES = {"mttr": "Time to recover from a SIGKILL (MTTR)",
          "deviation": "Parameters after the failure: held-out loss against the same system's failure-free run",
          "overhead": "Steady-state cost of fault tolerance when nothing fails"}


SUPERSEDED_TITLES = {"deviation": ("Loss after the failure, against the same system's failure-free run",)}
HEADER = ["# Benchmarks: elaswave against its peers", "",
          "Written by `python bench/peers.py CLAIM` (or `elaswave bench CLAIM`) from `bench/results/peers_*.json`; "
          "every claim measured in one invocation, elaswave and the peers on the same model, data and fault, "
          "each figure a median over the runs. How each system is run, and what is timed: the docstring of "
          "`bench/peers.py`. TorchFT runs with a lighthouse of `min_replicas` 2, `join_timeout_ms` 60000 and "
          "`quorum_tick_ms` 100, each replica's `Manager` with 30 s operation and quorum timeouts and torchft's "
          "`ProcessGroupGloo` (30 s timeout); its manager and checkpoint servers are pointed at 127.0.0.1 and "
          "gloo at `lo`.", ""]


def _section(claim: str, res: dict) -> list[str]:
    extra = ""
    if claim == "deviation":
        extra = (f" Training data and held-out windows: the prepared corpus of `bench/heldout.py` "
                 f"(`data.path`, eval split {res['result']['corpus']['eval_tokens']:,} tokens).")
    return [f"## {TITLES[claim]}", "",
            f"`python bench/peers.py {claim} --runs {res['runs']}` on {res['date']}, {res['machine']}, "
            f"torch {res.get('torch', '?')}, torchft-nightly {res.get('torchft', '?')}, gloo on loopback, "
            f"{res['wall_s']:.0f} s. Job: {' '.join(res['job'])}; "
            + ("nothing fails." if claim == "overhead" else
               f"rank/replica {res['kill']['rank']} SIGKILLed in step {res['kill']['step']}.") + extra, "",
            *_markdown(claim, res["result"]), ""]


def _blocks(text: str) -> list[list[str]]:
    """``text`` cut before each level-2 heading (outside code fences); the first block is what precedes them."""
    blocks: list[list[str]] = [[]]
    fenced = False
    for line in text.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
        if line.startswith("## ") and not fenced:
            blocks.append([])
        blocks[-1].append(line)
    return blocks


def write_benchmarks() -> Path:
    """Each claim's section of BENCHMARKS.md (at the repository's root) rewritten in place from its
    latest results (a section under a superseded title replaced); the rest of the page is kept."""
    target = HERE.parent / "BENCHMARKS.md"
    blocks = _blocks(target.read_text() if target.exists() else "\n".join(HEADER + [""]))
    last = 0
    for claim in CLAIMS:
        path = HERE / "results" / f"peers_{claim}.json"
        if not path.exists():
            continue
        res = json.loads(path.read_text())
        if claim == "deviation" and "median" not in res["result"]:
            continue  # a training-loss result of the superseded metric: not published again
        names = {f"## {t}" for t in (TITLES[claim], *SUPERSEDED_TITLES.get(claim, ()))}
        at = next((i for i, b in enumerate(blocks) if i and b[0] in names), None)
        if at is None:
            at = last + 1
            blocks.insert(at, [])
        blocks[at] = _section(claim, res)
        last = at
    target.write_text("\n".join(line for b in blocks for line in b))
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
