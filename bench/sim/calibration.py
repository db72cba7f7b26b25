"""How well the simulator predicts real runs on this machine.

Emulated mode (the default). Emulated-compute runs of the runtime (the pipeline benchmark's job:
dp=4 x pp=4, one rank SIGKILLed) under three policies, and one run of another layout (dp=2 x pp=4).
The cluster model is fitted on the elaswave run alone (``elaswave.sim.calibrate.fit``); every run's
step time before and after its recovery, its throughput ratio and its MTTR are then predicted from
the plans it ran (``predict``) and set against what it measured. The fit run's own before-step is
fitted, not predicted; everything else is a prediction. Its compute is the sleeps the model was
given, so this checks the schedule, the plans and the recovery -- not compute.

The link (latency per ring hop, bandwidth) is fitted from the gradient sums and parameter
all-gathers that three failure-free dp=4 runs of different model widths timed (``fit_links``), and
checked on runs it did not see (other widths, deterministic mode's 8-byte sums, two holders); the
16-rank model prices its collectives over it.

Real mode (``--real``): real compute, nothing emulated, 4 ranks on this machine's cores (one
thread each), a GPT of 6 blocks, d_model=128, seq_len=128, 8 micro-batches of 4 sequences; every
run SIGKILLs one rank at step 10 of 20. The model is fitted on one run (dp=2 x pp=2, elaswave) --
its layers' time is the cost profile scaled to the measured compute -- and the link on the three
emulated ``link fit`` runs; it then predicts held-out runs: other policies (drop_replica,
reroute), other layouts (dp=4 x pp=1, dp=1 x pp=4) and another width (d_model=160, carried over
with ``for_run``). Every run is repeated ``--rounds`` times (default 5, interleaved); each run's
step times are medians over its steps (from step 2 before the kill, from two steps after the
resumed one after it), and a table row is the median over rounds, predicted from each round's own
fit. The fit layout's own row is predicted from another round's fit: the repeats' noise, the floor
for the others. Four processes on fewer cores contend for them, so per-rank compute depends on
how many ranks are busy, which the model does not price; a processor-sharing check beside the
prediction (compute x max(1, busy ranks / cores), relative to the fit run's) shows how much of the
error that is. It is a diagnostic of the error, not part of the simulator. Run it on an otherwise
idle machine.

    python bench/sim/calibration.py [--keep DIR]      # runs the jobs (keeping their metrics in DIR)
    python bench/sim/calibration.py --from DIR        # only fits and predicts, from kept metrics
    python bench/sim/calibration.py --real [--rounds 5] [--keep DIR]   # -> results/sim_calibration_real.*
    python bench/sim/calibration.py --real --smoke    # two short jobs, one round: the code path only
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import RESULTS, run_job, write_json, write_results  # noqa: E402
from bench.elastic.pipeline import JOB  # noqa: E402  the same emulated job
from elaswave.runtime.metrics import read_jsonl  # noqa: E402
from elaswave.sim.calibrate import after_plan, fit, fit_links, for_run, predict  # noqa: E402

RUNS = {
    "elaswave (fit)": [],
    "drop_replica": ["elastic.policy=drop_replica"],
    "reroute": ["elastic.policy=reroute"],
    "elaswave dp=2 x pp=4": ["parallel.dp=2", "train.num_micro_batches=32", "elastic.inject=kill:rank=1,step=7,phase=backward"],
}

# Collectives big enough for their bytes to show: the whole model on each of 4 holders.
# The fitted model's collectives are timed from the step's phases: every run waits for its
# all-gathers within its step (sim.calibrate refuses a priced link on a run that does not).
SYNC = ["parallel.overlap_param_gather=false"]
LINK_JOB = ["parallel.dp=4", "parallel.pp=1", *SYNC, "emulate.enabled=true", "emulate.block_forward_ms=5",
            "model.num_heads=2", "model.seq_len=16", "model.num_blocks=4", "train.micro_batch_size=1",
            "train.num_micro_batches=8", "train.steps=10"]
LINK_FIT = {f"link fit d_model={d}": [f"model.d_model={d}"] for d in (64, 256, 384)}
LINK_CHECK = {"link check d_model=128": ["model.d_model=128"], "link check d_model=192": ["model.d_model=192"],
              "link check d_model=320": ["model.d_model=320"],
              "link check d_model=256 deterministic": ["model.d_model=256", "train.deterministic=true"],
              "link check d_model=256 dp=2": ["model.d_model=256", "parallel.dp=2"]}


def read(path: Path) -> list[dict]:
    return read_jsonl(str(path))


def _file(name: str) -> str:
    return name.replace(" ", "_").replace("(", "").replace(")", "").replace("=", "") + ".jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", help="keep each run's metrics in this folder")
    ap.add_argument("--from", dest="source", help="fit and predict from metrics kept earlier with --keep")
    ap.add_argument("--real", action="store_true", help="real compute: fit on one run, predict held-out runs")
    ap.add_argument("--rounds", type=int, default=5,
                    help="--real: repeats of every run, interleaved (>= 5 to write results)")
    ap.add_argument("--smoke", action="store_true", help="--real: two short jobs, one round, link from "
                    "results/sim_calibration.json; nothing written to results/")
    args = ap.parse_args()
    if args.real:
        real(args)
    else:
        emulated(args)


def emulated(args) -> None:
    records = {}
    if args.source:
        records = {name: read(Path(args.source) / _file(name)) for name in {**RUNS, **LINK_FIT, **LINK_CHECK}}
    else:
        keep = Path(args.keep or tempfile.mkdtemp(prefix="elaswave-calibration-"))
        keep.mkdir(parents=True, exist_ok=True)
        jobs = {**{n: JOB + SYNC + s for n, s in RUNS.items()}, **{n: LINK_JOB + s for n, s in {**LINK_FIT, **LINK_CHECK}.items()}}
        for name, sets in jobs.items():
            records[name] = run_job(sets, keep / _file(name))
            print(f"  ran {name} -> {keep / _file(name)}", flush=True)
    latency, bandwidth = fit_links([records[name] for name in LINK_FIT])
    model = fit(records["elaswave (fit)"], links=(latency, bandwidth))
    link_model = fit(records[next(iter(LINK_FIT))], links=(latency, bandwidth))
    result = {name: predict(records[name], model) for name in RUNS}
    for name in {**LINK_FIT, **LINK_CHECK}:  # their compute is another model's: only the link is priced
        result[name] = {"collectives_s": predict(records[name], link_model)["collectives_s"]}
    doc = {"link": {"latency_per_hop_s": latency, "bytes_per_s": bandwidth},
           "model": {"per_microbatch_stage_s": model.per_microbatch_stage_s, "step_overhead_s": model.step_overhead_s,
                     "recovery_s": model.detect_s + model.agree_s + model.communicator_s + model.plan_s},
           "runs": result}
    md = ["Simulator vs real runs (emulated compute, 2-core CPU box, gloo). The link is fitted on the three "
          "`link fit` runs; the 16-rank model on `elaswave (fit)`, and the `link` runs' compute on the first "
          "of them. Everything else is predicted.", "",
          f"Fitted link (loopback gloo, 4 holders): {1e6 * latency:.0f} us per ring hop, "
          f"{bandwidth / 1e9:.2f} GB/s per hop (effective: it includes packing the bucket).", "",
          "| run | quantity | predicted | measured | error |", "| --- | --- | --- | --- | --- |"]
    for name, rows in result.items():
        for key, v in rows.items():
            md.append(f"| {name} | {key} | {v['predicted']:.3f} | {v['measured']:.3f} | {100 * v['error']:+.1f} % |")
    md += ["", "`collectives_s` is the metrics writer's gradient sum and parameter all-gather (step phases `reduce` + "
           "`gather`). In the 16-rank jobs these phases also hold the writer's wait for the other pipelines, which "
           "the link does not price; they are about 1 % of a step there."]
    write_results(RESULTS / "sim_calibration", doc, md)


# -- Real compute ---------------------------------------------------------------------------------
# Compute dominates: ~1.3 M multiply-adds per token forward in 6 blocks of d_model=128, 512 tokens a
# micro-batch: a step is about half a second on 4 single-threaded ranks. GPT: no tied layers.
REAL_JOB = ["model.arch=gpt", "model.d_model=128", "model.num_heads=4", "model.num_blocks=6", "model.seq_len=128",
            "model.dropout=0", "train.micro_batch_size=4", "train.num_micro_batches=8",
            "data.max_corpus_bytes=400000", "elastic.straggler_gain=0"]  # no re-plan but the kill's
REAL_STEPS, REAL_KILL_STEP = 20, 10
SMOKE_STEPS, SMOKE_KILL_STEP = 7, 4  # steps 2.. before the resumed one (the kill's, or one earlier), 1-2 after
REAL_FIT = "fit: dp=2 x pp=2 elaswave"
REAL_RUNS = {  # name -> (settings, rank killed); the metrics writer (rank 0) survives
    REAL_FIT: (["parallel.dp=2", "parallel.pp=2"], 3),
    "dp=2 x pp=2 drop_replica": (["parallel.dp=2", "parallel.pp=2", "elastic.policy=drop_replica"], 3),
    "dp=2 x pp=2 reroute": (["parallel.dp=2", "parallel.pp=2", "elastic.policy=reroute"], 3),
    "dp=4 x pp=1 elaswave": (["parallel.dp=4", "parallel.pp=1"], 3),
    "dp=1 x pp=4 elaswave": (["parallel.dp=1", "parallel.pp=4"], 2),
    "dp=2 x pp=2 elaswave d_model=160": (["parallel.dp=2", "parallel.pp=2", "model.d_model=160"], 3),
}
SMOKE_RUNS = (REAL_FIT, "dp=4 x pp=1 elaswave")
QUANTITIES = ("step_before_s", "collectives_s", "step_after_s", "after_over_before", "mttr_s")


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _real_jobs(smoke: bool) -> dict[str, list[str]]:
    steps, kill = (SMOKE_STEPS, SMOKE_KILL_STEP) if smoke else (REAL_STEPS, REAL_KILL_STEP)
    names = SMOKE_RUNS if smoke else tuple(REAL_RUNS)
    return {n: REAL_JOB + SYNC + REAL_RUNS[n][0] + [f"train.steps={steps}",
                                             f"elastic.inject=kill:rank={REAL_RUNS[n][1]},step={kill},phase=backward"]
            for n in names}


def _stored_link() -> tuple[float, float]:
    link = json.loads((RESULTS / "sim_calibration.json").read_text())["link"]
    return link["latency_per_hop_s"], link["bytes_per_s"]


def _world(records: list[dict]) -> int:
    return next(r for r in records if r.get("event") == "job")["world_size"]


def _busy(plan) -> int:
    """Ranks with compute in a plan: those of pipelines that run micro-batches, and detours' hosts."""
    busy = {r for pipe, mbs in zip(plan.pipelines, plan.micro_batches) if mbs for r in pipe}
    return len(busy | {r for _, route in plan.routes for r in route})


