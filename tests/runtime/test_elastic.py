"""Real gloo ranks, real SIGKILL/SIGSTOP: a dp=4 job that loses ranks trains the same run."""

import pytest

from tests.helpers.spawn import Running, freeze_rank, job_args, run_job, run_reference

STEPS = 30
DP = 4
MBS = 12  # 12 micro-batches: 3 per rank at dp=4, 4 per rank at dp=3
EXTRA = [f"train.num_micro_batches={MBS}", "parallel.timeout_s=60"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_reference(tmp_path_factory.mktemp("ref"), STEPS, deterministic=True, num_micro_batches=MBS)


def _elastic(tmp_path, faults, deterministic=True, extra=()):
    return run_job(tmp_path, DP, 1, STEPS, deterministic,
                   extra=[*EXTRA, "elastic.inject=" + ";".join(faults), *extra])


def _recoveries(res):
    return [r for r in res.records if r["event"] == "recovery"]


def _assert_same_run(res, reference):
    assert [r["step"] for r in res.steps] == list(range(STEPS)), "a step was lost or counted twice"
    assert res.losses == reference.losses  # exact float equality, every step
    assert res.summary["params_sha256"] == reference.summary["params_sha256"]
    assert res.summary["state_sha256"] == reference.summary["state_sha256"]


@pytest.mark.parametrize("phase", ["forward", "optimizer", "snapshot",
                                   # backward: the TP and pipeline cases below and in test_tensor_parallel; reduce: the middle stage's
                                   *(pytest.param(p, marks=pytest.mark.slow) for p in ("backward", "reduce"))])
def test_sigkill_in_each_phase_gives_the_same_run(tmp_path, reference, phase):
    res = _elastic(tmp_path, [f"kill:rank=2,step=12,phase={phase}"])
    _assert_same_run(res, reference)
    (rec,) = _recoveries(res)
    assert rec["lost_ranks"] == [2] and rec["epoch"] == 1
    assert rec["resume_step"] in (11, 12, 13)  # 11 when the holder had not yet verified step 12's snapshot
    assert set(rec["phases_s"]) == {"detect", "agree", "communicator", "plan", "state", "first_step"}
    assert 0 < rec["mttr_s"] < 10
    # The launcher's report, or a survivor's probe if that came first.
    assert "killed by SIGKILL" in rec["evidence"]["2"] or "refused connections" in rec["evidence"]["2"]
    assert res.summary["ranks"] == [0, 1, 3]
    after = [r for r in res.steps if r["step"] > 13]
    assert all(r["world_size"] == 3 and r["num_samples"] == res.steps[0]["num_samples"] for r in after)


def test_a_death_nobody_reports_is_shown_by_its_refused_port_not_by_a_timeout(tmp_path, reference):
    # As on a host lost whole (its agent with it): no launcher reports the death. A survivor's
    # probe of the dead rank's liveness port is refused, and agreement settles on that evidence;
    # with a 30 s agreement timeout, waiting it out would show.
    res = _elastic(tmp_path, ["kill:rank=2,step=12,phase=backward"],
                   extra=["elastic.launcher_reports_deaths=false", "elastic.agree_timeout_s=30"])
    _assert_same_run(res, reference)
    (rec,) = _recoveries(res)
    assert rec["lost_ranks"] == [2]
    assert rec["evidence"]["2"].startswith("refused connections (probed by rank")
    assert rec["phases_s"]["agree"] < 2.0 and rec["mttr_s"] < 5.0, rec


@pytest.mark.slow  # the default run keeps a faster case of the same path; `pytest -m slow` runs it
def test_two_failures_at_different_steps_give_the_same_run(tmp_path, reference):
    # Rank 0 is the metrics writer and the second to die: rank 1 must take the writing over.
    res = _elastic(tmp_path, ["kill:rank=2,step=8,phase=reduce", "kill:rank=0,step=20,phase=optimizer"])
    _assert_same_run(res, reference)
    recs = _recoveries(res)
    assert [r["lost_ranks"] for r in recs] == [[2], [0]]
    assert res.summary["ranks"] == [1, 3]


def test_sigstop_hang_is_detected_by_heartbeat(tmp_path, reference):
    timeout_s, interval_s = 2.0, 0.2
    res = _elastic(tmp_path, ["stop:rank=1,step=10,phase=backward"],
                   extra=[f"elastic.heartbeat_timeout_s={timeout_s}", f"elastic.heartbeat_interval_s={interval_s}"])
    _assert_same_run(res, reference)
    (rec,) = _recoveries(res)
    assert rec["lost_ranks"] == [1]
    # The watcher last saw the counter move up to one interval before the stop, so the hang is
    # declared between timeout - interval and timeout (+ polling and the alert) after the stop.
    assert timeout_s - interval_s - 0.05 <= rec["phases_s"]["detect"] < timeout_s + 1.5


def test_owner_dying_with_its_snapshot_holder_falls_back_to_the_disk_checkpoint(tmp_path, reference):
    # Rank 3 holds rank 2's snapshot: with both gone, rank 2's chunks exist only on disk (step 10).
    ckpt = tmp_path / "ckpt"
    res = _elastic(tmp_path, ["kill:rank=2,step=12", "kill:rank=3,step=12"],
                   extra=[f"checkpoint.dir={ckpt}", "checkpoint.every_steps=5"])
    _assert_same_run(res, reference)
    (rec,) = _recoveries(res)
    assert sorted(rec["lost_ranks"]) == [2, 3]
    # The newest checkpoint every survivor saw complete: step 10's, or -- its background save still
    # being written two steps later on a loaded machine (a loaded pass, session 40) -- step 5's.
    assert rec["is_fallback"] and rec["resume_step"] in (5, 10), rec
    assert f"step_{rec['resume_step']:08d}" in res.stderr, res.stderr  # the warning names the checkpoint it resumes from
    assert "died with their snapshot holders" in res.stderr and "disk checkpoint" in res.stderr
    assert res.summary["ranks"] == [0, 1]


def test_two_snapshot_copies_survive_an_owner_dying_with_its_first_holder(tmp_path, reference):
    # The same two deaths with elastic.snapshot_copies=2: rank 0 keeps a second copy of rank 2's
    # snapshot, so the job goes on from memory (at the step it was in, or the one before if the
    # holders had not verified this step's snapshots yet) -- no disk checkpoint, nothing lost.
    res = _elastic(tmp_path, ["kill:rank=2,step=12", "kill:rank=3,step=12"], extra=["elastic.snapshot_copies=2"])
    _assert_same_run(res, reference)
    (rec,) = _recoveries(res)
    assert sorted(rec["lost_ranks"]) == [2, 3]
    assert not rec["is_fallback"] and rec["resume_step"] in (11, 12), rec  # 11: step 12 not yet verified
    assert "disk checkpoint" not in res.stderr
    assert res.summary["ranks"] == [0, 1]


PIPE_STEPS, PIPE_MBS = 12, 6


@pytest.fixture(scope="module")
def pipe_reference(tmp_path_factory):
    return run_reference(tmp_path_factory.mktemp("pref"), PIPE_STEPS, deterministic=True, num_micro_batches=PIPE_MBS)


@pytest.mark.parametrize("dp,pp,fault,overlap", [
    pytest.param(2, 2, "kill:rank=1,step=5,phase=backward", True, marks=pytest.mark.slow),   # last stage
    (2, 3, "kill:rank=4,step=5,phase=reduce", True),     # middle stage
    (3, 2, "kill:rank=2,step=5,phase=forward", True),    # first stage
    pytest.param(2, 2, "kill:rank=1,step=5,phase=backward", False, marks=pytest.mark.slow),  # moments migrated before the step (blocking)
])
def test_a_broken_pipeline_is_re_partitioned_and_gives_the_same_run(tmp_path, pipe_reference, dp, pp, fault, overlap):
    res = run_job(tmp_path, dp, pp, PIPE_STEPS, True,
                  extra=[f"train.num_micro_batches={PIPE_MBS}", "parallel.timeout_s=60", f"elastic.inject={fault}",
                         f"elastic.overlap_migration={str(overlap).lower()}"])
    assert [r["step"] for r in res.steps] == list(range(PIPE_STEPS)), "a step was lost or counted twice"
    assert res.losses == pipe_reference.losses
    assert res.summary["params_sha256"] == pipe_reference.summary["params_sha256"]
    (rec,) = _recoveries(res)
    assert rec["lost_ranks"] == [int(fault.split("rank=")[1].split(",")[0])]
    assert res.summary["world_size"] == dp * pp - 1


@pytest.mark.parametrize("dp,killed,phase", [(2, 1, "forward"), (3, 2, "backward")])
def test_reroute_baseline_keeps_the_batch_and_gives_the_same_run(tmp_path, pipe_reference, dp, killed, phase):
    # ReCycle's way: a rank is gone; its pipeline's micro-batches pass through the same stage of the
    # others (at dp=3 one guest on each of two hosts, each inserted in its host's 1F1B order).
    res = run_job(tmp_path, dp, 2, PIPE_STEPS, True,
                  extra=[f"train.num_micro_batches={PIPE_MBS}", "parallel.timeout_s=60", "elastic.policy=reroute",
                         f"elastic.inject=kill:rank={killed},step=5,phase={phase}"])
    assert res.losses == pipe_reference.losses
    assert res.summary["params_sha256"] == pipe_reference.summary["params_sha256"]
    assert res.summary["state_sha256"] == pipe_reference.summary["state_sha256"]
    (rec,) = _recoveries(res)
    survivor = [[0, 3], [3, 6]][1 - killed % 2]  # the broken pipeline keeps its survivor's stage
    assert rec["plan"]["detours"] == PIPE_MBS // dp and rec["plan"]["layer_ranges"][killed // 2] == [survivor]


def test_drop_replica_baseline_idles_the_broken_pipeline(tmp_path):
    res = run_job(tmp_path, 2, 2, PIPE_STEPS, True,
                  extra=[f"train.num_micro_batches={PIPE_MBS}", "parallel.timeout_s=60", "elastic.policy=drop_replica",
                         "elastic.inject=kill:rank=2,step=5,phase=backward"])
    assert [r["step"] for r in res.steps] == list(range(PIPE_STEPS))
    (rec,) = _recoveries(res)
    assert rec["plan"]["micro_batches"] == [PIPE_MBS // 2, 0]  # rank 3 stays, idle
    after = [r for r in res.steps if r["epoch"] == 1]
    assert after and all(r["num_samples"] == res.steps[0]["num_samples"] // 2 for r in after)
    assert res.summary["ranks"] == [0, 1, 3]


def test_emulated_compute_with_frequency_planning_gives_the_same_run(tmp_path, pipe_reference):
    # Emulated time and planned frequency levels change when things happen, never what is computed.
    res = run_job(tmp_path, 2, 3, PIPE_STEPS, True,
                  extra=[f"train.num_micro_batches={PIPE_MBS}", "parallel.timeout_s=60", "emulate.enabled=true",
                         "emulate.block_forward_ms=2", "elastic.inject=kill:rank=4,step=5,phase=forward"])
    assert res.losses == pipe_reference.losses
    assert res.summary["params_sha256"] == pipe_reference.summary["params_sha256"]
    (rec,) = _recoveries(res)
    levels = rec["plan"]["frequencies"]
    assert levels is not None and [len(x) for x in levels] == [3, 2]
    # Levels were planned (not all nominal), and the power stays within the cap: the five
    # survivors' nominal power (the lost rank's share is not spent).
    assert any(f != 1.0 for row in levels for f in row)
    after = [r for r in res.steps if r["epoch"] == 1]
    assert all(r["modelled_power_w"] <= 5.0 + 1e-9 for r in after)


def test_a_hang_nobody_injected_is_timed_from_its_last_heartbeat(tmp_path, reference):
    """A rank SIGSTOPped from outside (a frozen process: no stamp says when it stopped): the
    recovery's MTTR runs from the last heartbeat the rank sent, and the record says so."""
    timeout_s, interval_s = 2.0, 0.2
    metrics = tmp_path / "run.jsonl"
    args = job_args(DP, 1, STEPS * 4, True, [*EXTRA, f"elastic.heartbeat_timeout_s={timeout_s}",
                                             f"elastic.heartbeat_interval_s={interval_s}"])
    with Running(args, metrics) as job:
        job.wait_for(r"step\s+10/", 120)
        stopped = freeze_rank(job, 1)
        res = job.finish(240)
    assert res.returncode == 0, res.stderr
    (rec,) = _recoveries(res)
    # Its last sign of life: the last heartbeat it sent, or the end of the last step (it took part), the later.
    assert rec["lost_ranks"] == [1] and rec["mttr_from"] in ("last_heartbeat", "last_step"), rec
    detect = rec["phases_s"]["detect"]
    assert timeout_s - interval_s - 0.05 <= detect < timeout_s + 1.5, rec
    began = min(r["wall_time"] for r in res.steps if r["step"] == rec["resume_step"]) - rec["mttr_s"]
    assert stopped - interval_s - 0.3 <= began <= stopped + 0.05, (began - stopped, rec)
