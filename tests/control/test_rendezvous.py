"""Jobs whose control store is an etcd cluster (``--rdzv-backend etcd``), end to end: real
workers, a real 3-member cluster, real SIGKILLs. Losing a rank and an etcd member leaves the run
bit-identical to the reference; losing the etcd majority stops every rank after it saved its part
(no side can decide alone); bad rendezvous input is one line."""
import contextlib
import time

import pytest

from elaswave.control.link import EXIT_STORE_LOST
from elaswave.runtime.metrics import read_jsonl
from tests.helpers import netns
from tests.helpers.certs import Authority
from elaswave.control.rendezvous import role_commands
from tests.helpers.etcd import EtcdCluster, enable_auth, etcdctl
from tests.helpers.spawn import (Running, assert_same_run, fault_mid_run, free_port, freeze_rank, job_args,
                                 reference_fixture, run_cli)

STEPS, MBS = 16, 4
EXTRA = [f"train.num_micro_batches={MBS}", "parallel.timeout_s=60"]
reference = reference_fixture(STEPS, MBS)


def _etcd_job(etcd, extra=(), steps=STEPS):
    return job_args(2, 2, steps, True, [*EXTRA, *extra]) + ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints]


def test_a_job_on_etcd_loses_a_rank_and_an_etcd_member_and_stays_the_same_run(tmp_path, reference):
    with EtcdCluster(3) as etcd, Running(_etcd_job(etcd, ["elastic.inject=kill:rank=3,step=5"]),
                                          tmp_path / "run.jsonl") as job:
        job.wait_for(r"store at etcd://", 60)
        job.wait_for(r"step\s+9/", 240)
        etcd.kill(0)  # the member the ranks talk to first: they move on to the others
        res = job.finish(240)
    assert res.returncode == 0, res.stderr
    assert_same_run(res, reference, STEPS)
    (rec,) = [r for r in res.records if r["event"] == "recovery"]
    assert rec["lost_ranks"] == [3]


def test_a_rank_frozen_on_etcd_is_left_out_when_its_lease_goes_unrenewed(tmp_path, reference):
    """A rank SIGSTOPped from outside: nobody reports it, its lease runs down; both its watchers
    hear from the leader that it went unrenewed for the timeout and name it, before the lease
    expires; the MTTR runs from its last renewal, and the run stays bit-identical."""
    timeout_s = 2.0
    with EtcdCluster(3) as etcd, Running(_etcd_job(etcd, [f"elastic.heartbeat_timeout_s={timeout_s}"]),
                                          tmp_path / "run.jsonl") as job:
        job.wait_for(r"step\s+5/", 240)
        stopped = freeze_rank(job, 2)
        res = job.finish(240)
    assert res.returncode == 0, res.stderr
    assert_same_run(res, reference, STEPS)
    (rec,) = [r for r in res.records if r["event"] == "recovery"]
    assert rec["lost_ranks"] == [2] and rec["mttr_from"] in ("last_heartbeat", "last_step"), rec
    assert f"renewed no etcd lease for {timeout_s:g} s" in rec["evidence"]["2"], rec["evidence"]
    # Renewed every TTL/4 (TTL: the timeout + 1 s) until the stop: the last renewal is at most
    # that before it, and the record's start is the earliest it can have been.
    began = min(r["wall_time"] for r in res.steps if r["step"] == rec["resume_step"]) - rec["mttr_s"]
    assert stopped - (timeout_s + 1) / 4 - 0.3 <= began <= stopped + 0.1, (began - stopped, rec)
    first = min(r["wall_time"] for r in res.steps if r["step"] == rec["resume_step"])
    assert first - stopped < timeout_s + 1.5, first - stopped  # before the lease's expiry would have said it


def test_a_job_whose_etcd_loses_its_majority_saves_and_stops(tmp_path):
    ckpt = tmp_path / "ckpt"
    with EtcdCluster(3) as etcd, Running(_etcd_job(etcd, [f"checkpoint.dir={ckpt}"], steps=400),
                                          tmp_path / "run.jsonl") as job:
        job.wait_for(r"step\s+5/", 240)
        etcd.kill(1)
        etcd.kill(2)
        began = time.monotonic()
        res = job.finish(90)
        stopped_s = time.monotonic() - began
    assert res.returncode == EXIT_STORE_LOST, res.stderr
    assert stopped_s < 30
    assert not any(r["event"] == "summary" for r in res.records)  # no side finished a run of its own
    assert "etcd (" in res.stderr and "saved its part of step" in res.stderr
    assert any(ckpt.glob("step_*")), "the ranks saved nothing"