def _sharing(records: list[dict], fitted: list[dict], model, got: dict, cores: int) -> dict:
    """Diagnostic, not the simulator: the prediction with every compute time scaled by processor
    sharing, max(1, busy ranks / cores), relative to the fit run's (all its ranks busy)."""
    def scaled(factor):
        return replace(model, layer_forward_s=tuple(f * factor for f in model.layer_forward_s),
                       per_microbatch_stage_s=model.per_microbatch_stage_s * factor)

    share = lambda n: max(1.0, n / cores)  # noqa: E731
    base = share(_world(fitted))
    out = {"step_before_s": predict(records, scaled(share(_world(records)) / base))["step_before_s"]["predicted"]}
    if "step_after_s" in got:
        after = predict(records, scaled(share(_busy(after_plan(records))) / base))["step_after_s"]["predicted"]
        out["step_after_s"] = after
        out["after_over_before"] = (got["after_over_before"]["predicted"] * got["step_after_s"]["predicted"] / after
                                    * out["step_before_s"] / got["step_before_s"]["predicted"])
        out["mttr_s"] = got["mttr_s"]["predicted"] - got["step_after_s"]["predicted"] + after
    return out


def _link_of(round_records: dict, fallback):
    if all(n in round_records for n in LINK_FIT):
        return fit_links([round_records[n] for n in LINK_FIT])
    return fallback


