"""Real gloo ranks: the ZB-H1 schedule (each backward split into B and W) trains the same run as
1F1B and the single-process reference, bit for bit, also through a SIGKILL in a B. With tensor
parallelism: tests/runtime/test_tensor_parallel.py."""
import pytest

from tests.helpers.spawn import assert_same_run, run_job, reference_fixture

STEPS = 6
ZB = ["parallel.schedule=zb-h1"]

reference = reference_fixture(STEPS, 4)  # run_job's global batch: max(4, dp) micro-batches
reference_of_6 = reference_fixture(STEPS, 6)


# Recomputed layers give the reference's bits too (tests/runtime/test_layouts.py): W recomputes them again.
@pytest.mark.parametrize("dp,pp,extra", [(1, 2, []), (2, 2, ["train.activation_checkpointing=selective"]),
                                         (1, 4, ["train.activation_checkpointing=every_2"])])
def test_zb_h1_is_bit_identical_to_the_reference(tmp_path, reference, dp, pp, extra):
    res = run_job(tmp_path, dp, pp, STEPS, deterministic=True, extra=[*ZB, *extra])
    assert res.records[0]["config"]["parallel"]["schedule"] == "zb-h1"
    assert_same_run(res, reference, STEPS)
    # Rank 0's sums started within its last W (zero/watch.py), which is its stage's whole backward.
    assert all(r["sums_in_backwards"] >= 1 for r in res.steps), [r["sums_in_backwards"] for r in res.steps]


@pytest.mark.parametrize("phase", ["backward", "weight"])
def test_a_kill_in_a_split_backward_still_ends_bit_identical(tmp_path, reference, phase):
    """dp=2 x pp=2: the last stage of pipeline 1 is SIGKILLed as its first B (backward) or its
    first W (weight) starts, while the others hold W passes back; the survivors drop their pending
    halves with the broken step, re-plan and redo it, and end with the reference's bits."""
    res = run_job(tmp_path, 2, 2, STEPS, deterministic=True,
                  extra=[*ZB, f"elastic.inject=kill:rank=3,step=2,phase={phase}"])
    assert f"injecting kill into rank 3 at step 2 ({phase})" in res.stderr
    assert any(r["event"] == "recovery" for r in res.records)
    assert_same_run(res, reference, STEPS)


def test_the_reroute_baseline_keeps_zb_h1_with_its_guests_and_the_bits(tmp_path, reference_of_6):
    """dp=3 x pp=2 under ZB-H1, the last stage of pipeline 0 SIGKILLed as its first W starts: its
    micro-batches pass through the last stage of the other pipelines, each host running its ZB-H1
    order with its guest's F, B and W in (pipeline/routed.py), and the run keeps the reference's bits."""
    res = run_job(tmp_path, 3, 2, STEPS, deterministic=True,
                  extra=[*ZB, "train.num_micro_batches=6", "elastic.policy=reroute",
                         "elastic.inject=kill:rank=1,step=2,phase=weight"])
    (rec,) = [r for r in res.records if r["event"] == "recovery"]
    assert rec["plan"]["detours"] == 2 and rec["plan"]["pipelines"][0] == [0]
    assert_same_run(res, reference_of_6, STEPS)


def test_fast_bf16_zb_h1_keeps_the_bits_of_1f1b(tmp_path):
    """Fast mode, bfloat16 layers: each weight's gradient goes into a float32 sum by its hook as
    AccumulateGrad writes it. W writes them through AccumulateGrad in 1F1B's micro-batch order, so
    the same pipeline trains the same bits either way."""
    sets = ["train.precision=bf16"]
    one_f_one_b = run_job(tmp_path, 1, 2, STEPS, deterministic=False, extra=sets)
    zb = run_job(tmp_path, 1, 2, STEPS, deterministic=False, extra=[*sets, *ZB])
    assert zb.losses == one_f_one_b.losses
    assert zb.summary["params_sha256"] == one_f_one_b.summary["params_sha256"]
