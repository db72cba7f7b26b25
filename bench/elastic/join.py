"""A join's time to its first productive step, with phases: a warm spare and a cold replacement
after a SIGKILL, and an extra rank.

dp=2 x pp=2, tiny model, gloo on this host. *spare*: rank 3 is SIGKILLed at step 5 and a warm
spare standing by since the job started (``elastic.spares=1``) is promoted; *replacement*: the
same kill, and the launcher starts a new process at once (``elastic.respawn_after_s=0``); *extra*:
one rank is started at step 5 with nobody lost. For the two after a kill, the time from the
SIGKILL to the end of the joiner's first step (the kill's time is the recovery's first step's end
less its MTTR, which runs from the kill). From the ``join`` record of each run: the time from the joiner's
process start to the end of its first step, split into start-up (Python, torch, data: before the
request), admission (request to the step boundary where the leader admitted it), the boundary
(members finishing that step), agree, communicator, plan, state (chunks and layers moved) and the
first step; and the time from the request alone. Medians over ``--runs``. ``--default-job``: the
README's default job instead (``elaswave run`` as shipped: the tiny Llama, dp=2 x pp=2), with
the same kill; ``--modes`` picks which joins to run.

    python bench/elastic/join.py --runs 5
    python bench/elastic/join.py --runs 5 --default-job --modes spare,replacement
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import RESULTS, bench_args, run_job, write_results  # noqa: E402

JOB = ["parallel.dp=2", "parallel.pp=2", "model.d_model=32", "model.num_heads=2", "model.seq_len=32",
       "model.num_blocks=4", "train.micro_batch_size=2", "train.num_micro_batches=6", "train.steps=300",
       "data.max_corpus_bytes=200000", "parallel.timeout_s=60"]
DEFAULT_JOB = ["train.steps=300", "parallel.timeout_s=60"]
MODES = {"spare": ["elastic.inject=kill:rank=3,step=5", "elastic.spares=1"],
         "replacement": ["elastic.inject=kill:rank=3,step=5", "elastic.respawn_after_s=0"],
         "extra": ["elastic.inject=join:step=5"]}


def main() -> None:
    ap = bench_args(__doc__, runs=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--default-job", action="store_true", help="the README's default job instead of the tiny one")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        raise SystemExit(f"--modes={args.modes} is invalid: choose from {', '.join(MODES)}")
    job, what = (DEFAULT_JOB, "the README's default job (tiny Llama)") if args.default_job else (JOB, "tiny model")
    args.out = args.out or str(RESULTS / ("join_default_job" if args.default_job else "join"))
    joins: dict[str, list[dict]] = {m: [] for m in modes}
    for i in range(args.runs):
        for mode in modes:  # interleaved, so drift on the box hits both alike
            records = run_job(job + MODES[mode])
            (join,) = [r for r in records if r["event"] == "join"]
            join["from_kill_s"] = _from_kill(records, join)
            joins[mode].append(join)
            print(f"run {i} {mode}: {join['time_to_first_step_s']:.2f} s from process start (a spare: its "
                  f"promotion), {join['since_request_s']:.2f} s from the request, {join['from_kill_s']} s from the kill",
                  flush=True)
    result = {}
    for mode, js in joins.items():
        phases = {p: statistics.median(j["phases_s"][p] for j in js) for p in js[0]["phases_s"]}
        kills = [j["from_kill_s"] for j in js if j["from_kill_s"] is not None]
        result[mode] = {"runs": len(js), "time_to_first_step_s": statistics.median(j["time_to_first_step_s"] for j in js),
                        "from_kill_s": statistics.median(kills) if kills else None,
                        "from_kill_range_s": [min(kills), max(kills)] if kills else None,
                        "since_request_s": statistics.median(j["since_request_s"] for j in js),
                        "phases_s": phases, "each_s": [j["time_to_first_step_s"] for j in js]}
    names = list(result[modes[0]]["phases_s"])
    flags = (" --default-job" if args.default_job else "") + ("" if modes == list(MODES) else f" --modes {','.join(modes)}")
    lines = ["# Join: time to the first productive step", "",
             f"`python bench/elastic/join.py --runs {args.runs}{flags}`; dp=2 x pp=2, {what}, gloo, 2-core box. Medians "
             "(range). A spare's start-up is its promotion to its request: it started with the job.", "",
             "| join | from the SIGKILL | from process start | from its request | " + " | ".join(names) + " |",
             "| --- | --- | --- | --- | " + " | ".join("---" for _ in names) + " |"]
    for mode, r in result.items():
        kill = (f"{r['from_kill_s']:.3f} s ({r['from_kill_range_s'][0]:.3f}-{r['from_kill_range_s'][1]:.3f})"
                if r["from_kill_s"] is not None else "-")
        lines.append(f"| {mode} | {kill} | {r['time_to_first_step_s']:.3f} s | {r['since_request_s']:.3f} s | "
                     + " | ".join(f"{1000 * r['phases_s'][p]:.1f} ms" for p in names) + " |")
    write_results(args.out, result, lines)


def _from_kill(records: list[dict], join: dict) -> float | None:
    """SIGKILL to the end of the joiner's first step, or None with nobody killed."""
    recs = [r for r in records if r["event"] == "recovery"]
    if not recs:
        return None
    end = {r["step"]: r["wall_time"] for r in records if r["event"] == "step"}
    killed_wall = end[recs[0]["resume_step"]] - recs[0]["mttr_s"]
    return round(end[join["resume_step"]] - killed_wall, 3)


if __name__ == "__main__":
    main()