def _summary(per_round: dict) -> dict:
    """Per run and quantity: medians over rounds of predicted and measured, the error of the medians,
    each round's error, the measured range, and the processor-sharing check."""
    out = {}
    for name, rounds in per_round.items():
        rows = {}
        for q in QUANTITIES:
            got = [r[q] for r in rounds if q in r]
            if not got:
                continue
            pred, meas = statistics.median(g["predicted"] for g in got), statistics.median(g["measured"] for g in got)
            row = {"predicted": pred, "measured": meas, "error": pred / meas - 1,
                   "measured_min": min(g["measured"] for g in got), "measured_max": max(g["measured"] for g in got),
                   "round_errors": [g["error"] for g in got], "rounds": len(got)}
            shared = [r["sharing"][q] for r in rounds if q in r.get("sharing", {})]
            if shared:
                row["sharing_predicted"] = statistics.median(shared)
                row["sharing_error"] = row["sharing_predicted"] / meas - 1
            rows[q] = row
        out[name] = rows
    return out


def real(args) -> None:
    cores = _cores()
    smoke = args.smoke
    jobs = _real_jobs(smoke)
    rounds = 1 if smoke else args.rounds
    link_jobs = {} if smoke else {n: LINK_JOB + s for n, s in LINK_FIT.items()}
    records: list[dict] = []
    began = time.perf_counter()
    if args.source:
        src = Path(args.source)
        meta = json.loads((src / "real.json").read_text())
        rounds, jobs, smoke, cores = meta["rounds"], meta["jobs"], meta["smoke"], meta["cores"]
        link_jobs = {n: LINK_JOB + LINK_FIT[n] for n in meta["link_runs"]}
        for k in range(rounds):
            records.append({n: read(src / f"r{k}_{_file(n)}") for n in list(jobs) + list(link_jobs)})
    else:
        keep = Path(args.keep or tempfile.mkdtemp(prefix="elaswave-calibration-real-"))
        keep.mkdir(parents=True, exist_ok=True)
        (keep / "real.json").write_text(json.dumps({"rounds": rounds, "smoke": smoke, "cores": cores, "jobs": jobs,
                                                     "link_runs": list(link_jobs)}, indent=1))
        for k in range(rounds):  # interleaved: every round runs every job once
            got = {}
            for name, sets in {**link_jobs, **jobs}.items():
                t0 = time.perf_counter()
                got[name] = run_job(sets, keep / f"r{k}_{_file(name)}")
                print(f"  round {k}: ran {name} in {time.perf_counter() - t0:.0f} s -> {keep / f'r{k}_{_file(name)}'}",
                      flush=True)
            records.append(got)
    fallback = _stored_link() if not link_jobs and (RESULTS / "sim_calibration.json").exists() else None
    links = [_link_of(rd, fallback) for rd in records]
    models = [fit(rd[REAL_FIT], links=link) for rd, link in zip(records, links)]
    per_round: dict[str, list[dict]] = {n: [] for n in jobs}
    for k, rd in enumerate(records):
        for name in jobs:
            # The fit layout is predicted from another round's fit (with one round: its own, fitted).
            src = (k + 1) % rounds if name == REAL_FIT else k
            fitted = records[src][REAL_FIT]
            model = for_run(models[src], fitted, rd[name])
            got = predict(rd[name], model)
            got["sharing"] = _sharing(rd[name], fitted, model, got, cores)
            per_round[name].append(got)
    summary = _summary(per_round)
    m0 = models[0]
    result = {
        "mode": "real compute", "cores": cores, "ranks": 4, "rounds": rounds, "smoke": smoke,
        "jobs": jobs, "link_runs": link_jobs or ("stored: results/sim_calibration.json" if fallback else None),
        "links": [{"latency_per_hop_s": lat, "bytes_per_s": bw} for lat, bw in links] if links[0] else None,
        "models": [{"layer_forward_s": list(m.layer_forward_s), "per_microbatch_stage_s": m.per_microbatch_stage_s,
                    "step_overhead_s": m.step_overhead_s,
                    "recovery_s": m.detect_s + m.agree_s + m.communicator_s + m.plan_s} for m in models],
        "per_round": per_round, "summary": summary,
        ("analysis_s" if args.source else "wall_s"): time.perf_counter() - began,
    }
    md = _real_markdown(result, m0)
    print("\n".join(md))
    if smoke or rounds < 5:
        print(f"\n(not written to results/: {'a smoke run' if smoke else f'{rounds} rounds < 5'})")
        return
    write_json(RESULTS / "sim_calibration_real.json", result)
    (RESULTS / "sim_calibration_real.md").write_text("\n".join(md) + "\n")


