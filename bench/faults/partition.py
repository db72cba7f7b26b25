"""A rank cut off from its peers but not from the store, against a rank that dies: time to the first step after.

Four per-host agents of one worker each (the README's default job: tiny Llama, dp=2 x pp=2,
deterministic, ``parallel.timeout_s`` at its default); node 3 runs in a network namespace of its
own, reaching the store over one veth link and its peers over another (tests/helpers/netns.py).
Each run trains twice from scratch: once the peer link goes down after ``--cut-at`` steps (a
partition: packets dropped), once rank 3's worker is SIGKILLed at the same step (a death its agent
reports) -- the baseline, measured in the same run. Per case:

- *detect*: the fault -> the first rank noticed (the first step on 3 ranks, less the recovery's MTTR);
- *recovery*: the recovery record's MTTR, from noticing to the end of the first step on 3 ranks;
- *fault to first step*: the fault -> the end of that step (detect + recovery: the MTTR counted
  from the fault itself);
- *epochs*: the epoch the recovery landed in (1: the first agreement left rank 3 out);
- *identical*: losses, ``params_sha256`` and ``state_sha256`` equal the failure-free reference.

Needs root and iproute2 (network namespaces).

    python bench/faults/partition.py --runs 5
"""
from __future__ import annotations

import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common, tests.helpers
from bench.common import bench_args, run_job, set_flags, write_results  # noqa: E402
from tests.helpers import netns  # noqa: E402
from tests.helpers.spawn import Running, children, free_port, rank_of, steps_written  # noqa: E402

STEPS = 60
JOB = [f"train.steps={STEPS}", "train.deterministic=true", "elastic.respawn_after_s=-1"]


def _agent(sets: list[str], k: int, endpoint: str, metrics: Path, prefix=()) -> Running:
    args = ["run", *set_flags(sets), "--nnodes", "4", "--node-rank", str(k),
            "--rdzv-endpoint", endpoint]
    return Running(args, metrics, env={"ELASWAVE_TOKEN": "bench", "TORCH_CPP_LOG_LEVEL": "ERROR"}, prefix=list(prefix))


def one_run(tmp: Path, case: str, cut_at: int) -> dict:
    with netns.OtherHost() as host:
        endpoint, metrics = f"{host.here_store_ip}:{free_port()}", tmp / f"{case}.jsonl"
        agents = [_agent([*JOB, f"parallel.bind_address={host.here_peer_ip}"], k, endpoint,
                         metrics if k == 0 else tmp / f"{case}{k}.jsonl") for k in range(3)]
        agents.append(_agent([*JOB, f"parallel.bind_address={host.peer_ip}"], 3, endpoint, tmp / f"{case}3.jsonl",
                             prefix=host.prefix()))
        try:
            deadline = time.monotonic() + 300
            while steps_written(metrics) < cut_at and time.monotonic() < deadline:
                time.sleep(0.005)
            fault = time.time()
            if case == "partition":
                host.cut_peers()
            else:
                (worker,) = [p for p in children(agents[3].proc.pid) if rank_of(p) == 3]
                os.kill(worker, signal.SIGKILL)
            results = [a.finish(600) for a in agents]
        finally:
            for a in agents:
                a.__exit__()
    res = results[0]
    if res.returncode != 0 or not res.summary:
        raise RuntimeError(f"{case}: node 0's agent exited {res.returncode}:\n{res.stderr[-3000:]}")
    (change,) = [r for r in res.records if r["event"] == "recovery"]
    first = min((r for r in res.steps if r["world_size"] == 3), key=lambda r: r["wall_time"])
    return {"detect_s": first["wall_time"] - fault - change["mttr_s"], "mttr_s": change["mttr_s"],
            "fault_to_first_step_s": first["wall_time"] - fault, "epoch": change["epoch"],
            "evidence": change["evidence"].get("3"), "losses": res.losses,
            "params_sha256": res.summary["params_sha256"], "state_sha256": res.summary["state_sha256"],
            "rank3_exit": results[3].returncode}


def main() -> None:
    ap = bench_args(__doc__, out="partition", runs=5)
    ap.add_argument("--cut-at", type=int, default=12, help="steps written before the fault")
    args = ap.parse_args()
    reason = netns.unavailable()
    if reason:
        sys.exit(f"bench/faults/partition.py: {reason}")
    reference = run_job(JOB)
    ref = (reference[-1]["params_sha256"], reference[-1]["state_sha256"])
    ref_losses = [r["loss"] for r in reference if r["event"] == "step"]
    cases = {"partition": [], "kill": []}
    for i in range(args.runs):
        for case, runs in cases.items():
            with tempfile.TemporaryDirectory() as tmp:
                r = one_run(Path(tmp), case, args.cut_at)
            r["identical"] = (r.pop("params_sha256"), r.pop("state_sha256")) == ref and r.pop("losses") == ref_losses
            runs.append(r)
            print(f"run {i} {case}: detect {r['detect_s']:.3f} s, recovery {r['mttr_s']:.3f} s, fault to first "
                  f"step {r['fault_to_first_step_s']:.3f} s, epoch {r['epoch']}, identical {r['identical']}", flush=True)
    keys = ["detect_s", "mttr_s", "fault_to_first_step_s"]
    summary = {case: {k: {"median": statistics.median(r[k] for r in runs),
                          "range": [min(r[k] for r in runs), max(r[k] for r in runs)]} for k in keys}
               for case, runs in cases.items()}
    ratio = [p["fault_to_first_step_s"] / k["fault_to_first_step_s"] for p, k in zip(cases["partition"], cases["kill"])]
    doc = {"command": f"python bench/faults/partition.py --runs {args.runs} --cut-at {args.cut_at}", "job": JOB,
           "runs": cases, "summary": summary, "partition_over_kill": statistics.median(ratio),
           "partition_over_kill_range": [min(ratio), max(ratio)]}
    lines = [f"# A rank cut off from its peers, against a rank killed (`{doc['command']}`)", "",
             "README default job (tiny Llama, dp=2 x pp=2, deterministic, parallel.timeout_s=120, heartbeat "
             f"timeout 2 s), four agents of one worker, node 3 in its own network namespace; the fault after "
             f"{args.cut_at} steps. Medians (range) of {args.runs} runs of each.", "",
             "| case | detect s | recovery s | fault to first step s | first agreement | bit-identical |",
             "| --- | --- | --- | --- | --- | --- |"]
    for case, runs in cases.items():
        s = summary[case]
        cells = [f"{s[k]['median']:.3f} ({s[k]['range'][0]:.3f}-{s[k]['range'][1]:.3f})" for k in keys]
        lines.append(f"| {case} | {' | '.join(cells)} | {sum(r['epoch'] == 1 for r in runs)} of {len(runs)} | "
                     f"{sum(r['identical'] for r in runs)} of {len(runs)} |")
    lines += ["", f"fault to first step, partition / kill: {doc['partition_over_kill']:.2f} "
                  f"({doc['partition_over_kill_range'][0]:.2f}-{doc['partition_over_kill_range'][1]:.2f})"]
    write_results(args.out, doc, lines)


if __name__ == "__main__":
    main()
