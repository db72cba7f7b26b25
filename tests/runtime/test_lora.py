"""Real gloo ranks with LoRA adapters (model.lora): only the adapters are summed, sharded,
snapshotted and migrated, the frozen base is read again by whoever builds a layer, and every run
-- through SIGKILLs in a forward and a backward, a re-partition, a join, a stage of frozen weights
only, a disk checkpoint resumed in another layout -- ends with the reference's bits."""
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.spawn import TINY, assert_same_run, run_cli, run_job, run_reference

STEPS = 6
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.dropout=0.1", "model.lora.targets=q;v;o;down"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_reference(tmp_path_factory.mktemp("ref"), STEPS, True, 4, extra=LORA)


@pytest.mark.parametrize("dp,pp,killed,extra", [
    (2, 2, 1, ["elastic.inject=kill:rank=1,step=2,phase=backward"]),
    (2, 3, 0, ["elastic.inject=kill:rank=0,step=2,phase=forward"]),  # the survivor re-reads layer 0's frozen base
    (2, 2, 3, ["elastic.inject=kill:rank=3,step=2", "elastic.spares=1"]),
    # pp=6: stage 0 holds the embedding alone, no weight of it trains, and it has no backward to run
    (1, 6, None, ["parallel.schedule=zb-h1"]),
    (1, 3, None, ["parallel.schedule=interleaved", "parallel.virtual_stages=2", "train.activation_checkpointing=full"]),
    (2, 1, None, []),  # rank 0 holds the head, whose weights all stay frozen
], ids=["kill-backward", "kill-forward", "join", "frozen-stage-zb-h1", "interleaved-recompute", "one-stage"])
def test_adapters_train_bit_identical_to_the_reference(tmp_path, reference, dp, pp, killed, extra):
    res = run_job(tmp_path, dp, pp, STEPS, True, extra=[*LORA, *extra])
    assert_same_run(res, reference, STEPS)
    # Each step's sums started within the backward that made them whole (zero/watch.py): a layer
    # with nothing trainable (the embedding, the head) is whole at once, not never.
    if pp < 6:  # (at pp = 6 rank 0 holds the embedding alone: nothing of it trains)
        assert all(r["sums_in_backwards"] >= 1 for r in res.steps if r["epoch"] == 0), \
            [r["sums_in_backwards"] for r in res.steps]
    # Only the injected kill is a loss: a rank whose code failed would be "lost" too, and hidden.
    lost = [r["lost_ranks"] for r in res.records if r["event"] == "recovery"]
    assert lost == ([] if killed is None else [[killed]]), res.stderr


def test_a_checkpoint_resumes_in_another_layout_and_exports_offline_as_the_run_does(tmp_path, reference):
    """Saved at 2 x 2 and killed, resumed at 1 x 3; the checkpoint holds the adapters only, and
    ``elaswave export`` writes from it the adapter folder the run itself wrote at its end."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"

    def sets(dp, pp, *extra):
        return [x for s in [*TINY, *LORA, f"parallel.dp={dp}", f"parallel.pp={pp}", f"train.steps={STEPS}",
                            "train.num_micro_batches=4", "train.deterministic=true", "elastic.enabled=false",
                            f"checkpoint.dir={ckpt}", "checkpoint.every_steps=3", "checkpoint.keep=3", *extra]
                for x in ("--set", s)]
    first = run_cli(["run", *sets(2, 2, "elastic.inject=kill:rank=3,step=4")], tmp_path, metrics=metrics)
    assert first.returncode != 0
    second = run_cli(["run", *sets(1, 3, f"checkpoint.export_hf={tmp_path / 'run'}", "checkpoint.export_dtype=fp32")],
                     tmp_path, metrics=metrics)
    assert second.returncode == 0, second.stderr
    assert "resuming at step 3" in second.stdout
    steps = [r for r in second.records if r["event"] == "step"]
    assert [r["loss"] for r in steps] == reference.losses
    assert second.records[-1]["params_sha256"] == reference.summary["params_sha256"]

    offline = run_cli(["export", str(ckpt), str(tmp_path / "offline"), "--dtype", "fp32"], tmp_path, timeout_s=60)
    assert offline.returncode == 0, offline.stderr
    assert "a peft adapter folder" in offline.stdout
    a = load_file(tmp_path / "run" / "adapter_model.safetensors")
    b = load_file(tmp_path / "offline" / "adapter_model.safetensors")
    assert sorted(a) == sorted(b) and len(a) == 2 * 4 * 4  # A and B of 4 targets in 4 blocks
    assert all((a[k] == b[k]).all() for k in a)

    # Merged offline: the base is the preset's keyed init, built again from the run's seed. The
    # same base exported by a run of no steps, with the adapters on it in peft, gives its logits.
    merged = run_cli(["export", str(ckpt), str(tmp_path / "merged"), "--merge", "--dtype", "fp32"], tmp_path,
                     timeout_s=60)
    assert merged.returncode == 0, merged.stderr
    base = run_cli(["run", *[x for s in [*TINY, "train.steps=0", "checkpoint.export_dtype=fp32",
                                         f"checkpoint.export_hf={tmp_path / 'base'}"] for x in ("--set", s)]], tmp_path)
    assert base.returncode == 0, base.stderr
    transformers, peft = pytest.importorskip("transformers"), pytest.importorskip("peft")
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    tuned = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base"),
                                           tmp_path / "offline").eval()
    whole = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        assert (whole(tokens).logits - tuned(tokens).logits).abs().max() < 1e-5
    again = run_cli(["export", str(ckpt), str(tmp_path / "again"), "--merge", "--source", str(tmp_path / "base")],
                    tmp_path, timeout_s=60)
    assert again.returncode == 2 and "a preset's keyed init, which --merge draws again" in again.stderr, again.stderr


def test_a_bf16_run_merges_onto_the_base_as_its_source_gives_it(tmp_path):
    """In bf16 a rank holds the frozen base rounded to bf16; the merged export reads the base
    again, so every tensor but the adapted projections is the base's float32 bits (they were the
    rounded ones), and the adapted ones are W + (alpha/r) B A on the float32 W."""
    sets = [*TINY, *LORA, "train.steps=2", "train.precision=bf16", "checkpoint.export_dtype=fp32"]
    base = run_cli(["run", *[x for s in [*TINY, "train.steps=0", "checkpoint.export_dtype=fp32",
                                         f"checkpoint.export_hf={tmp_path / 'base'}"] for x in ("--set", s)]], tmp_path)
    assert base.returncode == 0, base.stderr
    outs = {}
    for kind in ("adapter", "merged"):
        res = run_cli(["run", *[x for s in [*sets, f"checkpoint.export_lora={kind}",
                                            f"checkpoint.export_hf={tmp_path / kind}"] for x in ("--set", s)]], tmp_path)
        assert res.returncode == 0, res.stderr
        outs[kind] = load_file(tmp_path / kind / ("adapter_model.safetensors" if kind == "adapter" else "model.safetensors"))
    w = load_file(tmp_path / "base" / "model.safetensors")
    merged, adapters = outs["merged"], outs["adapter"]
    assert sorted(merged) == sorted(w)
    for name, tensor in w.items():
        a = adapters.get(f"base_model.model.{name.removesuffix('.weight')}.lora_A.weight")
        if a is None:
            assert torch.equal(merged[name], tensor), name
        else:
            b = adapters[f"base_model.model.{name.removesuffix('.weight')}.lora_B.weight"]
            assert torch.allclose(merged[name], tensor + (8 / 4) * b @ a, atol=1e-6), name
