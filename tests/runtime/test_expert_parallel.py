"""Expert parallelism between real gloo ranks (parallel.ep): each MoE block's experts computed by
one member of an expert-parallel group on every member's tokens, exchanged by all-to-all -- and
every run, through SIGKILLs in the forward (the dispatch and combine) and the backward, ends with
the reference's bits, load-balancing loss included."""
import pytest

from elaswave.control import faults
from elaswave.sim.experts import exchange_bytes
from tests.helpers.spawn import assert_same_run, job_args, run_cli, run_job, run_reference

STEPS = 5
EXPERTS = ["model.num_experts=4", "model.experts_per_token=2", "model.expert_ffn_dim=48",
           "model.moe_aux_loss_coef=0.05"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_reference(tmp_path_factory.mktemp("ref"), STEPS, True, 4, extra=[*EXPERTS, "parallel.pp=1"])


def _expert_steps(res) -> list[tuple[list[int], bool]]:
    """Each step's expert-parallel group (rank 0's) and whether it sent tokens to its peers."""
    return [(r["expert_group"], r["expert_bytes"] > 0) for r in res.steps]


SLOW = pytest.mark.slow  # the default run keeps the kills, the join and the group of four


@pytest.mark.parametrize("dp,pp,ep,extra,groups", [
    pytest.param(2, 1, 2, [], [[0, 1]] * STEPS, marks=SLOW),
    # Killed as it starts step 2's first dispatch, rank 0 waiting in the same exchange: the job
    # resumes at step 1, whose update step 2 had not yet committed, rank 0 alone with every expert.
    (2, 1, 2, ["elastic.inject=kill:rank=1,step=2,phase=dispatch"], [[0, 1]] + [[0]] * 4),
    # 4 pipelines x 2 stages in teams of 2, (0, 2) with (1, 3) and (4, 6) with (5, 7): groups of 2
    # on each stage; rank 3 killed as it starts a combine, its experts computed for both members'
    # rows but not sent back.
    (4, 2, 2, ["elastic.inject=kill:rank=3,step=2,phase=combine"], [[0, 1]] + [None] * 4),
    # 2 pipelines x 2 stages, each stage's ranks a group; killed in the backward. The survivors'
    # stages then hold other layers: each computes its experts alone.
    (2, 2, 2, ["elastic.inject=kill:rank=3,step=2,phase=backward"], [[0, 1]] + [[0]] * 4),
    # ZB-H1: killed in a W; before it, every expert's gradient folded per member's rows in B.
    # (Rank 2 is stage 1 of pipeline 0 in the team layout. Step 2's record is its group's or, where
    # the kill lands before step 2's snapshot is committed everywhere, the survivors' on a re-run.)
    (2, 2, 2, ["parallel.schedule=zb-h1", "elastic.inject=kill:rank=2,step=3,phase=weight"],
     [[0, 1]] * 2 + [None] + [[0]] * 2),
    # ZB-H1 with every block recomputed: B takes the rows' gradients (and every exchange), W each
    # expert's weights' from the recomputation's graph (expert/exchange.py).
    pytest.param(2, 2, 2, ["parallel.schedule=zb-h1", "train.activation_checkpointing=full"], [[0, 1]] * STEPS,
                 marks=SLOW),
    # 4 x 2 at ep = 2 again, rank 5 (stage 0 of pipeline 3, team 1) killed as it starts a
    # dispatch, and a spare joins: it fills pipeline 3's stage 0, team 1's groups whole again.
    # Team 0 (rank 0's group) is untouched throughout.
    pytest.param(4, 2, 2, ["elastic.inject=kill:rank=5,step=2,phase=dispatch", "elastic.spares=1"], [[0, 1]] * STEPS,
                 marks=SLOW),
    # Each kill phase at each degree the issue names (dp = ep = 2 and 4 on one stage), beside the
    # cases above: a combine and a backward at 2; a dispatch, a combine and a join at 4 (the
    # joiner's pipeline fills the team: rank 0's group is four again, experts given back).
    pytest.param(2, 1, 2, ["elastic.inject=kill:rank=1,step=2,phase=combine"], [[0, 1], None] + [[0]] * 3, marks=SLOW),
    pytest.param(2, 1, 2, ["elastic.inject=kill:rank=1,step=2,phase=backward"], [[0, 1], None] + [[0]] * 3,
                 marks=SLOW),
    pytest.param(4, 1, 4, ["elastic.inject=kill:rank=2,step=2,phase=dispatch"], [[0, 1, 2, 3], None] + [[0, 1, 3]] * 3,
                 marks=SLOW),
    pytest.param(4, 1, 4, ["elastic.inject=kill:rank=2,step=2,phase=combine"], [[0, 1, 2, 3], None] + [[0, 1, 3]] * 3,
                 marks=SLOW),
    pytest.param(4, 1, 4, ["elastic.inject=kill:rank=1,step=1", "elastic.spares=1"], [None] * 4 + [[0, 2, 3, 4]],
                 marks=SLOW),
    # A spare joins after the loss: the group is whole again, its experts given back.
    (2, 1, 2, ["elastic.inject=kill:rank=1,step=1", "elastic.spares=1"], [[0]] + [[0, 2]] * 4),
    # Every block recomputed (each forward's exchange again in the backward), in bfloat16. (The
    # default run recomputes a block over real ranks in tests/expert/test_exchange.py.)
    pytest.param(2, 1, 2, ["train.activation_checkpointing=full", "train.precision=bf16"], [[0, 1]] * STEPS,
                 marks=SLOW),
    # Interleaved 1F1B (V = 2): the same schedule on both pipelines.
    pytest.param(2, 2, 2, ["parallel.schedule=interleaved", "parallel.virtual_stages=2",
                           "elastic.inject=kill:rank=1,step=3,phase=backward"], [[0, 1]] * 2 + [[0]] * 3, marks=SLOW),
], ids=["2", "2-kill-dispatch", "4x2-kill-combine", "2x2-kill-backward", "2x2-zb-h1-kill-weight",
        "2x2-zb-h1-recompute", "4x2-kill-dispatch-join", "2-kill-combine", "2-kill-backward", "4-kill-dispatch",
        "4-kill-combine", "4-join", "2-join", "2-recompute-bf16",
        "2x2-interleaved-kill"])
def test_experts_over_ranks_train_bit_identical_to_the_reference(tmp_path, reference, dp, pp, ep, extra, groups):
    own = [x for x in extra if x.startswith(("train.precision", "model."))]  # what the reference computes too
    if own:
        reference = run_reference(tmp_path, STEPS, True, 4, extra=[*EXPERTS, "parallel.pp=1", *own])
    res = run_job(tmp_path, dp, pp, STEPS, True,
                  extra=[*EXPERTS, f"parallel.pp={pp}", f"parallel.ep={ep}", *extra])
    assert_same_run(res, reference, STEPS)
    # The sums started within the backward (or W) that made them whole (zero/watch.py).
    assert all(r["sums_in_backwards"] >= 1 for r in res.steps if r["epoch"] == 0), [r["sums_in_backwards"] for r in res.steps]
    if "model.moe_aux_loss_coef=0" not in extra:
        assert [r["aux_loss"] for r in res.steps] == [r["aux_loss"] for r in reference.records if r["event"] == "step"]
    for kill in (faults.parse(x.split("=", 1)[1]) for x in extra if x.startswith("elastic.inject=kill")):
        said = f"injecting kill into rank {kill.rank} at step {kill.step} ({kill.phase})"
        assert said in res.stderr, res.stderr[-2000:]  # where it was killed: in that exchange
        assert [r["lost_ranks"] for r in res.records if r["event"] == "recovery"] == [[kill.rank]]
    if "elastic.spares=1" in extra:  # the spare (rank dp x pp) joined in the killed rank's place
        (join,) = [r for r in res.records if r["event"] == "join"]
        assert join["joined_ranks"] == [dp * pp] and any(dp * pp in pipe for pipe in join["plan"]["pipelines"]), join
    assert [s for s, g in zip(_expert_steps(res), groups) if g is not None] == [(g, len(g) > 1) for g in groups
                                                                                 if g is not None]
    if dp == ep and pp == 1 and groups[0] == [0, 1]:  # the simulator's price of a balanced router's exchanges
        tokens = 4 * 2 * 32 // dp  # a rank's share of 4 micro-batches of 2 sequences of 32 tokens
        value_bytes = 2 if "train.precision=bf16" in extra else 4
        priced = exchange_bytes(tokens, 2, 32, value_bytes, ep, 4,
                                recomputed_moe_blocks=4 * ("train.activation_checkpointing=full" in extra))
        measured = [r["expert_bytes"] for r, g in zip(res.steps, groups) if g == [0, 1]]  # steps with a peer
        assert all(0.9 < m / priced < 1.1 for m in measured), (measured, priced)


def test_a_group_of_four_runs_ghosts_loses_one_and_goes_on_as_three_placed_by_load(tmp_path):
    """10 micro-batches: 3, 3, 2 and 2 a pipeline, the two of 2 running a ghost each (no rows of
    their own, every exchange of the group); then 4, 3 and 3 on the survivors -- still one group,
    of three, whose experts are placed by the tokens the router sent each (plan/experts.py)."""
    sets = [*EXPERTS, "parallel.pp=1", "train.num_micro_batches=10"]
    ref = run_reference(tmp_path, STEPS, True, 10, extra=sets)
    res = run_job(tmp_path, 4, 1, STEPS, True, extra=[*sets, "parallel.ep=4",
                                                      "elastic.inject=kill:rank=2,step=2,phase=backward"])
    assert_same_run(res, ref, STEPS)
    assert _expert_steps(res) == [([0, 1, 2, 3], True)] + [([0, 1, 3], True)] * 4
    ghosts = [r["ghost_micro_batches"] for r in res.steps]  # (who gets 4 goes by the measured speeds)
    assert ghosts[0] == [0, 0, 1, 1] and all(sorted(g) == [0, 1, 1] for g in ghosts[1:]), ghosts
    # The first epoch's placement is in blocks (no counts yet); the next one keeps the survivors'
    # experts and places rank 2's by the counts the survivors' reports carried.
    shares = [r["expert_busiest_share"] for r in res.steps]
    assert shares[0] is None and 1.0 <= shares[-1] < 2.0


def test_ghosts_run_down_a_pipeline_without_messages_in_training_and_evaluation(tmp_path):
    """dp = 4 x pp = 2 at ep = 4, 10 micro-batches: 3, 3, 2 and 2 a pipeline, so two pipelines run a
    ghost down both stages (nothing sent between them) under ZB-H1's split backward, and in every
    evaluation's forwards. Rank 7, stage 1 of a pipeline with a ghost, is killed in a dispatch."""
    from tests.runtime.test_evaluation import _prepared
    sets = [*EXPERTS, "parallel.pp=1", "train.num_micro_batches=10", "train.eval_every=2", "train.eval_batches=1",
            f"data.path={_prepared(tmp_path)}"]
    ref = run_reference(tmp_path, STEPS, True, 10, extra=sets)
    res = run_job(tmp_path, 4, 2, STEPS, True, extra=[*sets, "parallel.pp=2", "parallel.ep=4", "parallel.schedule=zb-h1",
                                                      "elastic.inject=kill:rank=7,step=2,phase=dispatch"])
    assert_same_run(res, ref, STEPS)
    assert [r["event"] for r in res.records].count("eval") == [r["event"] for r in ref.records].count("eval") > 0
    assert res.steps[0]["ghost_micro_batches"] == [0, 0, 1, 1] and res.steps[0]["expert_group"] == [0, 1, 2, 3]
    assert [r["lost_ranks"] for r in res.records if r["event"] == "recovery"] == [[7]]


def test_a_team_too_short_to_hold_its_experts_stands_by_keeping_them(tmp_path):
    """dp = 4 x pp = 2 at ep = 2 (teams (0, 2) + (1, 3) and (4, 6) + (5, 7)), 16 micro-batches, a
    limit of 5.5 MiB: rank 3 is killed; rank 1 cannot hold the whole model, and rank 0's pipeline,
    left alone in its team, would hold every expert of its layers: team 0 stands by, and team 1
    runs the whole batch. Team 0's ranks keep the experts they held -- had they given them up,
    team 1's ranks would hold each expert's whole state, over the limit (the job stopped with that
    refusal until then) -- and the end-of-run check finds every holder of an expert equal."""
    sets = [*EXPERTS, "parallel.pp=1", "train.num_micro_batches=16"]
    ref = run_reference(tmp_path, STEPS, True, 16, extra=sets)
    res = run_job(tmp_path, 4, 2, STEPS, True, extra=[*sets, "parallel.pp=2", "parallel.ep=2", "parallel.stage_memory_mb=5.5",
                                                      "elastic.inject=kill:rank=3,step=2,phase=backward"])
    assert_same_run(res, ref, STEPS)
    (rec,) = [r for r in res.records if r["event"] == "recovery"]
    # (how team 1 shares the 16 goes by the measured speeds: 8 and 8, or 7 and 9 on a loaded box)
    mbs = rec["plan"]["micro_batches"]
    assert rec["plan"]["pipelines"] == [[0, 2], [1], [4, 6], [5, 7]] and mbs[:2] == [0, 0] and sum(mbs) == 16, mbs
    assert "ranks [0, 2] stand by with their layers, chunks and experts: their expert-parallel team is short" in res.stderr


@pytest.mark.parametrize("sets,message", [
    (["parallel.ep=3", "parallel.dp=3", "model.num_experts=4"], "parallel.ep=3 is invalid: must divide parallel.dp=3 "
                                                                "and model.num_experts=4"),
    (["parallel.ep=2"], "parallel.ep=2 is invalid: needs a mixture of experts"),
    (["model.num_experts=4", "parallel.ep=2", "elastic.reshape=true"],
     "parallel.ep=2 is invalid: with elastic.reshape=true would never exchange"),
    (["model.num_experts=4", "parallel.tp=2"], "model.num_experts=4 is invalid: a mixture of experts on "
                                                "tensor-parallel shards is not built yet (parallel.tp=2)"),
    (["model.num_experts=4", "elastic.inject=kill:rank=1,step=2,phase=dispatch"],
     "phase=dispatch is an expert-parallel exchange's: needs parallel.ep > 1"),
])
def test_bad_expert_parallel_input_is_one_line(tmp_path, sets, message):
    extra = [*([s for s in EXPERTS if not s.startswith("model.num_experts")] if "model.num_experts=4" in sets else []),
             "parallel.pp=1", *sets]
    res = run_cli(job_args(2, 1, 1, True, extra), tmp_path, timeout_s=60)
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
