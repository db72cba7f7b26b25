"""Real gloo ranks laid out dp x pp x tp: a tensor-parallel job trains the same run as its
single-process reference (the whole model in the same canonical blocks), bit for bit."""
import pytest

from tests.helpers.spawn import job_args, run_cli, run_job, run_reference

STEPS = 6
MBS = 4
# GQA (8 heads, 4 key-value heads), tied embeddings, dropout: every cut of the Llama family.
TP = ["model.preset=llama-tiny", "model.num_heads=8", "model.num_kv_heads=4", "model.seq_len=32",
      f"train.num_micro_batches={MBS}", "elastic.enabled=false", "parallel.timeout_s=60"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_reference(tmp_path_factory.mktemp("ref"), STEPS, deterministic=True, num_micro_batches=MBS,
                         extra=[*TP, "parallel.tp=2"])


# Degree 4 is also checked at model level (tests/model/test_llama_tp.py); 8 ranks take the longest.
LAYOUTS = [pytest.param(1, 1, 2, marks=pytest.mark.slow), pytest.param(2, 1, 2, marks=pytest.mark.slow), (1, 2, 2), pytest.param(1, 1, 4, marks=pytest.mark.slow),
           pytest.param(2, 2, 2, marks=pytest.mark.slow)]


@pytest.mark.parametrize("dp,pp,tp", LAYOUTS)
def test_every_layout_is_bit_identical_to_the_reference(tmp_path, reference, dp, pp, tp):
    res = run_job(tmp_path, dp, pp, STEPS, deterministic=True, extra=[*TP, f"parallel.tp={tp}"])
    assert res.summary["tp"] == tp and res.summary["world_size"] == dp * pp * tp
    assert res.losses == reference.losses  # exact float equality, every step
    assert [s["grad_norm"] for s in res.steps] == [s["grad_norm"] for s in reference.steps]
    assert res.summary["params_sha256"] == reference.summary["params_sha256"]
    assert res.summary["state_sha256"] == reference.summary["state_sha256"]
    assert res.losses[-1] < res.losses[0] - 0.2, "the loss should visibly fall"


def test_a_key_value_head_replicated_on_its_group_s_ranks_is_bit_identical(tmp_path):
    # One key-value head (MQA) on both ranks of each group: its gradient summed over every query
    # head of the group exactly, its copy counted once in the norm and the digests.
    sets = [*TP, "model.num_kv_heads=1", "parallel.tp=2"]
    ref = run_reference(tmp_path, STEPS, deterministic=True, num_micro_batches=MBS, extra=sets)
    res = run_job(tmp_path, 2, 1, STEPS, deterministic=True, extra=sets)
    assert res.losses == ref.losses
    assert [s["grad_norm"] for s in res.steps] == [s["grad_norm"] for s in ref.steps]
    assert res.summary["params_sha256"] == ref.summary["params_sha256"]
    assert res.summary["state_sha256"] == ref.summary["state_sha256"]


@pytest.mark.slow  # the default run keeps a faster case of the same path; `pytest -m slow` runs it
def test_recomputed_activations_run_the_group_s_collectives_again_to_the_same_bits(tmp_path, reference):
    res = run_job(tmp_path, 1, 2, STEPS, deterministic=True,
                  extra=[*TP, "parallel.tp=2", "train.activation_checkpointing=full"])
    assert res.losses == reference.losses
    assert res.summary["params_sha256"] == reference.summary["params_sha256"]


def test_a_selectively_recomputed_attention_core_keeps_the_bits_of_every_degree(tmp_path, reference):
    """train.activation_checkpointing=selective with tp=2 and the sequence cut: each rank's heads run
    their core again in the backward, on the whole sequence its column products gathered."""
    res = run_job(tmp_path, 1, 2, STEPS, deterministic=True,
                  extra=[*TP, "parallel.tp=2", "parallel.sequence_parallel=true", "train.activation_checkpointing=selective"])
    assert res.losses == reference.losses
    assert res.summary["params_sha256"] == reference.summary["params_sha256"]


# Each SIGKILL takes a rank of a tensor-parallel group: its device's layers go to the other stages
# (or its pipeline's micro-batches to the other pipeline), its group's survivors leave, and each
# slice restores the lost chunks from its own snapshot ring.
KILLS = [
    pytest.param(2, 1, ["kill:rank=3,step=3,phase=reduce"], [2, 3], marks=pytest.mark.slow),
    (2, 1, ["kill:rank=1,step=2,phase=backward"], [0, 1]),  # the metrics' writer leaves with its group
    (1, 2, ["kill:rank=2,step=3,phase=forward"], [2, 3]),  # a pipeline's second stage: re-partitioned
    pytest.param(2, 1, ["kill:rank=2,step=4,phase=forward", "kill:rank=3,step=4,phase=forward"], [2, 3],
                 marks=pytest.mark.slow),  # a whole group
]


@pytest.mark.parametrize("dp,pp,kills,lost", KILLS)
def test_a_killed_tensor_parallel_rank_is_one_recovery_bit_identical(tmp_path, reference, dp, pp, kills, lost):
    res = run_job(tmp_path, dp, pp, STEPS, deterministic=True,
                  extra=[*TP, "parallel.tp=2", "elastic.enabled=true", "elastic.inject=" + ";".join(kills)])
    recoveries = [r for r in res.records if r["event"] == "recovery"]
    assert [r["lost_ranks"] for r in recoveries] == [lost]
    assert res.losses == reference.losses
    assert res.summary["params_sha256"] == reference.summary["params_sha256"]
    assert res.summary["state_sha256"] == reference.summary["state_sha256"]
    assert res.summary["world_size"] == dp * pp * 2 - 2


# Long enough for a spare's join (its request, admission at a step boundary, the state it receives).
GROW_STEPS = 40


@pytest.fixture(scope="module")
def long_reference(tmp_path_factory):
    return run_reference(tmp_path_factory.mktemp("ref"), GROW_STEPS, deterministic=True, num_micro_batches=MBS,
                         extra=[*TP, "parallel.tp=2"])


def _same_run(res, reference):
    by_step = {s["step"]: s["loss"] for s in res.steps}  # the last record of a step redone
    assert [by_step[i] for i in range(GROW_STEPS)] == reference.losses
    assert res.summary["params_sha256"] == reference.summary["params_sha256"]
    assert res.summary["state_sha256"] == reference.summary["state_sha256"]


@pytest.mark.slow  # the default run keeps a faster case of the same path; `pytest -m slow` runs it
def test_warm_spares_take_a_lost_ranks_device_bit_identical(tmp_path, long_reference):
    # Rank 1 dies: spare 4 is promoted in its place; its group's survivor (rank 0) leaves, and
    # the launcher promotes spare 5 in its place. The two join as one device at a step boundary,
    # each building the shard its place in the device gives it, and receive their layers and
    # ZeRO chunks from the other device, slice by slice. Then the other founding device loses
    # rank 3, and the next two spares (6, 7) replace it beside the joined one.
    res = run_job(tmp_path, 2, 1, GROW_STEPS, deterministic=True,
                  extra=[*TP, "parallel.tp=2", "elastic.enabled=true", "elastic.spares=2",
                         "elastic.inject=kill:rank=1,step=3,phase=backward;kill:rank=3,step=22,phase=reduce"])
    _same_run(res, long_reference)
    recs = [r for r in res.records if r["event"] == "recovery"]
    joins = [r for r in res.records if r["event"] == "join"]
    assert [r["lost_ranks"] for r in recs] == [[0, 1], [2, 3]], recs
    assert "left with its tensor-parallel group" in recs[0]["evidence"]["0"]
    assert [j["joined_ranks"] for j in joins] == [[4, 5], [6, 7]], joins
    assert joins[0]["plan"]["pipelines"] == [[2], [4]] and joins[1]["plan"]["pipelines"] == [[4], [6]]
    assert "spare rank 4 replaces rank 1" in res.stderr
    assert "spare rank 5 replaces rank 0, which left with its tensor-parallel group" in res.stderr
    assert res.summary["ranks"] == [4, 5, 6, 7] and res.summary["world_size"] == 4
    assert all(s["world_size"] == 4 for s in res.steps if s["step"] >= joins[-1]["resume_step"])
    assert res.left_behind == 0  # the spares never needed went with the job


# Cold processes (their start-up on the path): ranks asked to join, and replacements of a dead
# rank and of its group's survivor.
GROWTHS = [(1, ["elastic.inject=join:step=1,count=2"], [], [2, 3], [0, 1, 2, 3]),
           (2, ["elastic.inject=kill:rank=3,step=2,phase=forward"], ["--respawn-after", "0.2"], [4, 5], [0, 1, 4, 5])]


@pytest.mark.slow  # with the warm spares' case: `pytest -m slow` (a join without tp: tests/runtime/test_join.py)
@pytest.mark.parametrize("dp,sets,cli,joined,ranks", GROWTHS)
def test_ranks_joining_a_tensor_parallel_job_grow_it_by_a_device(tmp_path, long_reference, dp, sets, cli, joined, ranks):
    res = run_job(tmp_path, dp, 1, GROW_STEPS, deterministic=True,
                  extra=[*TP, "parallel.tp=2", "elastic.enabled=true", *sets], cli=cli)
    _same_run(res, long_reference)
    (join,) = [r for r in res.records if r["event"] == "join"]
    assert join["joined_ranks"] == joined and len(join["plan"]["pipelines"]) == 2
    assert res.summary["ranks"] == ranks


def test_a_tensor_parallel_job_resumes_from_its_shards_checkpoints(tmp_path, reference):
    ck = tmp_path / "ck"
    sets = [*TP, "parallel.tp=2", f"checkpoint.dir={ck}", "checkpoint.every_steps=2"]
    run_job(tmp_path, 2, 1, 4, deterministic=True, extra=sets)
    assert sorted(p.name for p in ck.iterdir()) == ["shard-0-of-2", "shard-1-of-2"]
    res = run_job(tmp_path, 2, 1, STEPS, deterministic=True, extra=sets)
    assert [s["step"] for s in res.steps] == list(range(4, STEPS))
    assert res.losses == reference.losses[4:]
    assert res.summary["params_sha256"] == reference.summary["params_sha256"]
    assert res.summary["state_sha256"] == reference.summary["state_sha256"]
    other = run_cli(job_args(1, 1, STEPS + 2, True, [*sets[:-3], "parallel.tp=4", f"checkpoint.dir={ck}"]), tmp_path)
    assert other.returncode == 2 and "it holds checkpoints written at parallel.tp=2" in other.stderr


@pytest.mark.slow  # the default run keeps a faster case of the same path; `pytest -m slow` runs it
def test_a_loss_beyond_the_snapshots_goes_back_to_the_shards_checkpoint(tmp_path, reference):
    # Two devices of three at once: a lost rank's snapshot was on the other (in each slice alike),
    # so every slice goes back to the step all of them saved, and trains on to the same bits.
    res = run_job(tmp_path, 3, 1, STEPS, deterministic=True,
                  extra=[*TP, "parallel.tp=2", f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.every_steps=3",
                         "elastic.enabled=true", "elastic.snapshot_copies=1",
                         "elastic.inject=kill:rank=2,step=5,phase=forward;kill:rank=4,step=5,phase=forward"])
    recoveries = [r for r in res.records if r["event"] == "recovery"]
    assert len(recoveries) == 1 and recoveries[0]["is_fallback"] and recoveries[0]["resume_step"] == 3
    assert recoveries[0]["lost_ranks"] == [2, 3, 4, 5]
    by_step = {s["step"]: s["loss"] for s in res.steps}
    assert [by_step[i] for i in range(STEPS)] == reference.losses
    assert res.summary["params_sha256"] == reference.summary["params_sha256"]
    assert res.summary["state_sha256"] == reference.summary["state_sha256"]


def test_losing_every_whole_group_stops_the_job_in_one_line(tmp_path):
    res = run_cli(job_args(1, 1, STEPS, True, [*TP, "parallel.tp=2", "elastic.enabled=true",
                                                "elastic.inject=kill:rank=1,step=2,phase=forward"]), tmp_path)
    assert res.returncode != 0
    assert "no tensor-parallel group of the job is whole after losing ranks [1]" in res.stderr, res.stderr
    assert not any(r["event"] == "summary" for r in res.records)


def test_the_blocked_reference_is_another_computation_of_the_same_training(tmp_path, reference):
    # The canonical blocks are what make every degree agree: without them the bits differ,
    # the training does not.
    plain = run_reference(tmp_path, STEPS, deterministic=True, num_micro_batches=MBS, extra=TP)
    assert plain.summary["params_sha256"] != reference.summary["params_sha256"]
    for a, b in zip(plain.losses, reference.losses):
        assert abs(a - b) / abs(b) < 1e-4


@pytest.mark.parametrize("dp,pp", [(2, 1), pytest.param(2, 2, marks=pytest.mark.slow)])
def test_fast_mode_follows_the_whole_model(tmp_path, dp, pp):
    # Plain TP (fused kernels, one float all-reduce) against the whole model (whose logits are
    # within 1e-5 of transformers': tests/model/test_llama_parity.py): the first step's loss within
    # 1e-5, the training within 1e-4.
    ref = run_reference(tmp_path, STEPS, deterministic=False, num_micro_batches=MBS, extra=TP)
    res = run_job(tmp_path, dp, pp, STEPS, deterministic=False, extra=[*TP, "parallel.tp=2"])
    assert abs(res.losses[0] - ref.losses[0]) / ref.losses[0] < 1e-5
    for step, (a, b) in enumerate(zip(res.losses, ref.losses)):
        assert abs(a - b) / abs(b) < 1e-4, f"step {step}: {a} vs the whole model's {b}"


@pytest.mark.parametrize("sets,cli,says", [
    (["parallel.tp=3"], [], "parallel.tp=3 is invalid: the degree must divide 8"),
    (["parallel.tp=8", "model.num_heads=4", "model.num_kv_heads=2"], [],
     "parallel.tp=8 is invalid: it must divide the attention heads (4)"),
    (["parallel.tp=2", "model.preset=gpt-tiny"], [], "parallel.tp=2 is invalid for model gpt"),
    (["parallel.tp=2", "model.factory=tests.runtime.test_tensor_parallel:nothing"], [],
     "a model.factory model would need to declare one"),
    (["parallel.tp=2", "elastic.enabled=true", "elastic.inject=join:step=2,count=3"], [],
     "join:step=2,count=3 must add whole devices with parallel.tp=2"),
    (["parallel.tp=4"], ["--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "2"],
     "parallel.tp=4 is invalid with --nproc-per-node=2"),
    (["parallel.tp=2", "parallel.dp=3"], ["--nnodes", "2", "--node-rank", "0"],
     "--nproc-per-node=3 is invalid with parallel.tp=2: a host must hold whole tensor-parallel groups"),
    (["parallel.tp=2", "emulate.enabled=true"], [], "emulate.enabled=True is invalid: with parallel.tp=2"),
    (["parallel.sequence_parallel=true"], [], "parallel.sequence_parallel=True is invalid: needs parallel.tp > 1"),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "model.seq_len=60"], [],
     "needs model.seq_len a multiple of 8 (the canonical blocks of the sequence that keep the bits at every degree), "
     "not 60"),
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


HF = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, rms_norm_eps=1e-5)
HF_JOB = ["model.seq_len=32", "data.source=stdlib", "train.micro_batch_size=2", f"train.num_micro_batches={MBS}",
          "parallel.timeout_s=60", "parallel.tp=2"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A Hugging Face folder whose vocabulary (300) tp=2 pads to whole blocks (304), tied, GQA."""
    transformers = pytest.importorskip("transformers")
    import torch
    path = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF)).save_pretrained(path)
    return path


def _hf_run(tmp_path, command: str, sets: list[str]):
    args = [command] + [x for s in sets for x in ("--set", s)] + ["--deterministic"]
    res = run_cli(args, tmp_path)
    assert res.returncode == 0, res.stderr
    return res


def _tensors(path):
    from safetensors.torch import load_file
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


# At tp=4 each of the folder's 2 key-value heads is replicated on 2 ranks: exported once.
@pytest.mark.parametrize("pp,tp", [(2, 2), pytest.param(1, 4, marks=pytest.mark.slow)])
def test_an_export_from_shards_gives_back_the_folder_it_loaded(tmp_path, hf_dir, pp, tp):
    out = tmp_path / "out"
    _hf_run(tmp_path, "run", [*HF_JOB, "parallel.dp=1", f"parallel.pp={pp}", f"parallel.tp={tp}", "train.steps=0",
                              f"model.init_from={hf_dir}", f"checkpoint.export_hf={out}"])
    a, b = _tensors(hf_dir), _tensors(out)
    assert sorted(a) == sorted(b) and b["model.embed_tokens.weight"].shape[0] == 300  # no padding row
    assert all(a[k].equal(b[k]) for k in a)


def test_a_trained_export_from_shards_equals_the_reference_export(tmp_path, hf_dir):
    import torch
    sets = [*HF_JOB, f"model.init_from={hf_dir}", f"train.steps={STEPS}"]
    ref = _hf_run(tmp_path, "reference", [*sets, f"checkpoint.export_hf={tmp_path / 'ref'}"])
    res = _hf_run(tmp_path, "run", [*sets, "parallel.dp=2", "parallel.pp=1", f"checkpoint.export_hf={tmp_path / 'run'}",
                                    "elastic.inject=kill:rank=3,step=3,phase=backward"])
    assert res.losses == ref.losses
    a, b, before = _tensors(tmp_path / "ref"), _tensors(tmp_path / "run"), _tensors(hf_dir)
    assert sorted(a) == sorted(b) and all(a[k].equal(b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.down_proj.weight"], before["model.layers.0.mlp.down_proj.weight"])


KILL_IN_A_GROUP = ["elastic.enabled=true", "elastic.inject=kill:rank=5,step=3,phase=backward"]


@pytest.mark.parametrize("dp,kill", [(1, []), pytest.param(2, KILL_IN_A_GROUP, marks=pytest.mark.slow)])
def test_sequence_parallelism_trains_the_same_bits(tmp_path, reference, dp, kill):
    """parallel.sequence_parallel: each rank of a group holds 1/tp of the sequence between the cut
    products and sends that shard to the next stage (pp=2); with `pytest -m slow` also at dp=2
    through a SIGKILL of one rank of a group (one recovery). The run keeps the reference's bits
    (the reference does not cut the sequence)."""
    res = run_job(tmp_path, dp, 2, STEPS, deterministic=True,
                  extra=[*TP, "parallel.tp=2", "parallel.sequence_parallel=true", *kill])
    assert res.records[0]["config"]["parallel"]["sequence_parallel"] is True
    recoveries = [r for r in res.records if r["event"] == "recovery"]
    assert len(recoveries) >= 1 if kill else not recoveries
    assert res.losses == reference.losses
    assert [s["grad_norm"] for s in res.steps] == [s["grad_norm"] for s in reference.steps]
    assert res.summary["params_sha256"] == reference.summary["params_sha256"]
    assert res.summary["state_sha256"] == reference.summary["state_sha256"]


def test_interleaved_pipelines_of_tensor_parallel_devices_keep_the_bits(tmp_path, reference):
    """parallel.schedule=interleaved over devices of tp ranks, with the sequence cut: every rank
    of a device runs its V chunks, its shard of the sequence round the ring."""
    res = run_job(tmp_path, 1, 2, STEPS, deterministic=True,
                  extra=[*TP, "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.schedule=interleaved",
                         "parallel.virtual_stages=2"])
    assert res.losses == reference.losses
    assert res.summary["params_sha256"] == reference.summary["params_sha256"]
    assert res.summary["state_sha256"] == reference.summary["state_sha256"]


@pytest.mark.parametrize("dp,kill", [(1, []), pytest.param(2, ["elastic.enabled=true", "elastic.inject=kill:rank=5,step=3,phase=weight"],
                                                        marks=pytest.mark.slow)])
def test_zb_h1_over_tensor_parallel_devices_keeps_the_bits(tmp_path, reference, dp, kill):
    """parallel.schedule=zb-h1 with tp=2 and the sequence cut: B runs each product's input gradient
    and its collectives, W the weights' (tensor/ops.py); with `pytest -m slow` also at dp=2 through
    a SIGKILL of one rank of a group as its first W starts."""
    res = run_job(tmp_path, dp, 2, STEPS, deterministic=True,
                  extra=[*TP, "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.schedule=zb-h1", *kill])
    assert res.records[0]["config"]["parallel"]["schedule"] == "zb-h1"
    if kill:
        assert "injecting kill into rank 5 at step 3 (weight)" in res.stderr
        assert any(r["event"] == "recovery" for r in res.records)
    assert res.losses == reference.losses
    assert res.summary["params_sha256"] == reference.summary["params_sha256"]
    assert res.summary["state_sha256"] == reference.summary["state_sha256"]
