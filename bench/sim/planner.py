"""The planner at cluster scale: time to build the plan and to re-plan after one lost rank, for
96, 10^4 and 10^5 devices (pure functions, one process, no communication).

The model is GPT-3-like (96 blocks of d_model 12288, so 98 layers with the embedding and head,
about 1.8 G parameters per block) with ZeRO chunks of 2^24 elements; dp x pp as given below, the
global batch 4 micro-batches per pipeline. The re-plan loses the middle stage of pipeline 0, so
it re-partitions that pipeline, re-balances every pipeline's micro-batches, re-deals the lost
chunks and plans frequencies. The straggler check is what every rank asks after every step
(``rebalance_gain`` with the default 30 % threshold) when speeds are even.

    python bench/sim/planner.py
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import RESULTS, write_results  # noqa: E402
from elaswave.plan.frequency import PowerModel  # noqa: E402
from elaswave.plan.plan import initial_plan  # noqa: E402
from elaswave.plan.replan import replan  # noqa: E402
from elaswave.plan.rebalance import rebalance_gain  # noqa: E402

LAYOUTS = [(96, 12, 8), (10_000, 625, 16), (100_000, 6_250, 16)]  # devices, dp, pp
D_MODEL, BLOCKS, VOCAB, SEQ = 12288, 96, 50257, 2048
CHUNK = 1 << 24


def layer_profile() -> tuple[list[float], list[int]]:
    block = 12 * D_MODEL * D_MODEL + 13 * D_MODEL
    numels = [VOCAB * D_MODEL] + [block] * BLOCKS + [VOCAB * D_MODEL]
    costs = [float(D_MODEL)] + [float(12 * D_MODEL * D_MODEL + 2 * SEQ * D_MODEL)] * BLOCKS + [float(D_MODEL * VOCAB)]
    return costs, numels


def one(devices: int, dp: int, pp: int) -> dict:
    costs, numels = layer_profile()
    m = 4 * dp
    t0 = time.perf_counter()
    plan = initial_plan(devices, dp, pp, costs, m, numels, CHUNK)
    t1 = time.perf_counter()
    lost = plan.pipelines[0][pp // 2]
    live = [r for r in plan.ranks if r != lost]
    t2 = time.perf_counter()
    model = PowerModel()
    after = replan(plan, live, 1, m, power=model, power_cap_w=model.power(1.0) * devices)
    t3 = time.perf_counter()
    t4 = time.perf_counter()
    gain, _ = rebalance_gain(plan, {r: 1.0 for r in plan.ranks}, m, min_gain=0.3)
    t5 = time.perf_counter()
    chunks = sum(len(row) for row in after.chunk_owners)
    moved = sum(1 for a, b in zip(plan.chunk_owners, after.chunk_owners) for x, y in zip(a, b) if x != y)
    return {"devices": devices, "dp": dp, "pp": pp, "layers": len(costs), "micro_batches": m, "chunks": chunks,
            "initial_plan_s": t1 - t0, "replan_s": t3 - t2, "chunks_moved": moved,
            "straggler_check_s": t5 - t4, "straggler_bound": gain,
            "broken_pipeline_stages": len(after.pipelines[0]),
            "broken_pipeline_levels": list(after.frequencies[0])}


def main() -> None:
    rows = []
    for devices, dp, pp in LAYOUTS:
        rows.append(one(devices, dp, pp))
        r = rows[-1]
        print(f"{devices:>7} devices (dp={dp}, pp={pp}): initial plan {r['initial_plan_s']:.3f} s, "
              f"re-plan after one loss {r['replan_s']:.3f} s ({r['chunks_moved']} of {r['chunks']} chunks move)",
              flush=True)
    md = ["Planner at scale (pure Python, one process, this machine); re-plan = re-partition of the broken "
          "pipeline + micro-batch balance + chunk re-deal + frequency plan.", "",
          "| devices | dp x pp | chunks | initial plan (s) | re-plan after one loss (s) | chunks moved | "
          "straggler check per step (s) |",
          "| --- | --- | --- | --- | --- | --- | --- |"]
    md += [f"| {r['devices']} | {r['dp']} x {r['pp']} | {r['chunks']} | {r['initial_plan_s']:.3f} | "
           f"{r['replan_s']:.3f} | {r['chunks_moved']} | {r['straggler_check_s']:.4f} |" for r in rows]
    write_results(RESULTS / "planner", rows, md)


if __name__ == "__main__":
    main()
