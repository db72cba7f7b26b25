"""How well the simulator predicts real runs on this machine.

Emulated-compute runs of the runtime (the pipeline benchmark's job: dp=4 x pp=4, one rank
SIGKILLed) under three policies, and one run of another layout (dp=2 x pp=4). The cluster model is
fitted on the elaswave run alone (``elaswave.sim.calibrate.fit``); every run's step time before and
after its recovery, its throughput ratio and its MTTR are then predicted from the plans it ran
(``predict``) and set against what it measured. The fit run's own before-step is fitted, not
predicted; everything else is a prediction.

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
from elaswave.sim.calibrate import fit, predict

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
        records = {name: read(Path(args.source) / _file(name)) for name in RUNS}
    else:
        keep = Path(args.keep or tempfile.mkdtemp(prefix="elaswave-calibration-"))
        keep.mkdir(parents=True, exist_ok=True)
        for name, sets in RUNS.items():
            records[name] = run_job(JOB + sets, keep / _file(name))
            print(f"  ran {name} -> {keep / _file(name)}", flush=True)
    model = fit(records["elaswave (fit)"])
    result = {name: predict(recs, model) for name, recs in records.items()}
    (HERE / "results" / "sim_calibration.json").write_text(json.dumps(
        {"model": {"per_microbatch_stage_s": model.per_microbatch_stage_s, "step_overhead_s": model.step_overhead_s,
                   "recovery_s": model.detect_s + model.agree_s + model.communicator_s + model.plan_s},
         "runs": result}, indent=1))
    md = ["Simulator vs real runs (emulated compute, 2-core CPU box, gloo); model fitted on the first run only.", "",
          "| run | quantity | predicted | measured | error |", "| --- | --- | --- | --- | --- |"]
    for name, rows in result.items():
        for key, v in rows.items():
            md.append(f"| {name} | {key} | {v['predicted']:.3f} | {v['measured']:.3f} | {100 * v['error']:+.1f} % |")
    (HERE / "results" / "sim_calibration.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
