"""Hugging Face checkpoints in and out, through the real CLI: an exact round trip, exports that
transformers loads (also after an elastic re-partition, and offline from a disk checkpoint), and
one-line errors for bad directories."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from elaswave import config  # noqa: E402
from elaswave.model.registry import model_for  # noqa: E402
from elaswave.pipeline.stage import Stage  # noqa: E402
from tests.helpers.spawn import TINY, run_cli  # noqa: E402

HF = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
JOB = [x for s in [*TINY[4:], "model.seq_len=32", "parallel.timeout_s=60"] for x in ("--set", s)]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF)).save_pretrained(path, max_shard_size="30KB")
    assert (path / "model.safetensors.index.json").is_file()  # sharded, with its index
    return path


def _tensors(path):
    out = {}
    for f in path.glob("*.safetensors"):
        out.update(load_file(f))
    return out


def test_zero_steps_round_trip_is_exact(tmp_path, hf_dir):
    out = tmp_path / "out"
    res = run_cli(["run", "--set", f"model.init_from={hf_dir}", "--set", "train.steps=0", "--set",
                   f"checkpoint.export_hf={out}", "--set", "parallel.dp=1", "--set", "parallel.pp=3", *JOB], tmp_path)
    assert res.returncode == 0, res.stderr
    a, b = _tensors(hf_dir), _tensors(out)
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(b) and not list(tmp_path.glob(".out.partial*"))


def _logits(path, ids):
    cfg = config.load(None, [f"model.init_from={path}", "model.seq_len=32", "parallel.dp=1", "parallel.pp=1",
                             "train.deterministic=true"])
    model = model_for(cfg)
    with torch.no_grad():
        return Stage(cfg, (0, model.num_layers), torch.device("cpu"), model).forward(ids, 0, 0, train=False)


def test_export_after_a_re_partition_loads_in_transformers_with_the_same_logits(tmp_path, hf_dir):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    res = run_cli(["run", "--deterministic", "--set", f"model.init_from={hf_dir}", "--set", "train.steps=6",
                   "--set", "parallel.dp=2", "--set", "parallel.pp=2", "--set", "train.num_micro_batches=4",
                   "--set", "elastic.inject=kill:rank=1,step=3,phase=backward", "--set", f"checkpoint.export_hf={out}",
                   "--set", f"checkpoint.dir={ckpt}", "--set", "checkpoint.every_steps=5", *JOB], tmp_path)
    assert res.returncode == 0, res.stderr
    assert [r for r in res.records if r["event"] == "recovery"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    model, info = loaded
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.randint(0, HF["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = model.eval()(ids).logits
    assert float((theirs - _logits(out, ids)).abs().max()) <= 1e-5
    assert not torch.equal(_tensors(out)["model.norm.weight"], _tensors(hf_dir)["model.norm.weight"])  # it trained
    # Offline, from the disk checkpoint the re-partitioned job wrote at step 5.
    offline = tmp_path / "offline"
    res = run_cli(["export", str(ckpt), str(offline)], tmp_path)
    assert res.returncode == 0, res.stderr
    assert sorted(_tensors(offline)) == sorted(_tensors(hf_dir))
    _, info = transformers.AutoModelForCausalLM.from_pretrained(offline, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def _bad(tmp_path, hf_dir, mutate):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in hf_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    mutate(bad)
    return run_cli(["run", "--set", f"model.init_from={bad}", "--set", "train.steps=1", *JOB], tmp_path)


def _drop_tensor(bad, name, replace_with=None):
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    f = bad / index["weight_map"][name]
    tensors = load_file(f)
    if replace_with is None:
        del tensors[name]
    else:
        tensors[name] = replace_with
    save_file(tensors, f, metadata={"format": "pt"})
    if replace_with is None:
        del index["weight_map"][name]
        (bad / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("case,expected", [
    ("missing", "tensor model.layers.1.mlp.up_proj.weight (layer 2) is missing"),
    ("shape", "tensor model.layers.1.mlp.up_proj.weight has shape [64, 31], the model expects [64, 32]"),
    ("arch", "declares architectures ['GPT2LMHeadModel']; supported: LlamaForCausalLM"),
    ("no_weights", "has no *.safetensors weights"),
])
def test_a_bad_directory_is_one_line_and_nothing_runs(tmp_path, hf_dir, case, expected):
    def mutate(bad):
        if case == "missing":
            _drop_tensor(bad, "model.layers.1.mlp.up_proj.weight")
        elif case == "shape":
            _drop_tensor(bad, "model.layers.1.mlp.up_proj.weight", torch.zeros(64, 31))
        elif case == "arch":
            doc = json.loads((bad / "config.json").read_text())
            (bad / "config.json").write_text(json.dumps(dict(doc, architectures=["GPT2LMHeadModel"])))
        else:
            for f in bad.glob("*.safetensors"):
                f.unlink()
    res = _bad(tmp_path, hf_dir, mutate)
    assert res.returncode == 2 and expected in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and not res.records


@pytest.mark.parametrize("sets,expected", [
    (["model.init_from=/no/such/dir"], "no such directory"),
    (["model.d_model=64"], "model.d_model=64 is invalid: has no effect with model.init_from"),
    (["model.preset=llama3-8b"], "pick one of model.preset, model.init_from and model.factory"),
])
def test_bad_keys_with_init_from_are_one_line(tmp_path, hf_dir, sets, expected):
    args = ["run", "--set", f"model.init_from={hf_dir}", *[x for s in sets for x in ("--set", s)], *JOB]
    res = run_cli(args, tmp_path)
    assert res.returncode == 2 and expected in res.stderr and "Traceback" not in res.stderr, res.stderr
