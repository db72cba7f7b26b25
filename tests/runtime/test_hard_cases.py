"""The hard cases, with real processes: two ranks dying at once, a death during a recovery, a
damaged snapshot. Each run must equal the failure-free reference bit for bit."""
import pytest

from tests.helpers.memory import limit_between
from tests.helpers.spawn import assert_same_run, job_args, reference_fixture, run_cli, run_job

STEPS = 30
MBS = 12
EXTRA = [f"train.num_micro_batches={MBS}", "parallel.timeout_s=60"]


reference = reference_fixture(STEPS, MBS)


def _run(tmp_path, faults, dp=4, pp=1):
    return run_job(tmp_path, dp, pp, STEPS, True, extra=[*EXTRA, "elastic.inject=" + ";".join(faults)])


def _assert_same_run(res, reference):
    assert_same_run(res, reference, STEPS)


def _recoveries(res):
    return [r for r in res.records if r["event"] == "recovery"]


def test_two_ranks_dying_at_once(tmp_path, reference):
    # Ranks 1 and 3 hold neither's snapshot (the ring is 0->1->2->3->0): both are recovered from memory.
    res = _run(tmp_path, ["kill:rank=1,step=12,phase=backward", "kill:rank=3,step=12,phase=backward"])
    _assert_same_run(res, reference)
    recs = _recoveries(res)
    assert sorted(r for rec in recs for r in rec["lost_ranks"]) == [1, 3]
    assert not any(rec["is_fallback"] for rec in recs)
    assert res.summary["ranks"] == [0, 2]


@pytest.mark.slow  # the default run keeps a faster case of the same path; `pytest -m slow` runs it
def test_a_rank_dying_during_the_recovery_from_another(tmp_path, reference):
    # Rank 2 dies after its update in step 12 (so the recovery resumes at 12: every holder has
    # verified step 12's snapshots); rank 0 dies while that recovery moves chunks. The survivors
    # give up the epoch being built and agree on the next one from the state they had.
    res = _run(tmp_path, ["kill:rank=2,step=12,phase=optimizer", "kill:rank=0,step=12,phase=recovery"])
    _assert_same_run(res, reference)
    recs = _recoveries(res)
    assert sorted(r for rec in recs for r in rec["lost_ranks"]) == [0, 2]
    assert recs[-1]["epoch"] == 2 and res.summary["epoch"] == 2  # epoch 1 was never trained in
    assert not any(rec["is_fallback"] for rec in recs)
    assert res.summary["ranks"] == [1, 3]


def test_every_rank_lost_is_in_a_record_when_a_death_follows_a_recovery(tmp_path, reference):
    # Rank 1 dies in step 12's backward; rank 3 dies after its update in step 12 -- in the redo of
    # step 12 when the recovery resumed there (the first change then never completed a step and
    # has no record of its own: the second record names both, timed from the first fault), or in
    # a later change when the recovery resumed at 11. Either way every lost rank is in a record
    # (issue 20: the world went from 6 to 4 while the only record named one rank).
    res = _run(tmp_path, ["kill:rank=1,step=12,phase=backward", "kill:rank=3,step=12,phase=optimizer"])
    _assert_same_run(res, reference)
    recs = _recoveries(res)
    assert sorted(r for rec in recs for r in rec["lost_ranks"]) == [1, 3]
    assert all(set(rec["evidence"]) == {str(r) for r in rec["lost_ranks"]} for rec in recs)
    if len(recs) == 1:
        (rec,) = recs
        assert rec["num_changes"] == 2 and rec["phases_s"]["interrupted"] > 0
        assert sum(rec["phases_s"].values()) == pytest.approx(rec["mttr_s"], abs=0.25)
    assert res.summary["ranks"] == [0, 2]


def test_a_rank_dying_during_a_pipeline_recovery(tmp_path, reference):
    res = _run(tmp_path, ["kill:rank=3,step=10,phase=optimizer", "kill:rank=4,step=10,phase=recovery"], dp=3, pp=2)
    _assert_same_run(res, reference)
    assert res.summary["ranks"] == [0, 1, 2, 5]


@pytest.mark.slow  # the default run keeps a faster case of the same path; `pytest -m slow` runs it
def test_a_damaged_snapshot_is_caught_and_training_goes_on(tmp_path, reference):
    res = _run(tmp_path, ["corrupt:rank=1,step=6"])
    _assert_same_run(res, reference)
    assert "the snapshot of rank 1 for step 7 failed its checksum" in res.stderr
    assert not _recoveries(res) and res.summary["ranks"] == [0, 1, 2, 3]


