"""Real gloo ranks, real SIGKILLs, in bf16: bfloat16 layers with float32 master shards train the
same run as the single-process bf16 reference through a kill of a stage and through a join, and a
different run from float32 (so bf16 is really in effect)."""
import pytest

from elaswave import config
from elaswave.model.contract import counted_numels
from elaswave.model.registry import model_for
from tests.helpers.spawn import TINY, assert_same_run, run_job, run_reference

STEPS, MBS, CHUNK = 8, 6, 512
BF16 = ["train.precision=bf16", f"train.num_micro_batches={MBS}", f"parallel.chunk_numel={CHUNK}",
        "parallel.timeout_s=60"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_reference(tmp_path_factory.mktemp("ref"), STEPS, deterministic=True, num_micro_batches=MBS, extra=BF16)


def test_bf16_is_not_fp32(tmp_path, reference):
    fp32 = run_reference(tmp_path, STEPS, deterministic=True, num_micro_batches=MBS,
                         extra=["train.precision=fp32", f"train.num_micro_batches={MBS}"])
    assert (reference.summary["precision"], fp32.summary["precision"]) == ("bf16", "fp32")
    assert fp32.losses != reference.losses
    assert fp32.summary["params_sha256"] != reference.summary["params_sha256"]
    # Rounding, not a different computation: the curves agree to bf16's precision.
    assert all(abs(a - b) < 0.02 * a for a, b in zip(fp32.losses, reference.losses))


@pytest.mark.parametrize("dp,pp,fault", [
    (2, 2, "kill:rank=1,step=3,phase=backward"),   # a last stage: the tied head's holder
    (1, 3, "kill:rank=0,step=3,phase=reduce"),     # the first stage of the only pipeline
])
def test_bf16_survives_a_kill_bit_identical(tmp_path, reference, dp, pp, fault):
    res = run_job(tmp_path, dp, pp, STEPS, True, extra=[*BF16, f"elastic.inject={fault}"])
    assert res.summary["precision"] == "bf16"
    assert_same_run(res, reference, STEPS)
    assert [r["lost_ranks"] for r in res.records if r["event"] == "recovery"] == [[int(fault[10])]]
    # After the recovery every parameter's float32 master and moments exist once in the job: 12
    # bytes each, plus the padding of partial chunks and uneven slots.
    numels = counted_numels(model_for(config.load(None, [*TINY, *BF16])))
    held = sum(res.summary["optimizer_state_bytes_per_rank"]) + sum(res.summary["master_bytes_per_rank"])
    ideal = 12 * sum(numels)
    padding = 12 * CHUNK * (len(numels) + len(res.summary["ranks"]) * len(numels))
    assert ideal <= held <= ideal + padding, (held, ideal)
    print(f"\nbf16 ({dp},{pp}) after a kill: master + moments {held} B = {held / ideal:.3f} x 12 B x {sum(numels)} params")


JOIN_STEPS = 150  # a replacement is a new process: seconds of start-up before it can join


@pytest.mark.parametrize("dp,pp,victim", [pytest.param(2, 2, 1, marks=pytest.mark.slow),
                                          pytest.param(1, 3, 2, marks=pytest.mark.slow)])
def test_bf16_replacement_joins_and_gives_the_same_run(tmp_path, dp, pp, victim):
    reference = run_reference(tmp_path, JOIN_STEPS, deterministic=True, num_micro_batches=MBS, extra=BF16)
    res = run_job(tmp_path, dp, pp, JOIN_STEPS, True,
                  extra=[*BF16, f"elastic.inject=kill:rank={victim},step=2,phase=backward"], cli=["--respawn-after", "0"])
    assert_same_run(res, reference, JOIN_STEPS)
    assert [r for r in res.records if r["event"] == "join"], "the replacement did not join before the end"
    assert res.summary["world_size"] == dp * pp
