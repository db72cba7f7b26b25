"""The whole training state is compared, not only one copy of the parameters: a flipped bit in one
Adam moment of one rank changes the state digest (its parameters still match), and a flipped bit in
one holder's copy of a layer fails the run, naming it."""
from tests.helpers.spawn import assert_same_run, reference_fixture, run_cli, job_args, run_job

STEPS = 8
MBS = 4
EXTRA = [f"train.num_micro_batches={MBS}", "parallel.timeout_s=60"]

reference = reference_fixture(STEPS, MBS)


def test_a_clean_run_has_the_references_whole_state(tmp_path, reference):
    assert_same_run(run_job(tmp_path, 2, 2, STEPS, True, extra=EXTRA), reference, STEPS)


def test_one_flipped_bit_in_one_adam_moment_is_caught(tmp_path, reference):
    res = run_job(tmp_path, 2, 1, STEPS, True, extra=[*EXTRA, f"elastic.inject=flip:rank=1,step={STEPS - 1},what=moment"])
    assert res.losses == reference.losses
    assert res.summary["params_sha256"] == reference.summary["params_sha256"]  # what used to be compared
    assert res.summary["state_sha256"] != reference.summary["state_sha256"]


def test_one_holder_with_a_different_copy_fails_the_run(tmp_path):
    args = job_args(2, 1, STEPS, True, [*EXTRA, f"elastic.inject=flip:rank=1,step={STEPS - 1},what=param"])
    res = run_cli(args, tmp_path)
    assert res.returncode != 0
    assert "the replicas of the training state differ at the end of the run" in res.stderr
    assert "layer 0: its holders disagree" in res.stderr
    assert "summary" not in {r["event"] for r in res.records}
