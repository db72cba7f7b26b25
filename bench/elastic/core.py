"""The elastic core's numbers, each measured in one invocation on this machine (dp=4, pp=1, gloo).

1. MTTR: rank 2 is SIGKILLed at step 12 (the phase rotates over the runs); median over runs of the
   recovery's ``mttr_s`` and of each phase. Against it, in the same invocation, restart-based
   recovery as torchrun does it: the same job under real ``torchrun --max-restarts=1`` with
   elasticity off and a disk checkpoint every 5 steps; the kill ends every worker, torchrun starts
   them again, and they resume from the last checkpoint (step 10) and redo the steps since. Its
   MTTR runs from the kill to the end of the interrupted step done again, the same end point as
   elaswave's.
2. Training loss after the same failure: max |training loss - failure-free training loss| over the
   remaining steps, for elaswave (micro-batches re-sharded, global batch kept) and for the
   drop-replica baseline (the dead replica's samples skipped, the mean taken over the live
   replicas, as TorchFT does). Each run's training loss is the mean over the micro-batches it
   trained on, so drop-replica's (9 of 12 after the kill) differs from the failure-free mean even
   at equal parameters: this is not a measure of the parameters. The parameters' deviation (a
   held-out loss on fixed windows, elaswave fast mode, drop-replica and TorchFT, with noise
   floors) is ``python bench/peers/peers.py deviation``.
3. Steady-state overhead: median step time with elasticity on (heartbeats, standby groups, per-step
   snapshots) over the same job with it off, runs interleaved; peak RSS per rank on vs off and the
   bytes each rank's snapshot pool holds.

    python bench/elastic/core.py --kills 5 --pairs 8
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import RESULTS, in_turn, run_job, set_flags, step_records, torchrun_argv, write_results  # noqa: E402

JOB = ["parallel.dp=4", "parallel.pp=1", "train.num_micro_batches=12", "train.steps=30"]
PHASES = ["forward", "backward", "reduce", "optimizer", "snapshot"]


def run(sets: list[str], deterministic: bool = False) -> list[dict]:
    return run_job(JOB + sets, deterministic=deterministic, timeout_s=600)


def one(records, event):
    return next(r for r in records if r["event"] == event)


def mttr(kills: int) -> dict:
    recs = []
    for k in range(kills):
        phase = PHASES[k % len(PHASES)]
        rec = one(run([f"elastic.inject=kill:rank=2,step=12,phase={phase}"]), "recovery")
        recs.append({"phase": phase, **rec})
        print(f"  kill in {phase}: mttr {rec['mttr_s']:.3f}s", flush=True)
    names = list(recs[0]["phases_s"])
    return {"runs": recs, "median_mttr_s": statistics.median(r["mttr_s"] for r in recs),
            "max_mttr_s": max(r["mttr_s"] for r in recs),
            "median_phases_s": {n: statistics.median(r["phases_s"][n] for r in recs) for n in names}}


def restart_run(phase: str, every: int, job: list[str] = JOB, nproc: int = 4) -> dict:
    """One torchrun restart-from-checkpoint recovery of ``job`` (``nproc`` ranks) after rank 2 dies
    in step 12; times from the fault's wall-clock stamp."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "m.jsonl"
        sets = job + ["elastic.enabled=false", f"checkpoint.dir={tmp}/ckpt", f"checkpoint.every_steps={every}",
                      f"elastic.inject=kill:rank=2,step=12,phase={phase}"]
        cmd = torchrun_argv(nproc, "-m", "elaswave.runtime.worker", "--metrics-out", str(out), max_restarts=1)
        cmd += set_flags(sets)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, start_new_session=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        fault = float(re.search(r"injecting kill into rank 2 at step 12 .*wall time ([0-9.]+)", proc.stderr).group(1))
        records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    resume = one(records, "resume")
    again = next(r for r in step_records(records) if r["step"] == 12)
    return {"phase": phase, "mttr_s": again["wall_time"] - fault, "restart_s": resume["wall_time"] - fault,
            "load_s": resume["load_s"], "resumed_at": resume["step"], "steps_redone": 12 - resume["step"],
            "step_s": statistics.median(r["step_time_s"] for r in step_records(records))}


def restart(kills: int, every: int = 5) -> dict:
    runs = []
    for k in range(kills):
        rec = restart_run(PHASES[k % len(PHASES)], every)
        runs.append(rec)
        print(f"  torchrun restart, kill in {rec['phase']}: mttr {rec['mttr_s']:.3f}s "
              f"(restart {rec['restart_s']:.3f}s, {rec['steps_redone']} steps redone)", flush=True)
    return {"checkpoint_every_steps": every, "runs": runs,
            "median_mttr_s": statistics.median(r["mttr_s"] for r in runs),
            "median_restart_s": statistics.median(r["restart_s"] for r in runs)}


def deviation() -> dict:
    base = [r["loss"] for r in step_records(run([]))]
    out = {}
    for policy in ("elaswave", "drop_replica"):
        losses = [r["loss"] for r in step_records(run(["elastic.inject=kill:rank=2,step=12,phase=reduce",
                                                 f"elastic.policy={policy}"]))]
        after = [abs(a - b) for a, b in zip(losses[12:], base[12:])]
        out[policy] = {"max_abs_dloss": max(after), "mean_abs_dloss": statistics.mean(after)}
    out["drop_replica_over_elaswave"] = out["drop_replica"]["max_abs_dloss"] / max(out["elaswave"]["max_abs_dloss"], 1e-300)
    out["metric"] = ("training loss (each run's mean over the micro-batches it trained on), not parameters; "
                     "see bench/peers/peers.py deviation")
    return out