@pytest.mark.slow  # the default run keeps a faster case of the same path; `pytest -m slow` runs it
def test_a_job_on_etcd_over_tls_with_client_certificates_is_the_same_run(tmp_path, reference):
    """Every process of the job -- the launcher and each worker -- speaks HTTPS with the job's
    client certificate, from the environment; without it the job is one line, within the timeout."""
    ca = Authority(tmp_path / "pki", "ca")
    server, job_cert = ca.issue("member", ip="127.0.0.1"), ca.issue("job")
    env = {"ELASWAVE_ETCD_CACERT": str(ca.cert), "ELASWAVE_ETCD_CERT": str(job_cert[0]),
           "ELASWAVE_ETCD_KEY": str(job_cert[1])}
    with EtcdCluster(3, tls=(ca.cert, *server)) as etcd:
        with Running(_etcd_job(etcd), tmp_path / "run.jsonl", env=env) as job:
            res = job.finish(240)
        assert res.returncode == 0, res.stderr
        assert_same_run(res, reference, STEPS)
        began = time.monotonic()
        bare = run_cli(_etcd_job(etcd, ["parallel.timeout_s=10"]), tmp_path, timeout_s=60,
                       env={"ELASWAVE_ETCD_CACERT": str(ca.cert)})
    assert bare.returncode == 2 and "refused the TLS client certificate" in bare.stderr, bare.stderr
    assert len(bare.stderr.strip().splitlines()) == 1 and time.monotonic() - began < 30


def test_a_job_on_etcd_with_tls_and_auth_as_a_least_privilege_user_is_the_same_run(tmp_path, reference):
    """The way to run on several hosts: etcd over TLS with auth on, the job's user made with the
    etcdctl commands `elaswave etcd-role` prints (read-write under the job's prefix, nothing else),
    and `--rdzv-conf cacert=...,user=...,password_file=...` (the workers inherit it). The same
    user's password over plain HTTP is refused in one line before anything starts, unless said."""
    ca = Authority(tmp_path / "pki", "ca")
    server = ca.issue("member", ip="127.0.0.1")
    secret = tmp_path / "etcd-password"
    secret.write_text("job-pw\n")
    with EtcdCluster(3, tls=(ca.cert, *server), client_cert_auth=False) as etcd:
        root = enable_auth(etcd, "root-pw")
        etcdctl(etcd, *role_commands("elaswave", "job"), user=root, env={"ELASWAVE_ETCD_PASSWORD": "job-pw"})
        conf = ["--rdzv-conf", f"cacert={ca.cert},user=job,password_file={secret}"]
        with Running(_etcd_job(etcd) + conf, tmp_path / "run.jsonl") as job:
            res = job.finish(240)
        assert res.returncode == 0, res.stderr
        assert_same_run(res, reference, STEPS)
    began = time.monotonic()
    plain = run_cli(job_args(2, 2, STEPS, True, EXTRA) + ["--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:2379",
                                                          "--rdzv-conf", f"user=job,password_file={secret}"],
                    tmp_path, timeout_s=60)
    assert plain.returncode == 2 and "would go to etcd over plain HTTP" in plain.stderr, plain.stderr
    assert len(plain.stderr.strip().splitlines()) == 1 and time.monotonic() - began < 30


@pytest.mark.parametrize("flags, needle", [
    (["--rdzv-backend", "zk"], "--rdzv-backend='zk' is invalid: use one of c10d, etcd"),
    (["--rdzv-backend", "etcd"], "--rdzv-backend=etcd needs --rdzv-endpoint"),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1"], "is not HOST:PORT"),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "UNREACHABLE"], "no majority of the etcd cluster answered"),
])
def test_bad_rendezvous_input_is_one_line(tmp_path, flags, needle):
    flags = [f"127.0.0.1:{free_port()}" if f == "UNREACHABLE" else f for f in flags]
    began = time.monotonic()
    res = run_cli(job_args(2, 2, 4, True, EXTRA) + flags, tmp_path, timeout_s=120)
    assert res.returncode == 2 and needle in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert time.monotonic() - began < 60


