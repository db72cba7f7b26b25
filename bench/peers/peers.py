"""elaswave against the peers a user runs today: each claim measured in one invocation, on the same
model, data and fault, with the real peers.

    python bench/peers/peers.py mttr [--runs 5]       # time to recover: elaswave, torchrun restart, TorchFT
    python bench/peers/peers.py deviation [--runs 5]  # held-out loss after the failure against each one's failure-free run
    python bench/peers/peers.py overhead [--runs 5]   # steady step time against each one's own plain run

The job: dp=3 (TorchFT: three replica groups of one process), pp=1, the default GPT with dropout
off (so TorchFT's own runs can be compared step by step), 12 micro-batches of 4 per step, 30
steps. The fault: rank (replica) 2 SIGKILLed in step 12's backward.

- elaswave: ``elaswave run`` (fast mode: not ``--deterministic``).
- torchrun: the same worker under real ``torchrun --max-restarts=1`` with elasticity off and a disk
  checkpoint every 5 steps (``bench/elastic/core.py``'s restart run).
- TorchFT: ``bench/peers/torchft_replica.py`` per replica, with a lighthouse started here, its default
  heartbeat timeout and one tuned to 1 s; ``--plain`` (torch's DDP under torchrun) is its
  no-fault-tolerance run. Its replicas start from the same seeded model (``init_sync=False``) and
  decay only matrices, as elaswave's optimizer does, so a failure-free TorchFT run trains what a
  failure-free elaswave run trains. torchft is installed into the bench environment only
  (``pip install -e '.[bench]'``), not a dependency of elaswave.

MTTR runs from the kill to the end of the interrupted step done again (elaswave: the recovery
record's ``mttr_s``; torchrun and TorchFT: that step's record's wall time minus the kill's stamp).

Deviation scores parameters, not a training loss: every system trains on the same prepared corpus
(``bench/peers/heldout.py``: standard-library folders, ``elaswave prepare --tokenizer bytes
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
invocation. A run that fails (a TorchFT quorum that timed out, a job that exited non-zero) is a
result, not the bench's end: it is left out of the medians, counted per system (``num_failed``) and
listed with its error's first line (``failed``), in the results and on the page; deviation retries a
run up to three times first. Results: ``bench/results/peers_CLAIM.{json,md}``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import (BENCHMARKS, RESULTS, in_turn, median_step_s, page_blocks, put_section,  # noqa: E402
                          run_job, short_error, step_records, write_json, write_page)
from bench.elastic.core import restart_run  # noqa: E402
from bench.peers.heldout import Scorer, prepare_corpus  # noqa: E402
from bench.peers.torchft_job import (JOB, KILL, KILL_RANK, KILL_STEP, REPLICAS, TUNED_HEARTBEAT_MS,  # noqa: E402
                                     plain_ddp_step_s, torchft_run)

HELDOUT_BATCHES = 4  # held-out batches of 12 x 4 windows: 192 windows, 12,288 scored tokens


def attempt(failed: dict[str, list[dict]], system: str, run: str, fn: Callable[[], object]):
    """``fn()``, or None with the failure recorded in ``failed[system]`` (the run's label and its
    error's first line): a failed run is a result of its system, never the bench's end."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - whatever ended one run, the other runs still go
        failed.setdefault(system, []).append({"run": run, "error": short_error(exc)})
        print(f"  {system} {run} FAILED: {short_error(exc)}", flush=True)
        return None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _counted(failed: dict[str, list[dict]]) -> dict:
    return {"failed": failed, "num_failed": {k: len(v) for k, v in failed.items()}}


# --- the claims --------------------------------------------------------------------------------

def claim_mttr(runs: int) -> dict:
    systems = {"elaswave": lambda: next(r for r in run_job(JOB + [KILL]) if r["event"] == "recovery")["mttr_s"],
               "torchrun_restart": lambda: restart_run("backward", 5, JOB, REPLICAS)["mttr_s"],
               "torchft_default": lambda: torchft_run(kill=True)["mttr_s"],
               "torchft_1s": lambda: torchft_run(kill=True, heartbeat_ms=TUNED_HEARTBEAT_MS)["mttr_s"]}
    out: dict[str, list[float]] = {k: [] for k in systems}
    failed: dict[str, list[dict]] = {k: [] for k in systems}
    for i in range(runs):
        got = {k: attempt(failed, k, f"run {i}", fn) for k, fn in systems.items()}
        for k, v in got.items():
            if v is not None:
                out[k].append(v)
        print(f"  run {i}: " + ", ".join(f"{k} {'FAILED' if v is None else f'{v:.3f}s'}" for k, v in got.items()),
              flush=True)
    med = {k: _median(v) for k, v in out.items()}
    base = med["elaswave"]
    return {"runs": out, "median_s": med,
            "over_elaswave": {k: m / base if m is not None and base else None for k, m in med.items()},
            **_counted(failed)}


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
    return {"heldout": heldout, "losses": [r["loss"] for r in step_records(records)],
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


def _deviation(res: dict, free: dict) -> dict:
    return {"heldout": _abs_dev(res["heldout"], free["heldout"], KILL_STEP - 1),
            "train_loss": _abs_dev(res["losses"], free["losses"], KILL_STEP)}


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
        failures: list[dict] = []  # every failed attempt, retried ones too
        failed: dict[str, list[dict]] = {k: [] for k in run_system}  # runs that failed every attempt

        def tried(system: str, kill: bool, label: str, tries: int = 3) -> dict:
            for k in range(tries):
                try:
                    res = run_system[system](kill)
                    if not all(math.isfinite(x) for x in res["heldout"] + res["losses"]):
                        raise RuntimeError("a loss is not finite: held-out "
                                           f"{res['heldout'][KILL_STEP - 1:KILL_STEP + 2]}..., training "
                                           f"{res['losses'][KILL_STEP - 1:KILL_STEP + 2]}..., "
                                           f"resume_step {res.get('resume_step')}")
                    return res
                except Exception as exc:  # noqa: BLE001 - retried, then counted
                    failures.append({"system": system, "run": label, "attempt": k, "error": str(exc)[-1500:]})
                    print(f"  {system} {label} attempt {k} FAILED: {str(exc)[-300:]}", flush=True)
                    last_error = exc
            raise RuntimeError(f"failed {tries} times; the last: {short_error(last_error)}")

        free, noise = {}, {}
        for system in run_system:
            free[system] = attempt(failed, system, "failure-free", lambda: tried(system, False, "failure-free"))
            again = free[system] and attempt(failed, system, "failure-free again",
                                             lambda: tried(system, False, "failure-free again"))
            noise[system] = _deviation(again, free[system]) if again else None
            if noise[system]:
                print(f"  {system} noise floor: held-out max {noise[system]['heldout']['max']:.3g}", flush=True)
        free = {k: v for k, v in free.items() if v}
        out: dict[str, list[dict]] = {k: [] for k in run_system}
        last: dict[str, dict] = {}
        for i in range(runs):
            got = {}
            for system in run_system:
                if system not in free:
                    failed[system].append({"run": f"run {i}", "error": "not run: no failure-free run to compare with"})
                    continue
                res = attempt(failed, system, f"run {i}", lambda: tried(system, True, f"run {i}"))
                if res is not None:
                    last[system] = res
                    got[system] = {**_deviation(res, free[system]), "resume_step": res.get("resume_step")}
                    out[system].append(got[system])
            print(f"  run {i}: " + ", ".join(f"{k} {v['heldout']['max']:.3g}/{v['heldout']['mean']:.3g}"
                                            for k, v in got.items()) + " (held-out max/mean)", flush=True)
        checked = [r for r in (free.get("elaswave"), last.get("elaswave"), free.get("drop_replica"),
                               last.get("drop_replica")) if r]
        full = scorer.tokens
        manifest = json.loads((corpus / "manifest.json").read_text())
    median = {k: {f"{m}_{stat}": statistics.median(r[m][stat] for r in v) for m in ("heldout", "train_loss")
                  for stat in ("max", "mean")} if v else None for k, v in out.items()}
    both = "elaswave" in free and "torchft" in free
    return {
        "metric": (f"|held-out loss - the same system's failure-free held-out loss| over the states after "
                   f"{KILL_STEP}..{scorer.cfg.train.steps} steps; held-out: {HELDOUT_BATCHES} batches x "
                   f"{scorer.cfg.train.num_micro_batches} micro-batches x {scorer.cfg.train.micro_batch_size} windows of the eval split "
                   f"({scorer.tokens} scored tokens), every window of each batch"),
        "heldout_tokens": scorer.tokens,
        "corpus": {"stdlib_folders": manifest["inputs"], "eval_fraction": manifest["eval_fraction"],
                   "train_tokens": manifest["splits"]["train"]["tokens"],
                   "eval_tokens": manifest["splits"]["eval"]["tokens"]},
        "runs": out, "median": median, "noise_floor": noise, "failures": failures, **_counted(failed),
        "sanity": {
            "elaswave_vs_torchft_failure_free_heldout_max_abs": max(
                abs(a - b) for a, b in zip(free["elaswave"]["heldout"], free["torchft"]["heldout"], strict=True))
            if both else None,
            "failure_free_heldout": {k: free[k]["heldout"] for k in free},
            "builtin_eval_vs_scorer_max_abs": max(
                (abs(a - b) for r in checked for a, b, n in
                 zip(r["builtin_eval"], r["heldout"], r["builtin_eval_tokens"], strict=True) if n == full),
                default=None),
            "drop_replica_builtin_eval_tokens": last["drop_replica"]["builtin_eval_tokens"]
            if "drop_replica" in last else None},
        "torchft_participants_per_step": last["torchft"]["participants"] if "torchft" in last else None}


def _config(sets: list[str]):
    from elaswave import config

    return config.load(None, sets)


def claim_overhead(runs: int) -> dict:
    """Median over back-to-back pairs of (with fault tolerance) / (without) median step time."""
    measure = {"elaswave_on": lambda: median_step_s(run_job(JOB + ["elastic.enabled=true"]), 5),
               "elaswave_off": lambda: median_step_s(run_job(JOB + ["elastic.enabled=false"]), 5),
               "torchft": lambda: torchft_run(kill=False)["step_s"], "plain_ddp": plain_ddp_step_s}
    systems = {"elaswave": ("elaswave_on", "elaswave_off"), "torchft": ("torchft", "plain_ddp")}
    pairs: dict[str, list[float]] = {k: [] for k in systems}
    steps: dict[str, list[float]] = {k: [] for k in measure}
    failed: dict[str, list[dict]] = {k: [] for k in measure}
    for i in range(runs):
        got = {}
        for with_ft, without in systems.values():
            for name in in_turn(i, (with_ft, without)):
                got[name] = attempt(failed, name, f"pair {i}", measure[name])
                if got[name] is not None:
                    steps[name].append(got[name])
        ratio = {k: got[a] / got[b] if got[a] is not None and got[b] is not None else None
                 for k, (a, b) in systems.items()}
        for k, r in ratio.items():
            if r is not None:
                pairs[k].append(r)
        print(f"  pair {i}: " + ", ".join(f"{label} {'FAILED' if ratio[k] is None else f'{ratio[k]:.3f}'}" for k, label
                                          in (("elaswave", "elaswave on/off"), ("torchft", "torchft/DDP"))), flush=True)
    return {"pair_ratios": pairs, "median_ratio": {k: _median(v) for k, v in pairs.items()},
            "median_step_s": {k: _median(v) for k, v in steps.items()}, **_counted(failed)}


# --- the page ----------------------------------------------------------------------------------

def _g(x: float | None, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def _failed_lines(res: dict, names: dict[str, str]) -> list[str]:
    """The runs that failed, each with its error's first line (nothing when none did)."""
    failed = [(k, f) for k, fs in res.get("failed", {}).items() for f in fs]
    if not failed:
        return []
    return ["", f"Failed runs (counted; not in the medians): {len(failed)}: " + "; ".join(
        f"{names.get(k, k)}, {f['run']}: `{f['error']}`" for k, f in failed) + "."]


def _markdown(claim: str, res: dict) -> list[str]:
    counted = "num_failed" in res  # results written before failed runs were counted have no column
    n = res.get("num_failed", {})
    if claim == "mttr":
        m, x = res["median_s"], res["over_elaswave"]
        head = "| system | median MTTR (s) | over elaswave | every run (s) |" + (" failed runs |" if counted else "")
        rows = [f"| {NAMES[k]} | {_g(m[k], '.3f')} | {_g(x[k], '.1f')}x | {', '.join(f'{v:.2f}' for v in res['runs'][k])} |"
                + (f" {n.get(k, 0)} |" if counted else "") for k in m]
        return [head, "| --- | --- | --- | --- |" + (" --- |" if counted else ""), *rows, *_failed_lines(res, NAMES)]
    if claim == "deviation":
        return _deviation_markdown(res)
    r, s = res["median_ratio"], res["median_step_s"]
    context = s["elaswave_on"] / s["plain_ddp"] if s["elaswave_on"] and s["plain_ddp"] else None
    failed = {k: n.get(a, 0) + n.get(b, 0) for k, (a, b) in (("elaswave", ("elaswave_on", "elaswave_off")),
                                                            ("torchft", ("torchft", "plain_ddp")))}
    return ["| system | median step with / without fault tolerance | with (s) | without (s) |"
            + (" failed runs |" if counted else ""), "| --- | --- | --- | --- |" + (" --- |" if counted else ""),
            f"| elaswave (elastic on / off) | {_g(r['elaswave'], '.3f')}x | {_g(s['elaswave_on'], '.4f')} | "
            f"{_g(s['elaswave_off'], '.4f')} |" + (f" {failed['elaswave']} |" if counted else ""),
            f"| TorchFT / plain DDP | {_g(r['torchft'], '.3f')}x | {_g(s['torchft'], '.4f')} | {_g(s['plain_ddp'], '.4f')} |"
            + (f" {failed['torchft']} |" if counted else ""),
            "", "Ratios of back-to-back pairs (the box's speed drifts by more than the effect over minutes): "
            + "; ".join(f"{k} " + ", ".join(f"{v:.3f}" for v in vs) for k, vs in res["pair_ratios"].items())
            + f". For context, across systems: elaswave's median step over plain DDP's is {_g(context, '.3f')}x "
              "(a ZeRO-1 step: a gradient all-reduce plus a parameter all-gather, against DDP's one all-reduce).",
            *_failed_lines(res, {})]


def _deviation_markdown(res: dict) -> list[str]:
    med, noise, sanity = res["median"], res["noise_floor"], res["sanity"]
    counted, n_failed = "num_failed" in res, res.get("num_failed", {})
    n = max(len(v) for v in res["runs"].values())
    nothing = {"max": None, "mean": None}
    lines = [f"| system | max abs delta held-out loss (median of {n}) | mean abs delta held-out loss (median) | "
             "noise floor, max / mean (two failure-free runs) | secondary: max abs delta of the training loss, "
             "a mean over the micro-batches each run trained on (median) |" + (" failed runs |" if counted else ""),
             "| --- | --- | --- | --- | --- |" + (" --- |" if counted else "")]
    for k, m in med.items():
        m = m or {"heldout_max": None, "heldout_mean": None, "train_loss_max": None}
        floor = (noise[k] or {"heldout": nothing})["heldout"]
        lines.append(f"| {DEVIATION_SYSTEMS[k]} | {_g(m['heldout_max'])} | {_g(m['heldout_mean'])} | "
                     f"{_g(floor['max'])} / {_g(floor['mean'])} | {_g(m['train_loss_max'])} |"
                     + (f" {n_failed.get(k, 0)} |" if counted else ""))
    free = sanity["failure_free_heldout"]
    last_free = {k: _g(free[k][-1], ".4f") if k in free else "-" for k in ("elaswave", "torchft")}
    tokens = sanity["drop_replica_builtin_eval_tokens"]
    lines += ["", f"Metric: {res['metric']}. Each killed run against its own system's failure-free run, the same "
              "scorer for every system (`bench/peers/heldout.py`); elaswave runs in fast mode (not `--deterministic`).",
              "", "Every run, held-out max / mean: " + "; ".join(
                  f"{k} " + ", ".join(f"{_g(r['heldout']['max'])} / {_g(r['heldout']['mean'])}" for r in v)
                  for k, v in res["runs"].items()) + ". Recoveries resumed at step: " + "; ".join(
                  f"{k} {[r['resume_step'] for r in res['runs'][k]]}" for k in ("elaswave", "drop_replica")) + ".",
              "", f"Checks: elaswave's own evaluation against this scorer on the same checkpoints, where it scores "
              f"every window: max abs difference {_g(sanity['builtin_eval_vs_scorer_max_abs'])}; elaswave's and "
              f"TorchFT's failure-free held-out losses (two implementations of the same training) differ by at most "
              f"{_g(sanity['elaswave_vs_torchft_failure_free_heldout_max_abs'])} over the "
              f"{len(free.get('elaswave', []))} steps "
              f"(after the last: elaswave {last_free['elaswave']}, TorchFT "
              f"{last_free['torchft']}). Under drop_replica elaswave's own evaluation "
              f"scores only the live replicas' micro-batches after the kill (held-out tokens per step in the last "
              f"killed run: {sorted(set(tokens)) if tokens else '-'}), which is why the held-out "
              f"loss here comes from checkpoints. TorchFT replicas per committed step in its last killed run: "
              f"{res['torchft_participants_per_step']}."]
    if res["failures"]:
        lines += ["", f"Failed attempts (retried; not in the medians): {len(res['failures'])}: " + "; ".join(
            f"{f['system']} {f['run']}: {f['error'].strip().splitlines()[-1][:200]}" for f in res["failures"]) + "."]
    lines += _failed_lines(res, DEVIATION_SYSTEMS)
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
          "Written by `python bench/peers/peers.py CLAIM` (or `elaswave bench CLAIM`) from `bench/results/peers_*.json`; "
          "every claim measured in one invocation, elaswave and the peers on the same model, data and fault, "
          "each figure a median over the runs. How each system is run, and what is timed: the docstring of "
          "`bench/peers/peers.py`. TorchFT runs with a lighthouse of `min_replicas` 2, `join_timeout_ms` 60000 and "
          "`quorum_tick_ms` 100, each replica's `Manager` with 30 s operation and quorum timeouts and torchft's "
          "`ProcessGroupGloo` (30 s timeout); its manager and checkpoint servers are pointed at 127.0.0.1 and "
          "gloo at `lo`.", ""]


def _section(claim: str, res: dict) -> list[str]:
    extra = ""
    if claim == "deviation":
        extra = (f" Training data and held-out windows: the prepared corpus of `bench/peers/heldout.py` "
                 f"(`data.path`, eval split {res['result']['corpus']['eval_tokens']:,} tokens).")
    return [f"## {TITLES[claim]}", "",
            f"`python bench/peers/peers.py {claim} --runs {res['runs']}` on {res['date']}, {res['machine']}, "
            f"torch {res.get('torch', '?')}, torchft-nightly {res.get('torchft', '?')}, gloo on loopback, "
            f"{res['wall_s']:.0f} s. Job: {' '.join(res['job'])}; "
            + ("nothing fails." if claim == "overhead" else
               f"rank/replica {res['kill']['rank']} SIGKILLed in step {res['kill']['step']}.") + extra, "",
            *_markdown(claim, res["result"]), ""]


def write_benchmarks() -> Path:
    """Each claim's section of BENCHMARKS.md rewritten in place from its latest results (a section
    under a superseded title replaced; a new one after the last claim's); the rest of the page is kept."""
    blocks = page_blocks(BENCHMARKS.read_text() if BENCHMARKS.exists() else "\n".join(HEADER + [""]))
    last = 0
    for claim in CLAIMS:
        path = RESULTS / f"peers_{claim}.json"
        if not path.exists():
            continue
        res = json.loads(path.read_text())
        if claim == "deviation" and "median" not in res["result"]:
            continue  # a training-loss result of the superseded metric: not published again
        names = {f"## {t}" for t in (TITLES[claim], *SUPERSEDED_TITLES.get(claim, ()))}
        last = put_section(blocks, _section(claim, res), lambda line: line in names, missing_at=last + 1)
    return write_page(blocks, BENCHMARKS)


def torchft_installed() -> bool:
    return importlib.util.find_spec("torchft") is not None


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
    if not torchft_installed():
        print("bench/peers/peers.py needs TorchFT in this environment: pip install -e '.[bench]' "
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
        write_json(RESULTS / f"peers_{claim}.json", res)
        md = _markdown(claim, res["result"])
        (RESULTS / f"peers_{claim}.md").write_text("\n".join(md) + "\n")
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
