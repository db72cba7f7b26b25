"""Real gloo ranks training a mixture of experts (the tiny Llama with 4 experts a block, top 2):
the experts are layers' parameters like any, so data-parallel ranks hold them all, and every run
-- with the load-balancing loss in the objective, through a SIGKILL and a join, with recomputed
blocks, and split into a pipeline without the loss -- ends with the reference's bits."""
import pytest

from tests.helpers.spawn import assert_same_run, job_args, run_cli, run_job, run_reference

STEPS = 5
EXPERTS = ["model.num_experts=4", "model.experts_per_token=2", "model.expert_ffn_dim=48"]
BALANCED = [*EXPERTS, "model.moe_aux_loss_coef=0.05", "parallel.pp=1"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_reference(tmp_path_factory.mktemp("ref"), STEPS, True, 4, extra=BALANCED)


@pytest.mark.parametrize("dp,extra", [
    (2, ["elastic.inject=kill:rank=1,step=2,phase=backward"]),
    (3, ["elastic.inject=kill:rank=2,step=1", "elastic.spares=1"]),
    (2, ["train.activation_checkpointing=full"]),  # a recomputed block records its routing once
], ids=["kill", "join", "recompute"])
def test_experts_with_the_balancing_loss_train_bit_identical_to_the_reference(tmp_path, reference, dp, extra):
    res = run_job(tmp_path, dp, 1, STEPS, True, extra=[*BALANCED, *extra])
    assert_same_run(res, reference, STEPS)
    steps = [r for r in res.records if r["event"] == "step"]
    assert [r["aux_loss"] for r in steps] == [r["aux_loss"] for r in reference.records if r["event"] == "step"]
    # E * sum_e f_e P_e is k (2) at perfect balance, where f_e (the share of assignments) sums to k
    assert all(1.5 < r["aux_loss"] < 4.0 for r in steps), [r["aux_loss"] for r in steps]
    killed = [int(x.split("rank=")[1].split(",")[0]) for x in extra if x.startswith("elastic.inject")]
    assert [r["lost_ranks"] for r in res.records if r["event"] == "recovery"] == [[k] for k in killed]


def test_a_pipeline_of_experts_without_the_balancing_loss_is_bit_identical(tmp_path):
    plain = [*EXPERTS, "model.moe_aux_loss_coef=0"]
    ref = run_reference(tmp_path, STEPS, True, 4, extra=plain)
    res = run_job(tmp_path, 2, 2, STEPS, True, extra=[*plain, "elastic.inject=kill:rank=3,step=2,phase=forward"])
    assert_same_run(res, ref, STEPS)


def test_the_balancing_loss_in_a_pipeline_is_one_line(tmp_path):
    res = run_cli(job_args(1, 2, 2, True, [*EXPERTS, "model.moe_aux_loss_coef=0.05"]), tmp_path, timeout_s=60)
    assert res.returncode == 2 and "pipelines are not built yet: use parallel.pp=1" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