def _pct(x: float) -> str:
    return f"{100 * x:+.1f} %"


def _real_markdown(result: dict, model) -> list[str]:
    rounds, cores = result["rounds"], result["cores"]
    fit_sets = result["jobs"][REAL_FIT]
    held = [(n, q, v) for n, rows in result["summary"].items() if n != REAL_FIT for q, v in rows.items()]
    abs_err = sorted(abs(v["error"]) for _, _, v in held)
    job = dict(x.split("=", 1) for x in fit_sets)
    md = [f"Simulator vs real runs: real compute (nothing emulated), {result['ranks']} ranks of one thread each on "
          f"{cores} cores, gloo over loopback; a GPT of {job['model.num_blocks']} blocks, "
          f"d_model={job['model.d_model']}, seq_len={job['model.seq_len']}, "
          f"{job['train.num_micro_batches']} micro-batches of {job['train.micro_batch_size']}, {job['train.steps']} steps; "
          "each run SIGKILLs one rank (not the metrics writer) in a backward at step "
          f"{job['elastic.inject'].split('step=')[1].split(',')[0]} and recovers by its policy. "
          f"Medians of {rounds} interleaved rounds; each run's step times are medians over its steps "
          "(before: from step 2 up to the step the recovery resumed at; after: from two steps after it).", "",
          f"Fitted on `{REAL_FIT}` alone (per round, on that round's run): each layer's time is the cost profile "
          "(multiply-adds) scaled so the runtime's 1F1B takes the measured compute; the fixed cost per step and "
          "the recovery's phases are that run's. The link is fitted on the emulated `link fit` runs "
          + ("of each round." if isinstance(result["link_runs"], dict) else
             "stored in results/sim_calibration.json." if result["link_runs"] else
             "-- none: collectives are a fixed cost.")
          + " Every other row is predicted: other policies, other layouts, another width (d_model=160, "
          "carried over by multiply-adds). The fit layout's own row is predicted from another round's fit: "
          "it measures the repeats' noise, not the model.", "",
          f"Model (round 0): {1e3 * sum(model.layer_forward_s):.2f} ms forward of all layers per micro-batch, "
          f"{1e3 * model.step_overhead_s:.1f} ms fixed per step, "
          f"{model.detect_s + model.agree_s + model.communicator_s + model.plan_s:.2f} s recovery to the first step.",
          "", "| run | quantity | predicted | measured (median) | measured min .. max | error "
          "| with processor sharing | error |",
          "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, rows in result["summary"].items():
        for q, v in rows.items():
            share = (f"{v['sharing_predicted']:.3f} | {_pct(v['sharing_error'])}" if "sharing_predicted" in v
                     else "| ")
            md.append(f"| {name} | {q} | {v['predicted']:.3f} | {v['measured']:.3f} | "
                      f"{v['measured_min']:.3f} .. {v['measured_max']:.3f} | {_pct(v['error'])} | {share} |")
    if abs_err:
        md += ["", f"Held-out rows: median |error| {100 * statistics.median(abs_err):.1f} %, largest "
                   f"{100 * abs_err[-1]:.1f} % ({len(abs_err)} predictions)."]
    md += ["", "Errors are signed: predicted / measured - 1. Where they come from:", "",
           f"- CPU contention. {result['ranks']} single-threaded ranks share {cores} cores: while all compute, each "
           f"gets at most {min(1.0, cores / result['ranks']):.2f} of a core, and more as fewer are busy (after a "
           "kill: 3 ranks; drop_replica's idle pipeline: 2; 1F1B's fill and drain). The model's per-rank compute "
           "times are the fit run's, at its all-busy contention: where fewer ranks stay busy it over-predicts the "
           "after-step, the more so the fewer. The `with processor sharing` columns scale compute by "
           "max(1, busy ranks / cores) "
           "relative to the fit run: a check of this explanation, not part of the simulator (it ignores "
           "fill and drain, and the collectives' own CPU).",
           "- Collectives and the fixed cost per step: the link is fitted on emulated runs (cores idle); in real "
           "runs gloo competes with compute, and `reduce` + `gather` include the wait for the holder group's "
           "slowest member. The fixed cost per step (norm, optimizer, snapshots) is the fit layout's, though it "
           "grows with the parameters a rank holds (dp=4 x pp=1 holds the whole model on every rank).",
           "- Another width: time per multiply-add is taken to be the same; wider matrices use the core better.",
           "- MTTR: the recovery's phases (detect, agree, communicator, plan, state) are the fit run's; other "
           "layouts move other state, and the first step after a recovery also pays for new layers' first use.",
           "- Noise: timing on a few cores shared with the OS and the launcher; the min .. max column is the "
           "spread of the rounds' measurements."]
    if result["smoke"]:
        md += ["", "SMOKE RUN: one round, one or two steps in each window -- shows the code path only, "
                   "not a measurement."]
    md += ["", f"Job of the fit run: `{' '.join('--set ' + x for x in fit_sets)}`"]
    return md


if __name__ == "__main__":
    main()
