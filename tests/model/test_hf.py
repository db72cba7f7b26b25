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
          num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, rms_norm_eps=1e-5)
JOB = [x for s in [*TINY[4:], "model.seq_len=32", "parallel.timeout_s=60", "data.source=stdlib"] for x in ("--set", s)]


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
    assert "no step trained" in res.stdout and "nan" not in res.stdout
    a, b = _tensors(hf_dir), _tensors(out)
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # Small enough for one file: named as transformers names one, without an index.
    assert sorted(f.name for f in out.glob("*.safetensors")) == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists() and not list(tmp_path.glob(".out.partial*"))


TOKENS = ["<unk>", "<s>", "</s>", *[f"w{i}" for i in range(336)]]  # 339, bos 1 and eos 2


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    """A folder as a user brings it: bf16 weights, GQA, Llama-3 rope scaling, 2048 positions,
    rms_norm_eps 1e-5, bos/eos, a generation config and a 339-token tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    path = tmp_path_factory.mktemp("bf16")
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(**dict(HF, vocab_size=len(TOKENS), tie_word_embeddings=False,
                                          max_position_embeddings=2048), bos_token_id=1, eos_token_id=2,
                                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(TOKENS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(path)
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {f.name for f in path.iterdir()}
    return path


def test_a_bf16_folder_comes_back_field_for_field_from_a_real_layout(tmp_path, bf16_dir):
    """init_from -> train.steps=0 at dp=2 x pp=2 -> export: the same folder, replacing one that
    existed only because checkpoint.overwrite says so (its file no export writes is kept)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("replace me")
    job = ["run", "--set", f"model.init_from={bf16_dir}", "--set", "train.steps=0", "--set", "parallel.dp=2",
           "--set", "parallel.pp=2", "--set", "train.num_micro_batches=2", "--set", f"checkpoint.export_hf={out}", *JOB]
    res = run_cli(job, tmp_path)
    assert res.returncode == 2 and "exists and is not empty" in res.stderr and (out / "old.txt").is_file(), res.stderr
    res = run_cli([*job, "--set", "checkpoint.overwrite=true"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert sorted(f.name for f in out.iterdir()) == sorted([*(f.name for f in bf16_dir.iterdir()), "old.txt"])
    assert (out / "old.txt").read_text() == "replace me"
    assert json.loads((out / "config.json").read_text()) == json.loads((bf16_dir / "config.json").read_text())
    for f in bf16_dir.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            assert (out / f.name).read_bytes() == f.read_bytes(), f.name
    a, b = _tensors(bf16_dir), _tensors(out)
    assert sorted(a) == sorted(b) and all(b[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]) for k in a)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token_id, tok.eos_token_id, len(tok)) == (1, 2, len(TOKENS))
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.generation_config.eos_token_id == 2 and model.config.max_position_embeddings == 2048


