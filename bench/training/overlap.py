"""Gradient sums overlapped with the backward (``parallel.overlap_grad_reduce``) and parameter all-gathers
with the next step's forwards (``parallel.overlap_param_gather``): neither, the sums, both -- in one run.

dp=2 x pp=2 (4 processes, gloo on this box's loopback), emulated compute (each layer's forward and
backward a modelled sleep, so the ranks do not contend for the 2 cores) and an emulated link
(``emulate.link_gbps``: each gradient sum also takes a ring all-reduce's time at ``--link-gbps``,
each all-gather a ring all-gather's, counted from when it started, one after another on a rank --
what a data-parallel link at scale costs; the collectives themselves run for real), 1F1B and
interleaved 1F1B (V = 2), a bucket a layer, deterministic mode (the sums are 8-byte integers). Each (schedule,
overlap) runs ``--rounds`` times, in turn; a run's step is the median from step 3, the table the
median over rounds. Every run's ``params_sha256`` is compared: overlap must not change a bit.

What to expect: a rank's sums start when its schedule has made them whole. Under 1F1B that is its
last backward (off or on: the last stage sums while the first still computes), and with a bucket a
layer (``--bucket-numel 1``, the default here) within it, each layer's as the backward passes it
(zero/watch.py): the first stage's lowest layer's sum is what the step waits for; under interleaved
1F1B a rank's chunk 1 is whole a drain before its chunk 0, so with overlap on only chunk 0's sum
is left after the compute. The all-gathers: a
chunk's first forward waits for its own, so under 1F1B the first stage waits for all of its
(nothing gained), under interleaved 1F1B chunk 1's are gathered while chunk 0 computes. Beside
each, the simulator's step (``sim.model.step_time`` with the same two settings) on the same plan,
layers' times and link: one model of the step. Neither has the sends or the per-step costs the
runtime pays, so compare ratios.

    python bench/training/overlap.py [--rounds 3] [--width 256] [--link-gbps 0.05] [--bucket-numel 1]
"""
from __future__ import annotations

import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import bench_args, runs_in_turn, write_results  # noqa: E402
from elaswave import config  # noqa: E402
from elaswave.model.contract import counted_numels, tie_pairs  # noqa: E402
from elaswave.model.registry import model_for  # noqa: E402
from elaswave.pipeline.emulate import layer_forward_s  # noqa: E402
from elaswave.plan.buckets import size_starts  # noqa: E402
from elaswave.plan.plan import initial_plan  # noqa: E402
from elaswave.sim.model import ClusterModel, step_time  # noqa: E402

DP, PP, M, BLOCKS, BLOCK_MS, STEPS = 2, 2, 8, 8, 8.0, 12
SCHEDULES = {"1f1b": 1, "interleaved": 2}


OVERLAPS = {"off": (False, False), "sums": (True, False), "both": (True, True)}
"""What overlaps: (parallel.overlap_grad_reduce, parallel.overlap_param_gather)."""


def job(width: int, name: str, overlap: str, link_gbps: float, bucket_numel: int) -> list[str]:
    sums, gathers = OVERLAPS[overlap]
    return [f"parallel.dp={DP}", f"parallel.pp={PP}", f"parallel.schedule={name}",
            f"parallel.virtual_stages={SCHEDULES[name]}", f"parallel.overlap_grad_reduce={str(sums).lower()}",
            f"parallel.overlap_param_gather={str(gathers).lower()}",
            "emulate.enabled=true", f"emulate.block_forward_ms={BLOCK_MS}", f"emulate.link_gbps={link_gbps}",
            "frequency.planning=false", f"model.d_model={width}", "model.num_heads=4", "model.seq_len=16",
            f"model.num_blocks={BLOCKS}", "train.micro_batch_size=1", f"train.num_micro_batches={M}",
            f"train.steps={STEPS}", "parallel.chunk_numel=65536", f"parallel.bucket_numel={bucket_numel}"]


def predicted(width: int, link_gbps: float, bucket_numel: int) -> dict[str, float]:
    """The simulator's step for each (schedule, overlap) on the runtime's plan and the emulated link
    (8-byte sums, gloo's whole all-reduce)."""
    cfg = config.load(None, job(width, "1f1b", "off", link_gbps, bucket_numel))
    model = model_for(cfg)
    costs = [c.flops_per_token for c in model.layer_costs()]
    cluster = ClusterModel(tuple(layer_forward_s(cfg, model)), cfg.emulate.backward_factor,
                           layer_param_bytes=tuple(4.0 * n for n in counted_numels(model)), gradient_bytes_factor=2.0,
                           reduce_is_all_reduce=True, intra_node_latency_s=0.0,
                           intra_node_bytes_per_s=link_gbps * 1e9)
    out = {}
    for name, v in SCHEDULES.items():
        plan = initial_plan(DP * PP, DP, PP, costs, M, ties=tie_pairs(model), virtual_stages=v,
                            bucket_starts=size_starts(counted_numels(model), bucket_numel))
        for overlap, (sums, gathers) in OVERLAPS.items():
            out[f"{name} {overlap}"] = step_time(plan, replace(cluster, pipeline_schedule=name, overlap_grad_reduce=sums,
                                                               overlap_param_gather=gathers)).step_s
    return out