@pytest.mark.parametrize("node0", ["c10d", "etcd"])
def test_an_agent_on_the_other_backend_than_node_0_is_one_line(tmp_path, node0):
    """Node 0's store is a TCPStore (resp. an etcd member) at the endpoint; this agent says etcd
    (resp. c10d): one line naming the endpoint and the backend, within parallel.timeout_s."""
    import torch.distributed as dist
    port = free_port()
    with EtcdCluster(1) if node0 == "etcd" else contextlib.nullcontext() as etcd:
        store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False) if etcd is None else None
        endpoint = f"127.0.0.1:{port}" if etcd is None else etcd.endpoints
        backend = ["--rdzv-backend", "etcd"] if etcd is None else []
        began = time.monotonic()
        res = run_cli(job_args(2, 2, 4, True, [*EXTRA[:-1], "parallel.timeout_s=6"])
                      + ["--nnodes", "2", "--node-rank", "1", *backend, "--rdzv-endpoint", endpoint], tmp_path,
                      timeout_s=60, env={"ELASWAVE_TOKEN": "backends-test"})
        took = time.monotonic() - began
        del store
    want = "is a TCPStore, not etcd" if node0 == "c10d" else "is an etcd member, not a TCPStore"
    assert res.returncode == 2 and want in res.stderr and endpoint in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and res.left_behind == 0, res.stderr
    assert took < 6 + 15, took  # the timeout, and the process's own start


CUT_AT = 6


def test_two_hosts_cut_apart_on_etcd_make_one_run_not_two(tmp_path, reference):
    """Host 1 (ranks 2, 3 and one of the three etcd members, in a network namespace) goes silent
    mid-run: both its links down, its processes alive, nothing refused. Host 0 holds the etcd
    majority: it leaves ranks 2 and 3 out and trains on, bit-identical to the reference. Host 1
    cannot commit anything to etcd: its ranks save their part and stop, and write no step, no
    summary (on the embedded store it moved the store to itself and trained on alone).

    Rank 1's watcher is held back for 5 s at the cut, so it checks in seconds after rank 0 (as
    when its watch stream sits on the member that went silent: CI's failure on stop 51). Its
    lease is renewed meanwhile: it is waited for, not left out alive."""
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    sets = [*EXTRA, "parallel.dp=2", "parallel.pp=2", "train.deterministic=true", "elastic.respawn_after_s=-1",
            f"elastic.inject=starve:rank=1,step={CUT_AT},seconds=5"]
    with netns.OtherHost() as host, \
            EtcdCluster(3, hosts=[host.here_store_ip, host.here_store_ip, host.store_ip],
                        prefixes=[[], [], host.prefix()]) as etcd:
        def agent(k, bind, prefix=()):
            args = job_args(2, 2, STEPS, True, [*sets, f"parallel.bind_address={bind}"])
            args += ["--nnodes", "2", "--node-rank", str(k), "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints]
            return Running(args, tmp_path / f"m{k}.jsonl", env={"ELASWAVE_TOKEN": "two-hosts"}, prefix=list(prefix))
        cut_wall, results = fault_mid_run([agent(0, host.here_peer_ip), agent(1, host.peer_ip, host.prefix())],
                                          CUT_AT, host.silence)
    assert results[0].returncode == 0, results[0].stderr
    assert results[1].returncode == EXIT_STORE_LOST, results[1].stderr
    res = results[0]
    worlds = [r["world_size"] for r in res.steps]
    recoveries = [{k: r.get(k) for k in ("lost_ranks", "evidence", "resume_step", "mttr_s")}
                  for r in res.records if r["event"] == "recovery"]
    assert worlds[0] == 4 and worlds[-1] == 2, (worlds, recoveries, res.stderr[-4000:])
    assert_same_run(res, reference, STEPS)
    assert not (tmp_path / "m1.jsonl").exists() or not [
        r for r in read_jsonl(str(tmp_path / "m1.jsonl")) if r["event"] in ("step", "summary")]
    first_after = min(r["wall_time"] for r in res.steps if r["world_size"] == 2)
    assert first_after - cut_wall < 60  # within parallel.timeout_s, not a hang
