"""A node lost under Slurm, measured on a real Slurm cluster here (issue 56).

    python bench/faults/slurm_node_loss.py [--runs 3] [--cases node,first_node,spare] [--steps 120]

Each run starts a fresh cluster (``tests/helpers/slurm.py``: slurmctld and four slurmd nodes, each
a network-namespace host), submits ``examples/slurm/train.sbatch`` on n1-n3 (dp=3 x pp=2, two
ranks a node, the tests' tiny Llama, emulated compute: 10 ms a block, sleeps), and SIGKILLs a
whole node -- its slurmd and every process on it -- after step 5:

- ``node``: n3. Then ``examples/slurm/join.sbatch`` on n4 brings two ranks in.
- ``first_node``: n1, which runs the batch script and holds the job's store. Then join.sbatch on n4
  (it finds the moved store through the other nodes); the job is ended by the first node left.
- ``spare``: n3, the job submitted on n1-n4 with ``--spare-nodes 1``: n4's ranks stand by and fill in.
- ``first_node_spare``: n1 of that job: the spare host follows the moved store and fills in.

Measured per run: the seconds from the kill to the first step without the node (from the metrics'
wall times), the recovery record's MTTR and phases, Slurm's job state once the survivors train,
the seconds from submitting the join (``node``, ``first_node``) or from the kill (``spare``) to
the first step at full size again, and the job's final state and exit code, and ``sacct``'s.
Bit-identity against the reference is the tests' (``tests/control/test_slurm.py``); here it is reported, not asserted.
Results: ``bench/results/slurm_node_loss.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common, tests.helpers
from bench.common import RESULTS, write_results  # noqa: E402
from tests.helpers import slurm as cluster  # noqa: E402
from tests.helpers.spawn import TINY, run_reference  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "slurm"
KILL_AFTER = 5
KILLED = {"node": "n3", "first_node": "n1", "spare": "n3", "first_node_spare": "n1"}


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _steps(folder: Path) -> list[dict]:
    """Every node's step records, the newest of each step (a host that took over writes its own file)."""
    by_step: dict[int, dict] = {}
    for path in sorted(folder.glob("m-*.jsonl")):
        for r in _records(path):
            if r["event"] == "step" and (r["step"] not in by_step or r["wall_time"] > by_step[r["step"]]["wall_time"]):
                by_step[r["step"]] = r
    return [by_step[k] for k in sorted(by_step)]


def _events(folder: Path, event: str) -> list[dict]:
    return [r for path in sorted(folder.glob("m-*.jsonl")) for r in _records(path) if r["event"] == event]