def test_the_export_never_replaces_its_source(tmp_path, bf16_dir):
    before = {f.name: f.read_bytes() for f in bf16_dir.iterdir()}
    for target in (bf16_dir, bf16_dir.parent):
        res = run_cli(["run", "--set", f"model.init_from={bf16_dir}", "--set", "train.steps=0", "--set",
                       f"checkpoint.export_hf={target}", "--set", "checkpoint.overwrite=true", *JOB], tmp_path)
        assert res.returncode == 2 and "must never replace" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert {f.name: f.read_bytes() for f in bf16_dir.iterdir()} == before


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
                   "--set", f"checkpoint.dir={ckpt}", "--set", "checkpoint.every_steps=5",
                   "--set", "checkpoint.max_shard_gb=0.00003", *JOB], tmp_path)
    assert res.returncode == 0, res.stderr
    assert [r for r in res.records if r["event"] == "recovery"]
    # About 32 KB a shard, shards named and indexed in layer order, each holding what the index says.
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 2 and set(index.values()) == {f.name for f in shards}
    assert all(sorted(load_file(f)) == sorted(k for k, v in index.items() if v == f.name) for f in shards)
    assert index["model.embed_tokens.weight"] == shards[0].name and index["lm_head.weight" if "lm_head.weight"
                                                                         in index else "model.norm.weight"] == shards[-1].name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    model, info = loaded
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.randint(0, HF["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = model.eval()(ids).logits
    assert float((theirs - _logits(out, ids)).abs().max()) <= 1e-5
    # Step 0 of the real layout (separate ranks, dp=2 x pp=2): the loss transformers gives the input
    # model on the same global batch (rms_norm_eps 1e-5, not transformers' default 1e-6).
    first = next(r["loss"] for r in res.records if r["event"] == "step" and r["step"] == 0)
    assert abs(first - _transformers_loss(hf_dir, [f"model.init_from={hf_dir}", "train.num_micro_batches=4",
                                                   *JOB[1::2]], 0)) <= 1e-5
    assert not torch.equal(_tensors(out)["model.norm.weight"], _tensors(hf_dir)["model.norm.weight"])  # it trained
    # Offline, from the disk checkpoint the re-partitioned job wrote at step 5.
    offline = tmp_path / "offline"
    res = run_cli(["export", str(ckpt), str(offline)], tmp_path)
    assert res.returncode == 0, res.stderr
    assert json.loads((offline / "config.json").read_text()) == json.loads((hf_dir / "config.json").read_text())
    res = run_cli(["export", str(ckpt), str(offline)], tmp_path)  # it exists now
    assert res.returncode == 2 and "exists and is not empty" in res.stderr, res.stderr
    assert sorted(_tensors(offline)) == sorted(_tensors(hf_dir))
    _, info = transformers.AutoModelForCausalLM.from_pretrained(offline, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def _transformers_loss(path, sets, step):
    """transformers' mean cross-entropy of step ``step``'s global batch, as elaswave's sampler deals it."""
    from elaswave.data.sampler import open_sampler
    cfg = config.load(None, [*sets, "train.deterministic=true"])
    sampler = open_sampler(cfg, model_for(cfg))
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for mb in range(cfg.train.num_micro_batches):
            batch = sampler.micro_batch(step, mb)
            logits = model(batch.inputs).logits
            total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(),
                                                             reduction="sum"))
            tokens += batch.targets.numel()
    return total / tokens


def test_the_python_api_checks_the_weights_as_the_command_line_does(tmp_path, hf_dir):
    """A missing tensor is one error before any worker starts (it was one rank's exit and the others
    waiting parallel.timeout_s)."""
    from elaswave import api
    from elaswave.model.hf import HFError
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in hf_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    _drop_tensor(bad, "model.layers.1.mlp.up_proj.weight")
    with pytest.raises(HFError, match="tensor model.layers.1.mlp.up_proj.weight .layer 2. is missing"):
        api.train(overrides=[f"model.init_from={bad}", "train.steps=1", *JOB[1::2]], timeout_s=60)


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
    ("act", "hidden_act='gelu_pytorch_tanh', which elaswave does not implement (supported: silu"),
    ("window", "sliding-window attention over 16 positions, shorter than model.seq_len=32"),
    ("rotary", "partial_rotary_factor=0.5, which elaswave does not implement"),
    ("truncated", "is not a readable safetensors file"),
])
def test_a_bad_directory_is_one_line_and_nothing_runs(tmp_path, hf_dir, case, expected):
    def mutate(bad):
        if case == "missing":
            _drop_tensor(bad, "model.layers.1.mlp.up_proj.weight")
        elif case == "shape":
            _drop_tensor(bad, "model.layers.1.mlp.up_proj.weight", torch.zeros(64, 31))
        elif case in ("arch", "act", "window", "rotary"):
            doc = json.loads((bad / "config.json").read_text())
            doc.update({"arch": dict(architectures=["GPT2LMHeadModel"]), "act": dict(hidden_act="gelu_pytorch_tanh"),
                        "window": dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=16),
                        "rotary": dict(partial_rotary_factor=0.5)}[case])
            (bad / "config.json").write_text(json.dumps(doc))
        elif case == "truncated":
            f = sorted(bad.glob("*.safetensors"))[-1]
            f.write_bytes(f.read_bytes()[:-100])
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


