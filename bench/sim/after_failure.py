"""One failure at 1,024 and 16,384 GPUs on Llama 3's layout: every policy's after / before (issue 53, item 6).

Llama 3 70B and 405B at TP 8 x PP 16 (H100 preset, sustained clocks, 80 GiB, the planner's
recomputation: ``--checkpointing auto``), 16 sequences of 8,192 tokens a pipeline a step (16 M
tokens at 16,384 GPUs), one device lost at 360 s of an hour. Each schedule in turn is every
policy's failure-free schedule (1F1B; interleaved V = 4, Llama 3's, the fastest that fits;
ZB-H1), so the rows compare recoveries, not schedules. ``after/before``: tokens per second after the failure
over before (drop_replica trains a smaller batch after it; every other row keeps the batch);
``ETTR``: the hour's effective training time. reroute (ReCycle) is priced at its routes' lower
bound (a perfect bubble-filling schedule), with interleaved pipelines each lost chunk on the next
host in turn (as the runtime's ``elastic.policy=reroute`` runs it); ``reroute_runtime``, the same
routes priced by the routed schedule that ``elastic.policy=reroute`` runs (what a rerouted job
reaches here, not a bound); restart pays 300 s of restart.

    python bench/sim/after_failure.py
"""
from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import bench_args, write_results  # noqa: E402
from elaswave import cli  # noqa: E402

MODELS = ("llama3-70b", "llama3-405b")
GPUS = (1024, 16384)
SCHEDULES = {"1F1B": ["--schedule", "1f1b"], "interleaved V=4": ["--schedule", "interleaved", "--virtual-stages", "4"],
             "ZB-H1": ["--schedule", "zb-h1"]}
POLICIES = ("elaswave_no_dvfs", "templates", "drop_replica", "restart", "reroute", "reroute_runtime")


class DoesNotFit(Exception):
    """The layout's every plan is over the device's memory (the simulator's own refusal)."""


def run(model: str, gpus: int, schedule: list[str]) -> dict:
    argv = ["simulate", "--json", "--devices", str(gpus), "--tp", "8", "--pp", "16", "--model", model,
            "--hardware", "h100", "--clocks", "sustained", "--checkpointing", "auto",
            "--micro-batches", str(gpus // 8), "--policies", ",".join(POLICIES), *schedule]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    if code:
        if "is too small" in err.getvalue():
            raise DoesNotFit(err.getvalue().split("needs ")[1].split(" a GPU")[0])
        raise RuntimeError(f"elaswave {' '.join(argv)} exited {code}: {err.getvalue().strip()}")
    return json.loads(out.getvalue())


def _cell(result: dict | None) -> str:
    """A policy's after/before; where it found no layout within the memory (the planner's refusal:
    reroute's hosts over 80 GiB with their guests), it stalls until a repair, and the cell says so."""
    if result is None:
        return "-"
    if result["stalls"] and not result["throughput_after_over_before"]:
        return "no layout fits (stalls)"
    return f"{result['throughput_after_over_before']:.3f}"


def main() -> int:
    args = bench_args(__doc__, out="after_failure").parse_args()
    rows, doc = [], {}
    for model in MODELS:
        for gpus in GPUS:
            for name, schedule in SCHEDULES.items():
                try:
                    res = run(model, gpus, schedule)
                except DoesNotFit as exc:
                    rows.append(f"| {model} | {gpus:,} | {name} | does not fit 80 GiB: {exc} |"
                                + " |" * (len(POLICIES) + 2))
                    continue
                doc[f"{model} {gpus} {name}"] = res
                pol = res["policies"]
                ratio = {p: pol[p]["throughput_after_over_before"] for p in pol}
                best = max(v for p, v in ratio.items() if p != "elaswave_no_dvfs")
                rows.append(f"| {model} | {gpus:,} | {name} | {res['config']['failure_free']['step_s']:.2f} | "
                            + " | ".join(_cell(pol.get(p)) for p in POLICIES)
                            + f" | {ratio['elaswave_no_dvfs'] / best:.3f} | {pol['elaswave_no_dvfs']['ettr']:.4f} |")
    lines = ["| model | GPUs | schedule | step s before | " + " | ".join(POLICIES)
             + " | elaswave over the best baseline | elaswave ETTR |",
             "| --- " * (len(POLICIES) + 6) + "|", *rows]
    write_results(args.out, doc, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
