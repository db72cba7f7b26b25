"""Expert parallelism (``parallel.ep``) against experts on every rank, in one run: step time, the
all-to-all bytes each rank sent against the simulator's price (``sim/experts.exchange_bytes``),
and ``params_sha256`` (the placement must not change a bit).

dp=2 x pp=1 (2 processes, gloo on this box's loopback), a Llama-shaped mixture of experts (8 experts
a block, top 2), real compute, deterministic mode. Each degree runs ``--rounds`` times, in turn;
a run's step is the median from step 3, the table the median over rounds.

What to expect here: both degrees compute the same expert products (dropless routing: at ep=1 a
rank runs every expert on its own tokens, at ep=2 its experts on both ranks' tokens), so ep=2
adds the exchanges and gains nothing on time. At ep=2 a rank holds only the experts it owns
(their values, gradient sums and optimizer state: plan/experts.py), so its memory falls: each
rank's values held and its measured peak in step 3, against the memory model's prediction.

    python bench/training/experts.py [--rounds 3]
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import bench_args, runs_in_turn, write_results  # noqa: E402
from elaswave.sim.experts import exchange_bytes  # noqa: E402

DP, M, MBS, SEQ, WIDTH, BLOCKS, EXPERTS, TOP_K, STEPS = 2, 8, 4, 64, 128, 4, 8, 2, 10


def job(ep: int) -> list[str]:
    return [f"parallel.dp={DP}", "parallel.pp=1", f"parallel.ep={ep}", f"model.d_model={WIDTH}", "model.num_heads=4",
            f"model.seq_len={SEQ}", f"model.num_blocks={BLOCKS}", f"model.num_experts={EXPERTS}",
            f"model.experts_per_token={TOP_K}", f"model.expert_ffn_dim={2 * WIDTH}", "model.moe_aux_loss_coef=0.01",
            f"train.micro_batch_size={MBS}", f"train.num_micro_batches={M}", f"train.steps={STEPS}",
            "frequency.planning=false", "elastic.straggler_gain=0", "train.measure_memory_step=3"]


def main() -> None:
    ap = bench_args(__doc__, out="experts")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each degree, in turn (medians of these)")
    args = ap.parse_args()
    degrees = [1, 2]
    step_s: dict[int, list[float]] = {ep: [] for ep in degrees}
    sent: dict[int, list[float]] = {ep: [] for ep in degrees}
    memory: dict[int, list[dict]] = {ep: [] for ep in degrees}
    shas, failed = set(), []
    for k, ep, run in runs_in_turn(args.rounds, degrees, job, failed, 600, label=lambda ep: f"ep={ep}"):
        step_s[ep].append(statistics.median(r["step_time_s"] for r in run["steps"][3:]))
        ranks = (run["memory"] or {}).get("memory_measured_per_rank") or []
        memory[ep].append({"held_values": max(m["held_values"] for m in ranks),
                           "peak_bytes": max(m["peak_bytes"] for m in ranks),
                           "predicted_over_measured": [m["predicted"]["total"] / m["peak_bytes"] for m in ranks]})
        sent[ep].append(statistics.mean(r.get("expert_bytes", 0) for r in run["steps"]))
        shas.add(run["sha"])
        print(f"  round {k}: ep={ep}: step {step_s[ep][-1]:.3f} s, {sent[ep][-1]:.0f} B sent a step, "
              f"{run['sha'][:12]}", flush=True)
    measured = {ep: statistics.median(v) for ep, v in step_s.items() if v}
    bytes_ = {ep: statistics.median(v) for ep, v in sent.items() if v}
    priced = exchange_bytes(M * MBS * SEQ // DP, TOP_K, WIDTH, 4, DP, BLOCKS)
    held = {ep: statistics.median(m["held_values"] for m in v) for ep, v in memory.items() if v}
    peak = {ep: statistics.median(m["peak_bytes"] for m in v) for ep, v in memory.items() if v}
    fit = {ep: [r for m in v for r in m["predicted_over_measured"]] for ep, v in memory.items() if v}
    result = {"rounds": args.rounds, "job": job(2), "step_s": step_s, "expert_bytes": sent, "measured_step_s": measured,
              "memory": memory,
              "priced_bytes": priced, "params_sha256": sorted(shas), "failed": failed}
    md = [f"Expert parallelism, dp={DP} x pp=1, {BLOCKS} MoE blocks of width {WIDTH} ({EXPERTS} experts, top {TOP_K}), "
          f"{M} micro-batches of {MBS} x {SEQ} tokens, real compute, deterministic mode (one process a rank on this "
          f"2-core box, gloo); medians of {args.rounds} rounds, the degrees in turn"
          + (f"; failed runs, left out: {failed}" if failed else "") + ".",
          "", "| parallel.ep | step s | all-to-all bytes a rank sent a step | priced (balanced router) "
          "| values a rank holds | peak MiB (step 3, the larger rank) | predicted / measured peak |",
          "| --- | --- | --- | --- | --- | --- | --- |"]
    for ep in degrees:
        if ep in measured:
            md.append(f"| {ep} | {measured[ep]:.3f} | {bytes_[ep]:.0f} | {priced if ep > 1 else 0:.0f} "
                      f"| {held[ep]:,.0f} | {peak[ep] / 2 ** 20:.1f} | {min(fit[ep]):.2f}-{max(fit[ep]):.2f} |")
    md.append("")
    if 1 in measured and 2 in measured:
        md.append(f"- ep=2 over ep=1: step **{measured[2] / measured[1]:.3f}**; bytes measured over priced "
                  f"**{bytes_[2] / priced:.3f}**; values held **{held[2] / held[1]:.3f}**, measured peak "
                  f"**{peak[2] / peak[1]:.3f}**.")
    md.append(f"- params_sha256 of every run: {'one' if len(shas) == 1 else 'DIFFERENT: ' + str(sorted(shas))}.")
    write_results(args.out, result, md)


if __name__ == "__main__":
    main()
