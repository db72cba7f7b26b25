"""Real gloo ranks, real SIGKILLs: a tiny Llama with grouped-query attention and a tied
embedding/head trains the same run as the single-process reference in every layout, when its
first or its last stage dies (the tied tensor's two uses then move between ranks), and when a
replacement joins."""
import pytest

from tests.helpers.spawn import assert_same_run, run_job, run_reference

STEPS, MBS = 10, 6
LLAMA = ["model.preset=llama-tiny", "model.num_heads=4", "model.num_kv_heads=2", "model.dropout=0.1",
         f"train.num_micro_batches={MBS}", "parallel.timeout_s=60"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_reference(tmp_path_factory.mktemp("ref"), STEPS, deterministic=True, num_micro_batches=MBS, extra=LLAMA)


def _recoveries(res):
    return [r for r in res.records if r["event"] == "recovery"]


@pytest.mark.parametrize("dp,pp,fault", [
    (2, 2, "kill:rank=2,step=4,phase=forward"),    # first stage: the embedding's holder
    (2, 2, "kill:rank=1,step=4,phase=reduce"),     # last stage: the tied head's holder
    (1, 3, "kill:rank=2,step=4,phase=backward"),   # last stage of the only pipeline
    (3, 1, "kill:rank=1,step=4,phase=optimizer"),  # a whole replica
])
def test_tied_llama_survives_the_loss_of_a_first_or_last_stage(tmp_path, reference, dp, pp, fault):
    res = run_job(tmp_path, dp, pp, STEPS, True, extra=[*LLAMA, f"elastic.inject={fault}"])
    assert_same_run(res, reference, STEPS)
    model = res.records[0]["config"]["model"]
    assert model["arch"] == "llama" and model["tie_embeddings"] and model["num_kv_heads"] == 2
    (rec,) = _recoveries(res)
    assert rec["lost_ranks"] == [int(fault.split("rank=")[1].split(",")[0])]


JOIN_STEPS = 150  # a replacement is a new process: seconds of start-up before it can join


@pytest.mark.slow  # the default run keeps a faster case of the same path; `pytest -m slow` runs it
def test_tied_llama_replacement_joins_and_gives_the_same_run(tmp_path):
    reference = run_reference(tmp_path, JOIN_STEPS, deterministic=True, num_micro_batches=MBS, extra=LLAMA)
    res = run_job(tmp_path, 2, 2, JOIN_STEPS, True, extra=[*LLAMA, "elastic.inject=kill:rank=1,step=2,phase=backward"],
                  cli=["--respawn-after", "0"])
    assert_same_run(res, reference, JOIN_STEPS)
    joins = [r for r in res.records if r["event"] == "join"]
    assert joins, "the replacement did not join before the end"
    assert res.summary["world_size"] == 4