def test_a_model_folder_trains_only_on_text_its_own_tokenizer_read(tmp_path, bf16_dir):
    """Without data.path the job would train the model on the standard library as bytes; a corpus
    tokenized otherwise fits the vocabulary (256 byte ids < 339) and still is refused, by hash."""
    from elaswave.data.prepare import prepare
    base = ["run", "--set", f"model.init_from={bf16_dir}", "--set", "train.steps=1", *JOB[:-2]]
    res = run_cli(base, tmp_path)
    assert res.returncode == 2 and "is invalid without data.path" in res.stderr and "Traceback" not in res.stderr
    text = tmp_path / "t.txt"
    text.write_text("w1 w2 w3 " * 200)
    prepare([str(text)], str(tmp_path / "bytes"), "bytes", progress=False)
    res = run_cli([*base, "--set", f"data.path={tmp_path / 'bytes'}"], tmp_path)
    assert res.returncode == 2 and "it was tokenized with 'bytes', not with the model's tokenizer.json" in res.stderr
    ours = prepare([str(text)], str(tmp_path / "ours"), str(bf16_dir), progress=False)
    assert ours["vocab_size"] == len(TOKENS)
    res = run_cli([*base, "--set", f"data.path={tmp_path / 'ours'}", "--set", "train.num_micro_batches=2"], tmp_path)
    assert res.returncode == 0, res.stderr


def test_a_mistral_comes_back_as_a_mistral(tmp_path):
    """Its architecture, model type and sliding window (wider than the job's windows, so without
    effect here) are written back as they came; it was written back as a LlamaForCausalLM."""
    src, out = tmp_path / "mistral", tmp_path / "out"
    torch.manual_seed(2)
    transformers.MistralForCausalLM(transformers.MistralConfig(**{**HF, "tie_word_embeddings": False},
                                                               sliding_window=4096)).save_pretrained(src)
    res = run_cli(["run", "--set", f"model.init_from={src}", "--set", "train.steps=0", "--set", "parallel.pp=2",
                   "--set", f"checkpoint.export_hf={out}", *JOB], tmp_path)
    assert res.returncode == 0, res.stderr
    doc = json.loads((out / "config.json").read_text())
    assert doc == json.loads((src / "config.json").read_text()) and doc["architectures"] == ["MistralForCausalLM"]
    a, b = _tensors(src), _tensors(out)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_corpus_wider_than_the_folders_vocabulary_is_refused_with_advice_that_works(tmp_path, hf_dir):
    """The folder fixes the vocabulary (300): the advice is to prepare the data with the model's
    tokenizer, not "use model.vocab_size >= 450", which the next run refuses with init_from."""
    from elaswave.data.prepare import prepare
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{i % 97} x{i % 13}" for i in range(3000)))
    prepare([str(text)], str(tmp_path / "wide"), "train-bpe:450", progress=False)
    base = ["run", "--set", f"model.init_from={hf_dir}", "--set", "train.steps=1", *JOB[:-2]]
    res = run_cli([*base, "--set", f"data.path={tmp_path / 'wide'}"], tmp_path)
    assert res.returncode == 2 and "use >=" not in res.stderr, res.stderr
    assert f"--tokenizer {hf_dir}" in res.stderr and "the model's vocabulary has 300" in res.stderr, res.stderr
    small = tmp_path / "small"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**dict(HF, vocab_size=200))).save_pretrained(small)
    res = run_cli(["run", "--set", f"model.init_from={small}", *JOB], tmp_path)  # bytes need ids up to 255
    assert res.returncode == 2 and f"--tokenizer {small}" in res.stderr and "use >=" not in res.stderr, res.stderr
