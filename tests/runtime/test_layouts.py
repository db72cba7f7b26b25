"""Real gloo ranks: every dp x pp layout trains the same run as the single-process reference."""
import pytest

from elaswave import config
from elaswave.model.contract import counted_numels, tie_pairs
from elaswave.model.registry import model_for
from elaswave.plan.buckets import size_starts
from elaswave.plan.plan import initial_plan
from tests.helpers.spawn import run_job, run_reference

STEPS = 20
# num_micro_batches is max(4, dp) in run_job; the reference must use the same global batch.
# The default run keeps the widest of each kind (pure dp, pure pp, both); `pytest -m slow` runs all.
LAYOUTS = [pytest.param(1, 1, marks=pytest.mark.slow), pytest.param(2, 1, marks=pytest.mark.slow),
           pytest.param(1, 2, marks=pytest.mark.slow), (2, 2), (4, 1), (1, 4)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_reference(tmp_path_factory.mktemp("ref"), STEPS, deterministic=True)


@pytest.mark.parametrize("dp,pp", LAYOUTS)
def test_deterministic_layout_is_bit_identical_to_reference(tmp_path, reference, dp, pp):
    res = run_job(tmp_path, dp, pp, STEPS, deterministic=True)
    assert len(res.steps) == STEPS
    assert res.losses == reference.losses  # exact float equality, every step
    assert res.summary["params_sha256"] == reference.summary["params_sha256"]
    assert res.losses[-1] < res.losses[0] - 0.5, "the loss should visibly fall"


def test_a_bucket_a_layer_keeps_the_bits_through_a_kill_with_all_gathers_out(tmp_path, reference):
    """parallel.bucket_numel=1: every layer its own gradient bucket, summed and all-gathered on its
    own, each forward waiting for its own layer's all-gather only. dp=2 x pp=2, rank 3 SIGKILLed
    after its update, its all-gathers still out (its peers wait for them in the next forwards)."""
    res = run_job(tmp_path, 2, 2, STEPS, deterministic=True,
                  extra=["parallel.bucket_numel=1", "elastic.inject=kill:rank=3,step=6,phase=snapshot"])
    assert "injecting kill into rank 3 at step 6 (snapshot)" in res.stderr
    assert res.losses == reference.losses
    assert res.summary["params_sha256"] == reference.summary["params_sha256"]
    # Rank 0 (stage 0 of 2: the embedding and the first blocks, a bucket each) waited in its forwards
    # for every one of its buckets' all-gathers in each step after another of its epoch.
    cfg = config.from_dict(res.records[0]["config"])
    model = model_for(cfg)
    numels = counted_numels(model)
    plan = initial_plan(4, 2, 2, [c.flops_per_token for c in model.layer_costs()], cfg.train.num_micro_batches, numels,
                        cfg.parallel.chunk_numel, ties=tie_pairs(model), bucket_starts=size_starts(numels, 1))
    mine = sum(0 in holders for holders, _ in plan.gradient_buckets())
    followers = [r for prev, r in zip(res.steps, res.steps[1:]) if prev["epoch"] == r["epoch"] == 0]
    assert mine >= 3 and followers
    assert all(r["gathers_in_forwards"] == mine for r in followers), (mine, [r["gathers_in_forwards"] for r in res.steps])
    # Its 1F1B stage's gradients are whole only in its last backward, layer by layer: each bucket's
    # sum started in it, as its layer was (zero/watch.py), not after it.
    assert all(r["sums_in_backwards"] == mine for r in res.steps if r["epoch"] == 0), \
        [r["sums_in_backwards"] for r in res.steps]


@pytest.mark.parametrize("how", ["every_2", "selective"])
def test_recomputed_activations_give_the_same_bits(tmp_path, reference, how):
    res = run_job(tmp_path, 1, 2, STEPS, deterministic=True, extra=[f"train.activation_checkpointing={how}"])
    assert res.records[0]["config"]["train"]["activation_checkpointing"] == how
    assert res.losses == reference.losses
    assert res.summary["params_sha256"] == reference.summary["params_sha256"]


# bf16: a float32 sum added in another order can round a weight to the neighbouring bfloat16.
@pytest.mark.parametrize("dp,pp,precision,tolerance", [(2, 2, "fp32", 1e-4), pytest.param(4, 1, "fp32", 1e-4, marks=pytest.mark.slow),
                                                       pytest.param(2, 2, "bf16", 1e-2, marks=pytest.mark.slow)])
def test_fast_mode_matches_reference_closely(tmp_path, dp, pp, precision, tolerance):
    sets = [f"train.precision={precision}"]
    ref = run_reference(tmp_path, STEPS, deterministic=False, num_micro_batches=max(4, dp), extra=sets)
    res = run_job(tmp_path, dp, pp, STEPS, deterministic=False, extra=sets)
    for step, (a, b) in enumerate(zip(res.losses, ref.losses)):
        assert abs(a - b) / abs(b) < tolerance, f"step {step}: {a} vs reference {b}"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_sums_started_within_the_backward_keep_fast_modes_bits(tmp_path, precision):
    """Fast mode adds gradients as autograd writes them (float32: into the flat gradient; bf16:
    into a float32 sum, hook by hook): a bucket's sum started as its layer is whole packs what one
    started after the backward would. dp=2 x pp=2, a bucket a layer, sums overlapped or not."""
    runs = {}
    for overlap in ("true", "false"):
        (tmp_path / overlap).mkdir()
        runs[overlap] = run_job(tmp_path / overlap, 2, 2, 6, deterministic=False, extra=[
            f"train.precision={precision}", "parallel.bucket_numel=1", f"parallel.overlap_grad_reduce={overlap}"])
    on, off = runs["true"], runs["false"]
    assert on.losses == off.losses
    assert on.summary["params_sha256"] == off.summary["params_sha256"]
    assert all(r["sums_in_backwards"] >= 3 for r in on.steps) and not any(r["sums_in_backwards"] for r in off.steps)


def test_deterministic_and_fast_mode_differ_only_slightly(tmp_path, reference):
    # Guards the fixed-point path from silently changing the training: same curve, other bits.
    fast = run_reference(tmp_path, STEPS, deterministic=False)
    assert fast.losses != reference.losses
    for a, b in zip(fast.losses, reference.losses):
        assert abs(a - b) / abs(b) < 1e-3