def one_run(case: str, steps: int, reference_losses: list[float]) -> dict:
    folder = Path(tempfile.mkdtemp(prefix=f"slurm-{case}-"))
    sets = [*TINY, "parallel.dp=3", "parallel.pp=2", f"train.steps={steps}", "train.num_micro_batches=6",
            "train.deterministic=true", "elastic.respawn_after_s=-1", "parallel.timeout_s=30",
            "emulate.enabled=true", "emulate.block_forward_ms=10"]
    args = [x for s in sets for x in ("--set", s)] + ["--metrics-out", str(folder / "m-%n.jsonl")]
    spare = case.endswith("spare")
    args += ["--spare-nodes", "1"] if spare else []
    out: dict = {"case": case}
    with cluster.SlurmCluster(folder / "cluster", nodes=4) as c:
        c.env.update(ELASWAVE=f"{sys.executable} -m elaswave.cli", ELASWAVE_TOKEN="slurm-bench", OMP_NUM_THREADS="1",
                     TORCH_CPP_LOG_LEVEL="ERROR", ELASWAVE_LOG=str(folder / "log-%N.log"))
        nodes = ["--nodes=4", "--nodelist=n[1-4]"] if spare else ["--nodes=3", "--nodelist=n[1-3]"]
        job = c.sbatch(EXAMPLES / "train.sbatch", *nodes, f"--output={folder / 'job.out'}", args=args)
        deadline = time.monotonic() + 180
        while not [r for r in _steps(folder) if r["step"] >= KILL_AFTER]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no step {KILL_AFTER} within 180 s: {c.job(job)}")
            time.sleep(0.1)
        c.kill_node(KILLED[case])
        killed = time.time()
        while not [r for r in _steps(folder) if r["world_size"] == 4]:
            if time.time() - killed > 120:
                raise RuntimeError("no step without the node within 120 s")
            time.sleep(0.05)
        out["job_state_while_training"] = c.job(job)["JobState"]
        submitted = time.time() if not spare else killed
        if not spare:
            joiner = c.sbatch(EXAMPLES / "join.sbatch", "--nodes=1", "--nodelist=n4", "--ntasks-per-node=2",
                              f"--output={folder / 'join.out'}", args=[str(job)])
        final = c.wait_job(job, 300)
        sacct = c.run("sacct", "--completion", "--noheader", "--parsable2", "-j", str(job), "--format=State,ExitCode")
        out.update(job_state=final["JobState"], exit_code=final["ExitCode"], sacct=sacct.splitlines()[-1])
        if not spare:
            done = c.wait_job(joiner, 60)
            out.update(join_state=done["JobState"], join_exit_code=done["ExitCode"])
        joins = _events(folder, "join")
        out.update(joined_ranks=sorted(r for j in joins for r in j["joined_ranks"]),
                   full_again_s=round(min((s["wall_time"] for s in _steps(folder) if s["world_size"] == 6
                                           and s["wall_time"] > submitted), default=float("nan")) - submitted, 2))
    steps_ = _steps(folder)
    first_after = min(r["wall_time"] for r in steps_ if r["world_size"] == 4)
    recovery = _events(folder, "recovery")
    out.update(first_step_after_kill_s=round(first_after - killed, 2),
               mttr_s=[round(r["mttr_s"], 2) for r in recovery], mttr_from=[r["mttr_from"] for r in recovery],
               phases_s=[{k: round(v, 3) for k, v in r["phases_s"].items()} for r in recovery],
               steps_written=len(steps_), bit_identical_losses=[r["loss"] for r in steps_] == reference_losses,
               summaries=len(_events(folder, "summary")))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cases", default="node,first_node,spare")
    ap.add_argument("--steps", type=int, default=120)
    args = ap.parse_args()
    reason = cluster.unavailable()
    if reason:
        raise SystemExit(f"no Slurm cluster here: {reason}")
    cases = args.cases.split(",")
    ref = run_reference(Path(tempfile.mkdtemp(prefix="slurm-ref-")), args.steps, True, num_micro_batches=6)
    runs = [one_run(case, args.steps, ref.losses) for case in cases for _ in range(args.runs)]
    lines = [f"# A node lost under Slurm ({date.today()}, {platform.node()}, {os.cpu_count()} cores, Slurm 22.05)", "",
             "| case | run | kill -> first step without it (s) | MTTR (s, from) | Slurm while training | end state, exit |"
             " sacct | full size again after (s) | losses = reference |", "|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(runs):
        lines.append(f"| {r['case']} | {i % args.runs + 1} | {r['first_step_after_kill_s']} | "
                     f"{', '.join(f'{m} ({f})' for m, f in zip(r['mttr_s'], r['mttr_from']))} | "
                     f"{r['job_state_while_training']} | {r['job_state']}, {r['exit_code']} | {r['sacct']} | "
                     f"{r['full_again_s']} | {r['bit_identical_losses']} |")
    for case in cases:
        mine = [r["first_step_after_kill_s"] for r in runs if r["case"] == case]
        lines.append(f"\n{case}: median {statistics.median(mine)} s from the kill to the first step without the node")
    write_results(RESULTS / "slurm_node_loss", {"runs": runs, "steps": args.steps}, lines)


if __name__ == "__main__":
    main()
