"""The whole training state is compared, not only one copy of the parameters: a flipped bit in one
Adam moment of one rank changes the state digest (its parameters still match), a flipped bit in
one holder's copy of a layer fails the run, naming it, and so does a tensor-parallel shard whose
copy of a replicated tensor (a norm weight) drifted from its device's other shards'."""
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


def test_a_tensor_parallel_shard_whose_replica_drifted_fails_the_run(tmp_path):
    # Rank 1 (shard 1, the one device: dp=1) flips its input norm's first weight in its parameters
    # and its master alike: its slice agrees with itself, and the whole-layer digest reads shard
    # 0's copy of a norm -- only the comparison across the shards sees it. (A clean tp=2 end:
    # tests/runtime/test_tensor_parallel.py.)
    steps = 3
    args = job_args(1, 1, steps, True, [*EXTRA, "model.preset=llama-tiny", "model.num_heads=8", "model.num_kv_heads=4",
                                        "parallel.tp=2",
                                        f"elastic.inject=flip:rank=1,step={steps - 1},what=replica"])
    res = run_cli(args, tmp_path)
    assert res.returncode != 0, "the drifted replica went unseen"
    assert "the replicas of the training state differ at the end of the run" in res.stderr
    assert ("layer 1 input_layernorm.weight: the tensor-parallel shards of device 0 disagree: "
            "shards [0] (ranks [0])") in res.stderr and "shards [1] (ranks [1])" in res.stderr
    assert "summary" not in {r["event"] for r in res.records}
