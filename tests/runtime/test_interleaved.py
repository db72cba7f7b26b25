"""Real gloo ranks: interleaved 1F1B (V model chunks a rank) trains the same run as the
single-process reference, bit for bit, also through SIGKILLs after which the survivors are
re-partitioned into p' x V chunks and stay interleaved, and through a join that gives a rank back."""
import pytest

from elaswave import config
from elaswave.model.contract import tie_pairs
from elaswave.model.registry import model_for
from elaswave.plan.plan import Plan
from tests.helpers.spawn import assert_same_run, job_args, run_cli, run_job, reference_fixture

STEPS = 6


def interleaved(v: int) -> list[str]:
    return ["parallel.schedule=interleaved", f"parallel.virtual_stages={v}"]


reference = reference_fixture(STEPS, 4)  # run_job's global batch: max(4, dp) micro-batches


# The default run keeps 1x2x2 and 1x3x2 with recomputation; `pytest -m slow` adds 2x2x3.
@pytest.mark.parametrize("dp,pp,v,extra", [(1, 2, 2, []), pytest.param(2, 2, 3, [], marks=pytest.mark.slow),
                                           (1, 3, 2, ["train.activation_checkpointing=every_2"])])
def test_interleaved_is_bit_identical_to_the_reference(tmp_path, reference, dp, pp, v, extra):
    res = run_job(tmp_path, dp, pp, STEPS, deterministic=True, extra=[*interleaved(v), *extra])
    assert res.records[0]["config"]["parallel"]["virtual_stages"] == v
    assert_same_run(res, reference, STEPS)


@pytest.mark.parametrize("rank,phase", [(1, "forward"), pytest.param(3, "backward", marks=pytest.mark.slow),
                                        (2, "snapshot")])
def test_a_kill_leaves_the_survivors_interleaved_and_bit_identical(tmp_path, reference, rank, phase):
    """dp=2 x pp=2, V=2: a rank SIGKILLed in its forward or backward, or after its update with its
    parameter all-gathers still out (snapshot: its peers wait for them in the next forwards); its
    pipeline's survivor runs both halves of the model as two chunks of its own (the ring closes on
    itself), the other pipeline keeps its four virtual stages, and the run ends with the
    reference's bits."""
    res = run_job(tmp_path, 2, 2, STEPS, deterministic=True,  # (detours: the next test)
                  extra=[*interleaved(2), f"elastic.inject=kill:rank={rank},step=2,phase={phase}", "elastic.detours=false"])
    assert f"injecting kill into rank {rank} at step 2 ({phase})" in res.stderr
    plans = [r["plan"] for r in res.records if r["event"] == "recovery"]
    assert plans, res.stderr
    after = plans[-1]
    assert after["virtual_stages"] == 2
    assert all(len(rng) == 2 * len(pipe) for pipe, rng in zip(after["pipelines"], after["layer_ranges"]))
    # Before the loss, rank 0 (whose records these are) summed its chunk 1's gradients while it still
    # computed its chunk 0 (parallel.overlap_grad_reduce), with the reference's bits all the same.
    assert all(r["early_sums"] >= 1 for r in res.steps if r["epoch"] == 0), [r["early_sums"] for r in res.steps]
    # And in every step after another of its epoch, its forwards waited for each of the last update's
    # parameter all-gathers (parallel.overlap_param_gather): a layer's forward needs its own, not the
    # step's end. (A change gathers every layer before its first step.)
    model = model_for(config.from_dict(res.records[0]["config"]))
    layout = Plan(epoch=1, num_layers=model.num_layers, pipelines=tuple(map(tuple, after["pipelines"])),
                  layer_ranges=tuple(tuple(map(tuple, rs)) for rs in after["layer_ranges"]), micro_batches=(),
                  ties=tie_pairs(model), virtual_stages=2)  # (the tiny model's layers make a bucket a chunk)
    shared = sum(0 in h and len(h) > 1 for h, _ in layout.gradient_buckets())
    followers = [r for prev, r in zip(res.steps, res.steps[1:]) if prev["epoch"] == r["epoch"] == res.steps[-1]["epoch"]]
    assert shared >= 2 and followers and all(r["gathers_in_forwards"] == shared for r in followers), \
        (shared, [(r["step"], r["epoch"], r["gathers_in_forwards"]) for r in res.steps])
    assert_same_run(res, reference, STEPS)


@pytest.mark.slow  # reshaping and interleaving each have fast cases of their own
def test_a_reshaped_deal_after_a_kill_is_the_same_run_interleaved_or_not(tmp_path):
    """elastic.reshape deals sequences, not whole micro-batches, after the loss; in deterministic
    mode each unit is computed alone, on every chunk, so the run keeps 1F1B's bits."""
    # Emulated compute: the measured speeds the deal weighs are the modelled ones, not this box's load.
    sets = ["elastic.reshape=true", "elastic.inject=kill:rank=2,step=2,phase=backward", "emulate.enabled=true",
            "emulate.block_forward_ms=5"]
    plain = run_job(tmp_path, 3, 2, STEPS, deterministic=True, extra=sets)
    res = run_job(tmp_path, 3, 2, STEPS, deterministic=True, extra=[*interleaved(2), *sets])
    (rec,) = [r for r in res.records if r["event"] == "recovery"]
    units = [u for pipeline in rec["plan"]["units"] for u in pipeline]
    assert sum(units) == 8 and 1 in units  # the deal did split a micro-batch (2 sequences each)
    assert res.losses == plain.losses
    assert res.summary["params_sha256"] == plain.summary["params_sha256"]
    assert res.summary["state_sha256"] == plain.summary["state_sha256"]


