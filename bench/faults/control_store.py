"""The control store on etcd beside the embedded TCPStore: steady step time, MTTR of a kill and of a hang.

Each round runs the same job on both backends, one after the other (the order alternating by
round): failure-free for the steady step (the median step time after a warm-up; the ratio etcd over
TCPStore per round), then with a rank SIGKILLed (reported by its agent, and unreported: found by a
refused probe) and with a rank SIGSTOPped (the recovery record's ``mttr_s`` and phases). etcd is a real 3-member cluster on loopback, its data on tmpfs, started
per round by the tests' helper (``scripts/install_etcd.sh`` installs etcd). ``etcd_secure`` is the
way to run on several hosts (issue 58): the members serve HTTPS, auth is on, and the job signs in
as a user limited to its prefix (the role `elaswave etcd-role` prints; ``scripts/install_test_tools.sh``
installs etcdctl). Deterministic mode: every backend must give the same ``params_sha256`` in every
run, which the results say.

    python bench/faults/control_store.py --runs 5 [--faults steady,kill,unreported,hang]
        [--backends c10d,etcd,etcd_secure] [--out PATH]
"""
from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common, tests.helpers
from bench.common import bench_args, in_turn, median_step_s, run_job, short_error, write_results  # noqa: E402
from elaswave.control.rendezvous import role_commands  # noqa: E402
from tests.helpers.certs import Authority  # noqa: E402
from tests.helpers.etcd import EtcdCluster, enable_auth, etcdctl  # noqa: E402

JOB = ["parallel.dp=2", "parallel.pp=2", "train.steps=40", "train.num_micro_batches=8", "parallel.timeout_s=60",
       "elastic.respawn_after_s=-1"]
WARMUP = 5
FAULTS = {"steady": [], "kill": ["elastic.inject=kill:rank=3,step=20"],
          "unreported": ["elastic.inject=kill:rank=3,step=20", "elastic.launcher_reports_deaths=false"],
          "hang": ["elastic.inject=stop:rank=3,step=20"]}


BACKENDS = ("c10d", "etcd", "etcd_secure")


def _run(backend: str, fault: str) -> dict:
    sets = [*JOB, *FAULTS[fault]]
    if backend == "etcd":
        with EtcdCluster(3) as etcd:
            records = run_job(sets, deterministic=True, extra_argv=["--rdzv-backend", "etcd",
                                                                    "--rdzv-endpoint", etcd.endpoints])
    elif backend == "etcd_secure":
        with tempfile.TemporaryDirectory() as tmp:
            ca = Authority(Path(tmp) / "pki", "ca")
            server = ca.issue("member", ip="127.0.0.1")
            secret = Path(tmp) / "password"
            secret.write_text("job-pw")
            with EtcdCluster(3, tls=(ca.cert, *server), client_cert_auth=False) as etcd:
                etcdctl(etcd, *role_commands("elaswave", "job"), user=enable_auth(etcd, "root-pw"),
                        env={"ELASWAVE_ETCD_PASSWORD": "job-pw"})
                records = run_job(sets, deterministic=True, extra_argv=[
                    "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints,
                    "--rdzv-conf", f"cacert={ca.cert},user=job,password_file={secret}"])
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
    ap.add_argument("--backends", default="c10d,etcd", help=f"a subset of {', '.join(BACKENDS)} (c10d first)")
    args = ap.parse_args()
    chosen = [f for f in args.faults.split(",") if f]
    backends = [b for b in args.backends.split(",") if b]
    unknown = [f for f in chosen if f not in FAULTS] + [b for b in backends if b not in BACKENDS]
    if unknown or backends[:1] != ["c10d"]:
        ap.error(f"--faults {args.faults!r} / --backends {args.backends!r}: unknown {unknown} (known: "
                 f"{', '.join(FAULTS)}; {', '.join(BACKENDS)}), or c10d, the baseline, not first")
    rounds = []
    for i in range(args.runs):
        row = {}
        for fault in chosen:
            for backend in in_turn(i, backends):
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
    backends = [b for b in BACKENDS if any(k.endswith(f"/{b}") for r in rounds for k in r)]
    failed = {k: sum("error" in r.get(k, {}) for r in rounds) for k in rounds[0]} if rounds else {}
    shas = {r[k]["sha"] for r in rounds for k in r if "sha" in r[k]}
    names = {"c10d": "TCPStore (c10d)", "etcd": "etcd (3 members)", "etcd_secure": "etcd, TLS + auth"}
    lines = [f"# The control store on etcd beside the embedded TCPStore ({len(rounds)} rounds, dp=2 x pp=2)", "",
             "| measure | " + " | ".join(names[b] for b in backends) + " |", "| --- |" + " --- |" * len(backends),
             "| steady step, median s | " + " | ".join(med([x["step_s"] for x in ok(f"steady/{b}")]) for b in backends)
             + " |"]
    what = {"kill": "SIGKILLed (its agent reports it)", "unreported": "SIGKILLed, unreported (a refused probe)",
            "hang": "SIGSTOPped (a hang)"}
    for fault in [f for f in what if rounds and f"{f}/c10d" in rounds[0]]:
        lines.append(f"| MTTR, rank 3 {what[fault]}, median s | "
                     + " | ".join(med([x["mttr_s"] for x in ok(f"{fault}/{b}")]) for b in backends) + " |")
    for fault in what:
        for backend in backends:
            runs = ok(f"{fault}/{backend}")
            if runs:
                phases = {p: med([x["phases_s"][p] for x in runs]) for p in runs[0]["phases_s"]}
                lines.append(f"- {fault} on {backend}, median phases (s): {phases}")
    lines.append("")
    for backend in backends[1:]:
        ratios = [r[f"steady/{backend}"]["step_s"] / r["steady/c10d"]["step_s"] for r in rounds
                  if "step_s" in r.get(f"steady/{backend}", {}) and "step_s" in r.get("steady/c10d", {})]
        lines.append(f"Steady step, {names[backend]} over TCPStore (median of the per-round ratios): "
                     f"{med(ratios)}x (range {min(ratios):.3f}-{max(ratios):.3f})" if ratios else
                     f"no steady pair of {backend} completed")
    lines += [f"Failed runs: {failed}", f"Distinct params_sha256 over every run: {len(shas)} (1: every run the same run)"]
    return lines


if __name__ == "__main__":
    main()