def main() -> None:
    ap = bench_args(__doc__, out="overlap")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each case, in turn (medians of these)")
    # A sum's real gloo all-reduce takes this box's CPU beside the emulated link's time: at width 512
    # (25 MB of 8-byte sums a block) a 1F1B stage's sums started within its last backward moved that
    # work into its compute and took the gain back (0.999 measured, 0.931 simulated); a quarter of the
    # bytes on a quarter of the link keeps the modelled times.
    ap.add_argument("--width", type=int, default=256, help="model.d_model: how many bytes a stage's sum has")
    ap.add_argument("--link-gbps", type=float, default=0.05, help="emulate.link_gbps: the modelled link's speed")
    ap.add_argument("--bucket-numel", type=int, default=1,
                    help="parallel.bucket_numel (default 1: a bucket a layer, whose sum can start within the "
                         "backward that makes it whole; 0: a bucket a chunk)")
    args = ap.parse_args()
    cases = [(name, overlap) for name in SCHEDULES for overlap in OVERLAPS]
    step_s: dict[str, list[float]] = {f"{n} {o}": [] for n, o in cases}
    reduce_s: dict[str, list[float]] = {k: [] for k in step_s}
    gather_s: dict[str, list[float]] = {k: [] for k in step_s}
    shas: dict[str, set] = {name: set() for name in SCHEDULES}
    failed: list[str] = []
    for k, (name, overlap), run in runs_in_turn(args.rounds, cases,
                                                lambda c: job(args.width, *c, args.link_gbps, args.bucket_numel),
                                                failed, 400, label=" ".join):
        key = f"{name} {overlap}"
        steps = run["steps"][3:]
        step_s[key].append(statistics.median(r["step_time_s"] for r in steps))
        reduce_s[key].append(statistics.median(r["phases_s"]["reduce"] for r in steps))
        gather_s[key].append(statistics.median(r["phases_s"]["gather"] for r in steps))
        shas[name].add(run["sha"])
        print(f"  round {k}: {key}: step {step_s[key][-1]:.3f} s, reduce phase {reduce_s[key][-1]:.3f} s, "
              f"gather phase {gather_s[key][-1]:.3f} s, "
              f"{run['sha'][:12]}", flush=True)
    measured = {k: statistics.median(v) for k, v in step_s.items() if v}
    phases = {k: statistics.median(v) for k, v in reduce_s.items() if v}
    gathers = {k: statistics.median(v) for k, v in gather_s.items() if v}
    model = predicted(args.width, args.link_gbps, args.bucket_numel)
    result = {"rounds": args.rounds, "width": args.width, "link_gbps": args.link_gbps, "bucket_numel": args.bucket_numel,
              "job": job(args.width, "interleaved", "both", args.link_gbps, args.bucket_numel),
              "step_s": step_s, "reduce_phase_s": reduce_s, "gather_phase_s": gather_s, "measured_step_s": measured, "predicted_step_s": model,
              "params_sha256": {n: sorted(s) for n, s in shas.items()}, "failed": failed}
    md = [f"Overlapped gradient sums and parameter all-gathers, emulated compute and a {args.link_gbps} GB/s emulated link, dp={DP} x pp={PP}, "
          f"{M} micro-batches, {BLOCKS} blocks of width {args.width}, parallel.bucket_numel={args.bucket_numel}, deterministic mode (one process a rank on this "
          f"2-core box, gloo); medians of "
          f"{args.rounds} rounds, the cases in turn" + (f"; failed runs, left out: {failed}" if failed else "") + ".",
          "", "| schedule | overlapped | measured step s | rank 0's reduce phase s | rank 0's gather phase s | "
          "simulated step s |", "| --- | --- | --- | --- | --- | --- |"]
    for key in step_s:
        if key in measured:
            name, what = key.split()
            md.append(f"| {name} | {what} | {measured[key]:.3f} | {phases[key]:.3f} | {gathers[key]:.3f} | "
                      f"{model[key]:.3f} |")
    md.append("")
    for name in SCHEDULES:
        off = f"{name} off"
        for what in ("sums", "both"):
            on = f"{name} {what}"
            if on in measured and off in measured:
                md.append(f"- {name}, {what} over off: measured **{measured[on] / measured[off]:.3f}**, simulated "
                          f"{model[on] / model[off]:.3f}.")
        md.append(f"- {name}: params_sha256 of every run: "
                  f"{'one' if len(shas[name]) == 1 else 'DIFFERENT: ' + str(sorted(shas[name]))}.")
    write_results(args.out, result, md)


if __name__ == "__main__":
    main()