def test_a_damaged_snapshot_then_its_owner_dying(tmp_path, reference):
    # Rank 1's snapshot for step 7 is discarded; rank 1 dies in step 8 after the next one verified.
    res = _run(tmp_path, ["corrupt:rank=1,step=6", "kill:rank=1,step=8,phase=optimizer"])
    _assert_same_run(res, reference)
    (rec,) = _recoveries(res)
    assert rec["lost_ranks"] == [1] and not rec["is_fallback"]


def test_a_straggler_gets_less_work_instead_of_being_dropped(tmp_path, reference):
    # From step 8 rank 1's compute takes four times as long; it stays, with fewer layers.
    res = run_job(tmp_path, 2, 2, STEPS, True, extra=[*EXTRA, "elastic.straggler_gain=0.3",
                                                      "elastic.inject=slow:rank=1,step=8,factor=4"])
    _assert_same_run(res, reference)
    assert not _recoveries(res)
    rebalances = [r for r in res.records if r["event"] == "rebalance"]
    # The answer to the slowdown: the first re-plan after step 8 (a loaded machine's noisy speeds
    # can re-plan earlier too; a loaded pass once did at step 5, bit-identical all the same).
    answer = next((r for r in rebalances if r["resume_step"] > 8), None)
    assert answer is not None, rebalances
    first = answer["plan"]
    assert first["pipelines"] == [[0, 1], [2, 3]]
    (_, end0), (start1, end1) = first["layer_ranges"][0]
    assert end1 - start1 < 3  # rank 1 held 3 of the 6 layers before
    assert first["micro_batches"][0] < first["micro_batches"][1]  # and its pipeline runs fewer micro-batches
    assert res.summary["ranks"] == [0, 1, 2, 3]
    slow = [r["step_time_s"] for r in res.steps if 8 <= r["step"] < answer["resume_step"]]
    after = [r["step_time_s"] for r in res.steps if r["step"] > rebalances[-1]["resume_step"]]
    # Load from other processes only adds time: each window's fastest step is its least disturbed
    # (the medians, of 3 slow steps here, crossed once in a suite run beside a CPU-bound bench).
    assert min(after) < min(slow), (slow, after)


def test_no_plan_fits_after_a_loss_the_state_is_saved_and_a_restart_loses_nothing(tmp_path, reference):
    # A limit between what a stage of two needs and what the whole model on one rank needs (the
    # memory model's figures): rank 0 cannot go on alone after rank 1 dies.
    ckpt = tmp_path / "ckpt"
    limits = [f"parallel.stage_memory_mb={limit_between(EXTRA, 1, deterministic=True)}", f"checkpoint.dir={ckpt}",
              "checkpoint.every_steps=1000"]
    args = job_args(1, 2, STEPS, True, [*EXTRA, *limits, "elastic.inject=kill:rank=1,step=7,phase=optimizer"])
    stopped = run_cli(args, tmp_path)
    assert stopped.returncode != 0
    assert "no pipeline can hold the model: pipeline 0 is left with ranks [0]" in stopped.stderr
    assert f"its state at step 7 is saved in {ckpt}" in stopped.stderr
    assert [r["step"] for r in stopped.steps] == list(range(7))
    again = run_cli(job_args(1, 2, STEPS, True, [*EXTRA, *limits]), tmp_path)
    assert again.returncode == 0, again.stderr
    assert [r["step"] for r in again.steps] == list(range(7, STEPS))
    assert again.losses == reference.losses[7:]
    assert again.summary["params_sha256"] == reference.summary["params_sha256"]


@pytest.mark.parametrize("fault", [pytest.param("kill:rank=0,step=12,phase=snapshot", marks=pytest.mark.slow),
                                   "stop:rank=0,step=12,phase=optimizer"])
def test_the_metrics_writer_lost_after_the_others_committed_a_step(tmp_path, reference, fault):
    # Rank 0 writes the metrics. Lost after step 12's exchange, it never writes step 11, which the
    # others committed in that exchange: the next writer writes it (found by the chaos runs).
    res = _run(tmp_path, [fault])
    _assert_same_run(res, reference)
    assert res.summary["ranks"] == [1, 2, 3]
