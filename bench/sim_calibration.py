"""How well the simulator predicts real runs on this machine.

Emulated-compute runs of the runtime (the pipeline benchmark's job: dp=4 x pp=4, one rank
SIGKILLed) under three policies, and one run of another layout (dp=2 x pp=4). The cluster model is
fitted on the elaswave run alone (``elaswave.sim.calibrate.fit``); every run's step time before and
after its recovery, its throughput ratio and its MTTR are then predicted from the plans it ran
(``predict``) and set against what it measured. The fit run's own before-step is fitted, not
predicted; everything else is a prediction.

The link (latency per ring hop, bandwidth) is fitted from the gradient sums and parameter
all-gathers that three failure-free dp=4 runs of different model widths timed (``fit_links``), and
checked on runs it did not see (other widths, deterministic mode's 8-byte sums, two holders); the
16-rank model prices its collectives over it.

    python bench/sim_calibration.py [--keep DIR]      # runs the jobs (keeping their metrics in DIR)
    python bench/sim_calibration.py --from DIR        # only fits and predicts, from kept metrics
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from elaswave.runtime.metrics import read_jsonl
from elaswave.sim.calibrate import fit, fit_links, predict

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from jobs import run_job  # noqa: E402
from pipeline_elastic import JOB  # noqa: E402  the same emulated job

RUNS = {
    "elaswave (fit)": [],
    "drop_replica": ["elastic.policy=drop_replica"],
    "reroute": ["elastic.policy=reroute"],
    "elaswave dp=2 x pp=4": ["parallel.dp=2", "train.num_micro_batches=32", "elastic.inject=kill:rank=1,step=7,phase=backward"],
}

# Collectives big enough for their bytes to show: the whole model on each of 4 holders.
LINK_JOB = ["parallel.dp=4", "parallel.pp=1", "emulate.enabled=true", "emulate.block_forward_ms=5",
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
    args = ap.parse_args()
    records = {}
    if args.source:
        records = {name: read(Path(args.source) / _file(name)) for name in {**RUNS, **LINK_FIT, **LINK_CHECK}}
    else:
        keep = Path(args.keep or tempfile.mkdtemp(prefix="elaswave-calibration-"))
        keep.mkdir(parents=True, exist_ok=True)
        jobs = {**{n: JOB + s for n, s in RUNS.items()}, **{n: LINK_JOB + s for n, s in {**LINK_FIT, **LINK_CHECK}.items()}}
        for name, sets in jobs.items():
            records[name] = run_job(sets, keep / _file(name))
            print(f"  ran {name} -> {keep / _file(name)}", flush=True)
    latency, bandwidth = fit_links([records[name] for name in LINK_FIT])
    model = fit(records["elaswave (fit)"], links=(latency, bandwidth))
    link_model = fit(records[next(iter(LINK_FIT))], links=(latency, bandwidth))
    result = {name: predict(records[name], model) for name in RUNS}
    for name in {**LINK_FIT, **LINK_CHECK}:  # their compute is another model's: only the link is priced
        result[name] = {"collectives_s": predict(records[name], link_model)["collectives_s"]}
    (HERE / "results" / "sim_calibration.json").write_text(json.dumps(
        {"link": {"latency_per_hop_s": latency, "bytes_per_s": bandwidth},
         "model": {"per_microbatch_stage_s": model.per_microbatch_stage_s, "step_overhead_s": model.step_overhead_s,
                   "recovery_s": model.detect_s + model.agree_s + model.communicator_s + model.plan_s},
         "runs": result}, indent=1))
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
    (HERE / "results" / "sim_calibration.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