def overhead(pairs: int) -> dict:
    """Runs with elasticity off and on, back to back in pairs (the box's speed drifts by more than
    the effect over minutes); the ratio is the median over pairs of on/off median step time."""
    ratios, cpu_ratios = [], []
    times: dict[str, list[float]] = {"on": [], "off": []}
    summaries: dict[str, list[dict]] = {"on": [], "off": []}
    for i in range(pairs):
        med = {}
        for mode in in_turn(i, ("off", "on")):
            records = run([f"elastic.enabled={'true' if mode == 'on' else 'false'}"])
            t = [r["step_time_s"] for r in step_records(records)[5:]]
            med[mode] = statistics.median(t)
            times[mode] += t
            summaries[mode].append(one(records, "summary"))
        ratios.append(med["on"] / med["off"])
        cpu = {m: sum(summaries[m][-1]["cpu_s_per_rank"]) for m in med}
        cpu_ratios.append(cpu["on"] / cpu["off"])
        print(f"  pair {i}: on/off step {ratios[-1]:.3f}, cpu {cpu_ratios[-1]:.3f}", flush=True)
    rss = {m: max(max(s["peak_rss_bytes_per_rank"]) for s in summaries[m]) for m in summaries}
    return {"pairs": pairs, "on_over_off": statistics.median(ratios), "pair_ratios": ratios,
            "cpu_on_over_off": statistics.median(cpu_ratios),
            "median_step_s": {m: statistics.median(v) for m, v in times.items()},
            "peak_rss_bytes": rss, "rss_on_over_off": rss["on"] / rss["off"],
            "snapshot_bytes_held_per_rank": summaries["on"][-1]["snapshot_bytes_held_per_rank"],
            "snapshot_buffer_bytes_per_rank": summaries["on"][-1]["snapshot_buffer_bytes_per_rank"],
            "optimizer_state_bytes_per_rank": summaries["on"][-1]["optimizer_state_bytes_per_rank"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--out", default=str(RESULTS / "elastic"))
    args = ap.parse_args()
    print("MTTR ...", flush=True)
    result = {"job": JOB, "mttr": mttr(args.kills)}
    print("restart-based recovery (torchrun) ...", flush=True)
    result["restart"] = restart(args.kills)
    result["restart_over_elaswave"] = result["restart"]["median_mttr_s"] / result["mttr"]["median_mttr_s"]
    print("training-loss deviation ...", flush=True)
    result["deviation"] = deviation()
    print("steady-state overhead ...", flush=True)
    result["overhead"] = overhead(args.pairs)
    m, d, o = result["mttr"], result["deviation"], result["overhead"]
    md = [f"elaswave elastic core, {' '.join(JOB)}, default model, gloo, 2-core CPU box.", "",
          f"**MTTR** (SIGKILL of rank 2 at step 12, {args.kills} runs, phase rotating): median "
          f"{m['median_mttr_s']:.3f} s, max {m['max_mttr_s']:.3f} s.", "",
          "| phase | median (s) |", "| --- | --- |"]
    md += [f"| {n} | {v:.4f} |" for n, v in m["median_phases_s"].items()]
    r = result["restart"]
    md += ["", f"**Restart-based recovery** (real torchrun --max-restarts=1, checkpoint every "
               f"{r['checkpoint_every_steps']} steps, same kills): median MTTR {r['median_mttr_s']:.3f} s, of which "
               f"{r['median_restart_s']:.3f} s until the restarted workers had loaded step "
               f"{r['runs'][0]['resumed_at']}, the rest redoing {r['runs'][0]['steps_redone']} steps. "
               f"**elaswave is {result['restart_over_elaswave']:.1f}x faster.**"]
    md += ["", "**Training loss after the same failure** (max / mean |training loss - failure-free training loss| "
               "over steps 12-29). Each run's training loss is its mean over the micro-batches it trained on: "
               "drop_replica's covers 9 of the 12 after the kill, so it differs from the failure-free mean even at "
               "equal parameters. Not a measure of the parameters; for that (held-out loss, with noise floors and "
               "TorchFT): `python bench/peers/peers.py deviation`.", "",
           "| policy | max | mean |", "| --- | --- | --- |"]
    md += [f"| {p} | {d[p]['max_abs_dloss']:.2e} | {d[p]['mean_abs_dloss']:.2e} |" for p in ("elaswave", "drop_replica")]
    md += ["", f"drop-replica / elaswave, training-loss metric (max): {d['drop_replica_over_elaswave']:.0f}x", "",
           f"**Steady-state overhead** ({o['pairs']} back-to-back pairs of runs, median of the pairs' "
           f"on/off ratios): **{o['on_over_off']:.3f}x** step time (pairs: "
           f"{', '.join(f'{x:.3f}' for x in o['pair_ratios'])}); CPU time {o['cpu_on_over_off']:.3f}x; "
           f"median step {o['median_step_s']['on'] * 1e3:.1f} ms on, {o['median_step_s']['off'] * 1e3:.1f} ms off; peak RSS per rank {o['peak_rss_bytes']['on'] / 2**20:.0f} MiB on vs "
           f"{o['peak_rss_bytes']['off'] / 2**20:.0f} MiB off; snapshot bytes held per rank "
           f"{o['snapshot_bytes_held_per_rank']} (one peer's optimizer slots, padding included: master + exp_avg + exp_avg_sq) and "
           f"transfer buffers {o['snapshot_buffer_bytes_per_rank']} (the header sent and the receive "
           f"buffers); own optimizer state (moments) {o['optimizer_state_bytes_per_rank']}."]
    write_results(args.out, result, md)


if __name__ == "__main__":
    main()
