"""Real gloo ranks training a mixture of experts (the tiny Llama with 4 experts a block, top 2):
the experts are layers' parameters like any, so data-parallel ranks hold them all, and every run
-- with the load-balancing loss in the objective, through a SIGKILL and a join, with recomputed
blocks, split into a pipeline under each schedule, and without the loss -- ends with the reference's bits."""
import pytest

from tests.helpers.spawn import assert_same_run, run_job, run_reference

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
    # The sums started within the backward that made them whole (zero/watch.py): a block is whole
    # once its router and attention are, whichever experts its rows reached.
    assert all(r["sums_in_backwards"] >= 1 for r in res.steps if r["epoch"] == 0), [r["sums_in_backwards"] for r in res.steps]
    steps = [r for r in res.records if r["event"] == "step"]
    assert [r["aux_loss"] for r in steps] == [r["aux_loss"] for r in reference.records if r["event"] == "step"]
    # E * sum_e f_e P_e is k (2) at perfect balance, where f_e (the share of assignments) sums to k
    assert all(1.5 < r["aux_loss"] < 4.0 for r in steps), [r["aux_loss"] for r in steps]
    killed = [int(x.split("rank=")[1].split(",")[0]) for x in extra if x.startswith("elastic.inject")]
    assert [r["lost_ranks"] for r in res.records if r["event"] == "recovery"] == [[k] for k in killed]


@pytest.mark.parametrize("dp,pp,extra", [
    (2, 2, ["elastic.inject=kill:rank=3,step=2,phase=backward"]),
    (1, 3, ["train.activation_checkpointing=every_2"]),
    (1, 6, []),  # the first and last stages hold no MoE block: the statistics pass through
    (2, 2, ["parallel.schedule=zb-h1", "elastic.inject=kill:rank=2,step=2,phase=backward"]),  # W after B
    # Round a ring of virtual stages: each rank sees a micro-batch once per chunk.
    (1, 3, ["parallel.schedule=interleaved", "parallel.virtual_stages=2"]),
    (2, 2, ["parallel.schedule=interleaved", "parallel.virtual_stages=2", "elastic.inject=kill:rank=1,step=2,phase=backward"]),
    # The lost rank's chunks through its peer (pipeline/routed.py), the statistics beside them.
    (2, 2, ["parallel.schedule=interleaved", "parallel.virtual_stages=2", "elastic.policy=reroute",
            "elastic.inject=kill:rank=2,step=2,phase=forward"]),
], ids=["2x2-kill", "1x3-recompute", "1x6", "zb-h1-kill", "interleaved-1x3", "interleaved-2x2-kill", "interleaved-2x2-detours"])
def test_the_balancing_loss_spans_a_pipeline_bit_identical_to_the_reference(tmp_path, reference, dp, pp, extra):
    """Each forward's routing statistics travel beside the activation, the totals back beside the
    gradient, and every stage's blocks take the same gradient as in the reference."""
    res = run_job(tmp_path, dp, pp, STEPS, True, extra=[*BALANCED, *extra, f"parallel.pp={pp}"])
    assert_same_run(res, reference, STEPS)
    steps = [r for r in res.records if r["event"] == "step"]
    assert [r["aux_loss"] for r in steps] == [r["aux_loss"] for r in reference.records if r["event"] == "step"]


def test_the_balancing_loss_round_a_ring_of_two_in_its_peers_send_order(tmp_path):
    """pp = 2, V = 2, 5 micro-batches: a rank sends a gradient before an activation its peer needs
    first, so the peer takes both (and what travels beside each) in the send order (p2p.P2P.expect)."""
    ref = run_reference(tmp_path, 3, True, 5, extra=BALANCED)
    res = run_job(tmp_path, 1, 2, 3, True, extra=[*BALANCED, "parallel.pp=2", "train.num_micro_batches=5",
                                                  "parallel.schedule=interleaved", "parallel.virtual_stages=2"])
    assert_same_run(res, ref, 3)
    assert [r["aux_loss"] for r in res.steps] == [r["aux_loss"] for r in ref.records if r["event"] == "step"]


def test_the_balancing_loss_on_detours_of_the_reroute_baseline(tmp_path, reference):
    """Rank 1 (stage 1 of pipeline 0) is lost; its micro-batches pass through rank 3, the
    statistics with them there and back."""
    res = run_job(tmp_path, 2, 2, STEPS, True, extra=[*BALANCED, "parallel.pp=2", "elastic.policy=reroute",
                                                      "parallel.timeout_s=60", "elastic.inject=kill:rank=1,step=2,phase=forward"])
    assert_same_run(res, reference, STEPS)
    assert [r["aux_loss"] for r in res.steps] == [r["aux_loss"] for r in reference.records if r["event"] == "step"]
    assert [r["plan"]["detours"] for r in res.records if r["event"] == "recovery"] == [2]


def test_a_reshaped_deal_keeps_each_units_balancing_loss(tmp_path):
    """elastic.reshape deals sequences after a loss; each unit is a forward of its own (in the
    reference too), so its load-balancing loss and gradient are the same wherever it runs."""
    sets = [*BALANCED, "elastic.reshape=true"]
    ref = run_reference(tmp_path, STEPS, True, 4, extra=sets)
    res = run_job(tmp_path, 3, 2, STEPS, True, extra=[*sets, "parallel.pp=2",
                                                      "elastic.inject=kill:rank=2,step=2,phase=backward"])
    assert_same_run(res, ref, STEPS)
    assert [r["aux_loss"] for r in res.steps] == [r["aux_loss"] for r in ref.records if r["event"] == "step"]


def test_a_pipeline_without_the_balancing_loss_still_records_its_whole_value(tmp_path):
    """moe_aux_loss_coef=0: no term in the objective, but the recorded aux_loss is over every
    block of the pipeline, as the reference's (it was the last stage's blocks' alone)."""
    plain = [*EXPERTS, "model.moe_aux_loss_coef=0"]
    ref = run_reference(tmp_path, STEPS, True, 4, extra=plain)
    res = run_job(tmp_path, 1, 3, STEPS, True, extra=plain)
    assert_same_run(res, ref, STEPS)
    assert [r["aux_loss"] for r in res.steps] == [r["aux_loss"] for r in ref.records if r["event"] == "step"]