def test_bad_virtual_stages_are_one_line(tmp_path):
    for sets, words in [(["parallel.schedule=interleaved"], "parallel.virtual_stages"),
                        (["parallel.virtual_stages=2"], "parallel.virtual_stages"),
                        ([*interleaved(4)], "8 chunks must be <= the model's 6 layers")]:
        res = run_cli(job_args(1, 2, 2, True, sets), tmp_path, timeout_s=60)
        assert res.returncode == 2 and words in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr


JOIN_STEPS = 60
join_reference = reference_fixture(JOIN_STEPS, 4)


def test_a_spare_gives_the_pipeline_its_rank_back_interleaved(tmp_path, join_reference):
    """Rank 3 killed, the warm spare promoted: its pipeline shrinks to one rank of two chunks, then
    grows back to two ranks of two chunks each, and the run keeps the reference's bits throughout."""
    res = run_job(tmp_path, 2, 2, JOIN_STEPS, True,
                  extra=[*interleaved(2), "elastic.inject=kill:rank=3,step=5", "elastic.spares=1"])
    assert_same_run(res, join_reference, JOIN_STEPS)
    (join,) = [r for r in res.records if r["event"] == "join"]
    assert join["joined_ranks"] == [4] and join["plan"]["pipelines"] == [[0, 1], [2, 4]]
    assert [len(r) for r in join["plan"]["layer_ranges"]] == [4, 4] and join["plan"]["virtual_stages"] == 2


ODD = 5
odd_reference = reference_fixture(STEPS, ODD)


def test_a_pair_receives_in_its_peers_send_order_and_keeps_the_bits(tmp_path, odd_reference):
    """pp=2, V=2, 5 micro-batches: a rank's next message from its peer is sometimes not the one it
    needs next (tests/pipeline/test_schedule.py); it receives in the peer's order, keeping the early
    one, as NCCL's order matching requires -- and the run equals the reference."""
    res = run_job(tmp_path, 1, 2, STEPS, deterministic=True, extra=[*interleaved(2), f"train.num_micro_batches={ODD}"])
    assert_same_run(res, odd_reference, STEPS)


reference_of_6 = reference_fixture(STEPS, 6)


def test_a_broken_pipeline_stands_by_where_that_is_the_faster_plan(tmp_path, reference_of_6):
    """dp=3 x pp=2, V=2, 6 micro-batches, rank 1 SIGKILLed in the first step (before any speed is
    measured, so the planner weighs the layers' modelled costs alone -- until session 45 a
    placeholder speed of 1.0 was read as measured): rank 0 re-split to run the whole model as two
    chunks is dealt 2 micro-batches, slower than the two intact pipelines taking 3 each (plan.plan:
    the faster of re-splitting and standing by), so it stands by with its layers and ZeRO chunks;
    the run keeps the reference's bits."""
    res = run_job(tmp_path, 3, 2, STEPS, deterministic=True,
                  extra=[*interleaved(2), "train.num_micro_batches=6", "elastic.inject=kill:rank=1,step=0,phase=forward"])
    (rec,) = [r for r in res.records if r["event"] == "recovery"]
    assert rec["plan"]["pipelines"][0] == [0] and rec["plan"]["micro_batches"] == [0, 3, 3]  # counts
    assert_same_run(res, reference_of_6, STEPS)


@pytest.mark.parametrize("rank,phase", [(1, "backward"), pytest.param(2, "forward", marks=pytest.mark.slow)])
def test_the_reroute_baseline_sends_a_lost_ranks_chunks_through_a_peer_and_keeps_the_bits(tmp_path, reference_of_6,
                                                                                         rank, phase):
    """dp=3 x pp=2, V=2: the lost rank's two chunks of each of its pipeline's micro-batches run on the
    same stage of another pipeline, inserted into that rank's interleaved order (pipeline/routed.py);
    rank 1 is its pipeline's last stage, whose survivor then sends on round the whole layout's ring."""
    res = run_job(tmp_path, 3, 2, STEPS, deterministic=True,
                  extra=[*interleaved(2), "train.num_micro_batches=6", "elastic.policy=reroute",
                         f"elastic.inject=kill:rank={rank},step=2,phase={phase}"])
    (rec,) = [r for r in res.records if r["event"] == "recovery"]
    assert rec["plan"]["detours"] == 2 and rec["plan"]["virtual_stages"] == 2
    assert_same_run(res, reference_of_6, STEPS)
