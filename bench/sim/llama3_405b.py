"""The simulator's failure-free step against Llama 3 405B's published throughput (issue 36, item 4).

Meta trained Llama 3 405B on up to 16,384 H100s at 8 x 16 x DP (TP x PP x DP), 8,192-token
sequences, 16 M tokens a step, at 430 (8,192 GPUs) and 400 (16,384 GPUs) BF16 TFLOP/s per GPU
("The Llama 3 Herd of Models", arXiv:2407.21783, table 4). This runs ``elaswave simulate`` on
the same layouts with the sourced H100 preset (``--hardware h100``: elaswave/sim/workload.py; no
figure in it is fitted to this run) and no clock planning, once for each pipeline schedule the
runtime runs (``--schedule 1f1b`` and ``zb-h1``), and puts its model TFLOP/s per GPU beside the
published one, with bounds that say where the difference sits:

- *compute*: the step's FLOPs at the preset's sustained share of the peak on every GPU, nothing else;
- *1F1B* and *ZB-H1*: that, stretched by the schedule's fill and drain on p even stages, timed here
  by ``pipeline.schedule.makespan`` of the schedules' own action lists (not the simulator's
  output): (m + p - 1) / m for 1F1B; (m + (p - 1) / 3) / m for ZB-H1 with W as long as B
  (``BACKWARD_INPUT_SHARE``, the modelling assumption: the ZB-H1 paper's bubble (p - 1)(F + B - W)).

ZB-H1 here is the runtime's schedule priced by the simulator (the runtime runs it with TP > 1 and
the sequence cut, tests/runtime/test_tensor_parallel.py); it keeps p micro-batches' activations on every stage until their W,
so at 80 GiB it may not fit where 1F1B does (then its row says what it needs). The first two tables
recompute nothing; the third tries every recomputation the runtime runs
(train.activation_checkpointing: selective, every_N, full, and auto -- the planner's choice of the
fewest blocks each GPU must recompute to fit, plan/recompute.py) on each schedule, priced in
memory and in time (each backward runs again what it recomputes), and keeps the fastest plan that
fits.

Llama 3 ran an interleaved schedule: a second table prices the runtime's interleaved 1F1B
(``--schedule interleaved --virtual-stages V``, V = 2 and 4: 32 and 64 chunks of the model's 128
layers, 126 blocks with the embedding and the head) on the planner's p x V chunks, with its
*interleaved* bound (fill and drain (p - 1) / (V m) on even chunks, by ``makespan`` of the
``interleaved_1f1b`` action lists). The planner splits chunks by cost alone, so a plan either fits
80 GiB as split (its modelled peak, plan/memory.rank_bytes, checked against the limit after) or
its row says what it needs; the runtime runs interleaved with TP and the sequence cut (on CPU
gloo here). Overlapped communication is not modelled.

    python bench/sim/llama3_405b.py
"""
from __future__ import annotations

import contextlib
import io
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import RESULTS, bench_args, write_results  # noqa: E402
from elaswave import cli  # noqa: E402
from elaswave.pipeline.schedule import interleaved_1f1b, makespan, one_f_one_b, zb_h1  # noqa: E402
from elaswave.sim.workload import HARDWARE, MODELS, model_flops_per_micro_batch  # noqa: E402

TOKENS_PER_STEP = 16 * 2 ** 20
ROWS = ((8192, 64, 430.0), (16384, 128, 400.0))
"""(GPUs, DP, published TFLOP/s per GPU) at TP 8, PP 16, 8,192-token sequences (table 4)."""
TP, PP = 8, 16
SCHEDULES = {"1f1b": one_f_one_b, "zb-h1": zb_h1}
VIRTUAL_STAGES = (2, 4)
"""Interleaved 1F1B's model chunks a GPU (PP x V chunks, at least a layer each: V <= 8 here)."""
CHECKPOINTING = ("none", "selective", "every_4", "every_3", "every_2", "full", "auto")
"""What the runtime recomputes (train.activation_checkpointing), each priced: its memory and the
time each backward spends running it again."""
VARIANTS = {"1F1B": ("1f1b",), "ZB-H1": ("zb-h1",),
            **{f"interleaved V={v}": ("interleaved", "--virtual-stages", str(v)) for v in VIRTUAL_STAGES}}


