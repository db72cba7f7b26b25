"""The control store on etcd beside the embedded TCPStore: steady step time, MTTR of a kill and of a hang.

Each round runs the same job on both backends, one after the other (the order alternating by
round): failure-free for the steady step (the median step time after a warm-up; the ratio etcd over
TCPStore per round), then with a rank SIGKILLed (reported by its agent, and unreported: found by a
refused probe) and with a rank SIGSTOPped (the recovery record's ``mttr_s`` and phases). etcd is a real 3-member cluster on loopback, its data on tmpfs, started
per round by the tests' helper (``scripts/install_etcd.sh`` installs etcd). Deterministic mode:
both backends must give the same ``params_sha256`` in every run, which the results say.

    python bench/faults/control_store.py --runs 5 [--faults steady,kill,unreported,hang] [--out PATH]
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common, tests.helpers
from bench.common import bench_args, in_turn, median_step_s, run_job, short_error, write_results  # noqa: E402
from tests.helpers.etcd import EtcdCluster  # noqa: E402

JOB = ["parallel.dp=2", "parallel.pp=2", "train.steps=40", "train.num_micro_batches=8", "parallel.timeout_s=60",
       "elastic.respawn_after_s=-1"]
WARMUP = 5
FAULTS = {"steady": [], "kill": ["elastic.inject=kill:rank=3,step=20"],
          "unreported": ["elastic.inject=kill:rank=3,step=20", "elastic.launcher_reports_deaths=false"],
          "hang": ["elastic.inject=stop:rank=3,step=20"]}


def _run(backend: str, fault: str) -> dict:
    sets = [*JOB, *FAULTS[fault]]
    if backend == "etcd":
        with EtcdCluster(3) as etcd:
            records = run_job(sets, deterministic=True, extra_argv=["--rdzv-backend", "etcd",
                                                                    "--rdzv-endpoint", etcd.endpoints])
    else:
        records = run_job(sets, deterministic=True)
    out = {"sha": next(r["params_sha256"] for r in records if r["event"] == "summary")}
    if fault == "steady":
        out["step_s"] = median_step_s(records, WARMUP)
    else:
        (rec,) = [r for r in records if r["event"] == "recovery"]
        out["mttr_s"], out["phases_s"] = rec["mttr_s"], rec["phases_s"]
    return out


def main() -> None:
    ap = bench_args(__doc__, out="control_store", runs=5)
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"a subset of {', '.join(FAULTS)}")
    args = ap.parse_args()
    chosen = [f for f in args.faults.split(",") if f]
    unknown = [f for f in chosen if f not in FAULTS]
    if unknown:
        ap.error(f"--faults {args.faults!r}: unknown {unknown}; known: {', '.join(FAULTS)}")
    rounds = []
    for i in range(args.runs):
        row = {}
        for fault in chosen:
            for backend in in_turn(i, ["c10d", "etcd"]):
                try:
                    row[f"{fault}/{backend}"] = _run(backend, fault)
                except Exception as exc:  # noqa: BLE001 - a failed run is a finding, counted below
                    row[f"{fault}/{backend}"] = {"error": short_error(exc)}
                print(i, fault, backend, row[f"{fault}/{backend}"], flush=True)
        rounds.append(row)
    write_results(args.out, {"job": JOB, "rounds": rounds}, _page(rounds))


def _page(rounds: list[dict]) -> list[str]:
    def ok(key):
        return [r[key] for r in rounds if "error" not in r.get(key, {"error": 1})]

    def med(values):
        return f"{statistics.median(values):.3f}" if values else "n/a"
    ratios = [r["steady/etcd"]["step_s"] / r["steady/c10d"]["step_s"] for r in rounds
              if "step_s" in r.get("steady/etcd", {}) and "step_s" in r.get("steady/c10d", {})]
    failed = {k: sum("error" in r.get(k, {}) for r in rounds) for k in rounds[0]} if rounds else {}
    shas = {r[k]["sha"] for r in rounds for k in r if "sha" in r[k]}
    lines = [f"# The control store on etcd beside the embedded TCPStore ({len(rounds)} rounds, dp=2 x pp=2)", "",
             "| measure | TCPStore (c10d) | etcd (3 members) |", "| --- | --- | --- |",
             f"| steady step, median s | {med([x['step_s'] for x in ok('steady/c10d')])} | "
             f"{med([x['step_s'] for x in ok('steady/etcd')])} |"]
    what = {"kill": "SIGKILLed (its agent reports it)", "unreported": "SIGKILLed, unreported (a refused probe)",
            "hang": "SIGSTOPped (a hang)"}
    for fault in [f for f in what if rounds and f"{f}/c10d" in rounds[0]]:
        lines.append(f"| MTTR, rank 3 {what[fault]}, median s | "
                     f"{med([x['mttr_s'] for x in ok(f'{fault}/c10d')])} | {med([x['mttr_s'] for x in ok(f'{fault}/etcd')])} |")
    for fault in what:
        for backend in ("c10d", "etcd"):
            runs = ok(f"{fault}/{backend}")
            if runs:
                phases = {p: med([x["phases_s"][p] for x in runs]) for p in runs[0]["phases_s"]}
                lines.append(f"- {fault} on {backend}, median phases (s): {phases}")
    lines += ["", f"Steady step, etcd over TCPStore (median of the per-round ratios): "
                  f"{med(ratios)}x (range {min(ratios):.3f}-{max(ratios):.3f})" if ratios else "no steady pair completed",
              f"Failed runs: {failed}", f"Distinct params_sha256 over every run: {len(shas)} (1: every run the same run)"]
    return lines


if __name__ == "__main__":
    main()
