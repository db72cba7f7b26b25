"""Real gloo ranks laid out dp x pp x tp: a tensor-parallel job trains the same run as its
single-process reference (the whole model in the same canonical blocks), bit for bit."""
import pytest

from tests.helpers.spawn import run_cli, run_job, run_reference

STEPS = 6
MBS = 4
# GQA (8 heads, 4 key-value heads), tied embeddings, dropout: every cut of the Llama family.
TP = ["model.preset=llama-tiny", "model.num_heads=8", "model.num_kv_heads=4", "model.seq_len=32",
      f"train.num_micro_batches={MBS}", "elastic.enabled=false", "parallel.timeout_s=60"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_reference(tmp_path_factory.mktemp("ref"), STEPS, deterministic=True, num_micro_batches=MBS,
                         extra=[*TP, "parallel.tp=2"])


LAYOUTS = [(1, 1, 2), (2, 1, 2), (1, 2, 2), (1, 1, 4), pytest.param(2, 2, 2, marks=pytest.mark.slow)]


@pytest.mark.parametrize("dp,pp,tp", LAYOUTS)
def test_every_layout_is_bit_identical_to_the_reference(tmp_path, reference, dp, pp, tp):
    res = run_job(tmp_path, dp, pp, STEPS, deterministic=True, extra=[*TP, f"parallel.tp={tp}"])
    assert res.summary["tp"] == tp and res.summary["world_size"] == dp * pp * tp
    assert res.losses == reference.losses  # exact float equality, every step
    assert [s["grad_norm"] for s in res.steps] == [s["grad_norm"] for s in reference.steps]
    assert res.summary["params_sha256"] == reference.summary["params_sha256"]
    assert res.summary["state_sha256"] == reference.summary["state_sha256"]
    assert res.losses[-1] < res.losses[0] - 0.2, "the loss should visibly fall"


def test_the_blocked_reference_is_another_computation_of_the_same_training(tmp_path, reference):
    # The canonical blocks are what make every degree agree: without them the bits differ,
    # the training does not.
    plain = run_reference(tmp_path, STEPS, deterministic=True, num_micro_batches=MBS, extra=TP)
    assert plain.summary["params_sha256"] != reference.summary["params_sha256"]
    for a, b in zip(plain.losses, reference.losses):
        assert abs(a - b) / abs(b) < 1e-4


def test_fast_mode_follows_the_whole_model(tmp_path):
    ref = run_reference(tmp_path, STEPS, deterministic=False, num_micro_batches=MBS, extra=TP)
    res = run_job(tmp_path, 2, 1, STEPS, deterministic=False, extra=[*TP, "parallel.tp=2"])
    for step, (a, b) in enumerate(zip(res.losses, ref.losses)):
        assert abs(a - b) / abs(b) < 1e-4, f"step {step}: {a} vs the whole model's {b}"


@pytest.mark.parametrize("sets,cli,says", [
    (["parallel.tp=3"], [], "parallel.tp=3 is invalid: the degree must divide 8"),
    (["parallel.tp=8"], [], "parallel.tp=8 is invalid: it must divide the attention heads (8)"[:40]),
    (["parallel.tp=2", "model.preset=gpt-tiny"], [], "parallel.tp=2 is invalid for model gpt"),
    (["parallel.tp=2", "model.factory=tests.runtime.test_tensor_parallel:nothing"], [],
     "a model.factory model would need to declare one"),
    (["parallel.tp=2", "elastic.enabled=true"], [], "elastic.enabled=True is invalid with parallel.tp=2"[:22]),
    (["parallel.tp=4"], ["--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "2"],
     "parallel.tp=4 is invalid with --nproc-per-node=2"),
])
def test_bad_tensor_parallel_input_is_one_line(tmp_path, sets, cli, says):
    base = ["parallel.dp=1", "parallel.pp=1", "elastic.enabled=false", "model.num_heads=8", "model.num_kv_heads=4"]
    if any(s.startswith(("model.preset=gpt", "model.factory")) for s in sets):
        base = base[:3]
    args = ["run"] + [x for s in [*base, *sets] for x in ("--set", s)]
    res = run_cli(args + cli, tmp_path, timeout_s=60)
    assert res.returncode == 2, res.stderr
    lines = [l for l in res.stderr.strip().splitlines() if l]
    assert len(lines) == 1 and says in lines[0], res.stderr