def simulate(argv: list[str]) -> tuple[dict | None, str]:
    """``elaswave simulate --json`` in this process: (its JSON, "") or (None, its one-line error)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["simulate", "--json", *argv])
    if code == 0:
        return json.loads(out.getvalue()), ""
    if code == 2 and "is too small" in err.getvalue():  # does not fit: say what it needs
        return None, err.getvalue().strip()
    raise RuntimeError(f"elaswave simulate {' '.join(argv)} exited {code}: {err.getvalue().strip()}")


def schedule_bound_s(schedule: str, compute_s: float, m: int, num_chunks: int = 1) -> float:
    """``compute_s`` through ``schedule``'s fill and drain on PP even stages: its action lists timed
    by ``makespan``, each stage ``compute_s / m`` a micro-batch (forward : backward 1 : 2, B = W);
    ``num_chunks`` > 1: interleaved 1F1B with each stage's time split evenly over its chunks."""
    stage = compute_s / m
    if num_chunks > 1:
        return makespan([interleaved_1f1b(s, PP, num_chunks, range(m)) for s in range(PP)],
                        [stage / num_chunks] * (PP * num_chunks), 2.0)
    return makespan([SCHEDULES[schedule](s, PP, range(m)) for s in range(PP)], [stage] * PP, 2.0)


def row(gpus: int, dp: int, published: float) -> dict:
    model, hw = MODELS["llama3-405b"], HARDWARE["h100"]
    sequences = TOKENS_PER_STEP // model.seq_len

    def run(schedule: str, *more: str) -> tuple[dict | None, str]:
        return simulate(["--devices", str(gpus), "--tp", str(TP), "--dp", str(dp), "--pp", str(PP), "--model",
                         "llama3-405b", "--micro-batches", str(sequences), "--hardware", "h100", "--no-dvfs",
                         "--policies", "elaswave_no_dvfs", "--schedule", schedule, *more])
    m = sequences // dp
    flops = sequences * model_flops_per_micro_batch(model, 1)
    compute_s = flops / gpus / (hw.device_tflops * 1e12 * hw.efficiency)
    one_f_one_b_bound = compute_s * (m + PP - 1) / m
    assert abs(schedule_bound_s("1f1b", compute_s, m) / one_f_one_b_bound - 1) < 1e-9  # the timing is the formula
    out = {"gpus": gpus, "tp": TP, "pp": PP, "dp": dp, "micro_batches_per_pipeline": m,
           "published_tflops_per_gpu": published, "compute_bound_s": compute_s,
           "one_f_one_b_bound_s": one_f_one_b_bound, "zb_h1_bound_s": schedule_bound_s("zb-h1", compute_s, m),
           "published_step_s": flops / gpus / (published * 1e12), "device_gib": 80.0}

    def measured(schedule: str, *more: str) -> tuple[dict, dict | None]:
        """The schedule's figures at 80 GiB and without a memory limit, and its 80 GiB JSON (None: no fit)."""
        (doc, why), (unlimited, _) = run(schedule, *more), run(schedule, *more, "--device-gib", "0")
        free = doc["config"]["failure_free"] if doc else None
        return {"fits": doc is not None, "why_not": why or None,
                "needs_gib": float(re.search(r"needs ([0-9.]+) GiB", why).group(1)) if why else None,
                "simulated_tflops_per_gpu": free and free["model_tflops_per_gpu"],
                "simulated_over_published": free and free["model_tflops_per_gpu"] / published,
                "step_s": free and free["step_s"], "mfu": free and free["mfu"],
                "step_without_memory_limit_s": unlimited["config"]["failure_free"]["step_s"],
                "tflops_without_memory_limit": unlimited["config"]["failure_free"]["model_tflops_per_gpu"]}, doc

    for schedule in SCHEDULES:
        figures, _ = measured(schedule)
        if schedule == "1f1b":  # the columns this table had before it had a schedule column
            out.update({k: v for k, v in figures.items() if k not in ("fits", "why_not", "needs_gib")})
        out[schedule] = figures
    for v in VIRTUAL_STAGES:
        figures, doc = measured("interleaved", "--virtual-stages", str(v))
        config = doc["config"] if doc else {}
        bound = schedule_bound_s("interleaved", compute_s, m, v)
        assert abs(bound / (compute_s * (m + (PP - 1) / v) / m) - 1) < 1e-9  # Megatron's bubble, (p - 1) / (V m)
        out[f"interleaved-v{v}"] = {**figures, "virtual_stages": v, "bound_s": bound,
                                    "peak_gib": config.get("peak_gib"),
                                    "peak_gib_after_first_failure": config.get("peak_gib_after_first_failure")}
    out["recomputation"] = {label: best_recomputation(run, published, *args) for label, args in VARIANTS.items()}
    return out


def best_recomputation(run, published: float, *schedule: str) -> dict:
    """Every recomputation of ``CHECKPOINTING`` for one schedule at 80 GiB, and the fastest that fits."""
    tried = {}
    for kind in CHECKPOINTING:
        doc, why = run(*schedule, "--checkpointing", kind)
        free = doc["config"]["failure_free"] if doc else None
        tried[kind] = ({"fits": True, "tflops_per_gpu": free["model_tflops_per_gpu"], "step_s": free["step_s"],
                        "peak_gib": doc["config"]["peak_gib"]} if doc else
                       {"fits": False, "needs_gib": float(re.search(r"needs ([0-9.]+) GiB", why).group(1))})
    fitting = [k for k in CHECKPOINTING if tried[k]["fits"]]
    best = max(fitting, key=lambda k: tried[k]["tflops_per_gpu"], default=None)
    return {"tried": tried, "best": best,
            "over_published": tried[best]["tflops_per_gpu"] / published if best else None}


def _fitted(figures: dict, key: str, fmt: str) -> str:
    """A figure at 80 GiB; where the plan does not fit, what it would need (in the throughput's column)."""
    if figures["fits"]:
        return format(figures[key], fmt)
    return f"does not fit: needs {figures['needs_gib']:.0f} GiB" if key == "simulated_tflops_per_gpu" else "-"


def main() -> None:
    args = bench_args(__doc__, out="llama3_405b").parse_args()
    rows = [row(*r) for r in ROWS]
    lines = ["| GPUs | TP x PP x DP | micro-batches a pipeline | published TFLOP/s/GPU | 1F1B: simulated (80 GiB) | "
             "simulated / published | simulated, no memory limit | ZB-H1: simulated (80 GiB) | simulated / published | "
             "simulated, no memory limit | no memory limit / published | step s: 1F1B simulated (80 GiB) | "
             "1F1B no memory limit | ZB-H1 (80 GiB) | ZB-H1 no memory limit | 1F1B bound | ZB-H1 bound | "
             "compute bound | published |",
             "|" + "---|" * 19]
    for r in rows:
        one, zb = r["1f1b"], r["zb-h1"]
        lines.append(f"| {r['gpus']:,} | {r['tp']} x {r['pp']} x {r['dp']} | {r['micro_batches_per_pipeline']} | "
                     f"{r['published_tflops_per_gpu']:.0f} | {_fitted(one, 'simulated_tflops_per_gpu', '.0f')} | "
                     f"{_fitted(one, 'simulated_over_published', '.2f')} | {one['tflops_without_memory_limit']:.0f} | "
                     f"{_fitted(zb, 'simulated_tflops_per_gpu', '.0f')} | {_fitted(zb, 'simulated_over_published', '.2f')} | "
                     f"{zb['tflops_without_memory_limit']:.0f} | "
                     f"{zb['tflops_without_memory_limit'] / r['published_tflops_per_gpu']:.2f} | "
                     f"{_fitted(one, 'step_s', '.2f')} | {one['step_without_memory_limit_s']:.2f} | "
                     f"{_fitted(zb, 'step_s', '.2f')} | {zb['step_without_memory_limit_s']:.2f} | "
                     f"{r['one_f_one_b_bound_s']:.2f} | {r['zb_h1_bound_s']:.2f} | {r['compute_bound_s']:.2f} | "
                     f"{r['published_step_s']:.2f} |")
    lines += ["", "| GPUs | TP x PP x DP | V (chunks a GPU) | micro-batches a pipeline | published TFLOP/s/GPU | "
              "interleaved: simulated (80 GiB) | simulated / published | modelled peak + 8 GiB reserve, GiB | "
              "after the first failure | simulated, no memory limit | no memory limit / published | "
              "step s: simulated (80 GiB) | no memory limit | interleaved bound | 1F1B bound | published |",
              "|" + "---|" * 16]
    for r in rows:
        for v in VIRTUAL_STAGES:
            il = r[f"interleaved-v{v}"]
            peak = f"{il['peak_gib'] + 8:.1f}" if il["fits"] else f"{il['needs_gib']:.1f}"
            after = f"{il['peak_gib_after_first_failure'] + 8:.1f}" if il["peak_gib_after_first_failure"] else "-"
            lines.append(f"| {r['gpus']:,} | {r['tp']} x {r['pp']} x {r['dp']} | {v} | "
                         f"{r['micro_batches_per_pipeline']} | {r['published_tflops_per_gpu']:.0f} | {_fitted(il, 'simulated_tflops_per_gpu', '.0f')} | "
                         f"{_fitted(il, 'simulated_over_published', '.2f')} | {peak} | {after} | "
                         f"{il['tflops_without_memory_limit']:.0f} | "
                         f"{il['tflops_without_memory_limit'] / r['published_tflops_per_gpu']:.2f} | "
                         f"{_fitted(il, 'step_s', '.2f')} | {il['step_without_memory_limit_s']:.2f} | "
                         f"{il['bound_s']:.2f} | {r['one_f_one_b_bound_s']:.2f} | {r['published_step_s']:.2f} |")
    lines += ["", "| GPUs | TP x PP x DP | schedule | " + " | ".join(CHECKPOINTING) + " | fastest that fits | "
              "TFLOP/s/GPU | / published |", "|" + "---|" * (6 + len(CHECKPOINTING))]
    for r in rows:
        for label, rc in r["recomputation"].items():
            cells = [f"{t['tflops_per_gpu']:.0f} ({t['peak_gib'] + 8:.0f} GiB)" if t["fits"]
                     else f"needs {t['needs_gib']:.0f} GiB" for t in rc["tried"].values()]
            best = rc["best"]
            lines.append(f"| {r['gpus']:,} | {r['tp']} x {r['pp']} x {r['dp']} | {label} | " + " | ".join(cells) + " | "
                         + (f"{best} | {rc['tried'][best]['tflops_per_gpu']:.0f} | {rc['over_published']:.2f} |"
                            if best else "none | - | - |"))
    doc = {"rows": rows, "assumptions": "ZB-H1: the runtime's schedule (pipeline/schedule.zb_h1) priced by the "
           "simulator, W as long as B (input_share 0.5); the runtime refuses it with TP > 1 today. Interleaved: the "
           "runtime's interleaved 1F1B on the planner's p x V chunks (split by cost alone; the plan's modelled peak "
           "checked against 80 GiB after). Not modelled: "
           "overlap. Recomputation: each backward runs again what is recomputed (a block's forward and its TP "
           "collectives; selective: the attention core), priced by the simulator since 2026-11-29 session 44."}
    write_results(Path(args.out) if args.out else RESULTS / "llama3_405b", doc, lines)


if __name__ == "__main__":
    main()
