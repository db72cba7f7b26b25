"""Tensor parallelism in the Llama family, as real gloo groups of 2 and 4 processes: fast mode
against transformers' LlamaForCausalLM, deterministic mode bit for bit against the whole model on
one rank (its degree-1 reference), and the cuts that would break it."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from elaswave import config  # noqa: E402
from elaswave.model.hf import HFWeights  # noqa: E402
from elaswave.model.llama_tp import TensorParallelLlama  # noqa: E402
from elaswave.tensor.split import SplitError, TensorSplit, check, padded_vocab  # noqa: E402
from tests.helpers.spawn import run_group  # noqa: E402

ME = "tests.model.test_llama_tp"
# Vocabularies no degree divides: the padding rows are there at every degree. GQA's 2 key-value
# heads are cut at degree 2 and replicated at degree 4 (each on 2 ranks).
SHAPES = {
    "gqa_tied": dict(vocab_size=250, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=16,
                     tie_word_embeddings=True),
    "qwen2_bias": dict(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16,
                       tie_word_embeddings=False),
}


def _hf_dir(tmp_path, shape):
    torch.manual_seed(0)
    if shape == "qwen2_bias":
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPES[shape]))
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPES[shape]))
    with torch.no_grad():  # biases and norms away from their init, so a wrong cut of them shows
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path / shape
    hf.save_pretrained(path)
    return path


def _model(group, hf_dir: str, exact: bool, degree: int | None = None, sequence: bool = False):
    cfg = config.load(None, [f"model.init_from={hf_dir}", "model.seq_len=16", "model.dropout=0.0"]).model
    degree = group.size if degree is None else degree
    rank = group.group_rank if degree > 1 else 0
    model = TensorParallelLlama(cfg, TensorSplit(degree, rank), group if degree > 1 else None, exact,
                                weights=HFWeights(hf_dir), sequence_parallel=sequence)
    layers = [model.build_layer(i, 0) for i in range(model.num_layers)]
    for tie in model.ties:  # the head computes with the embedding's own tensor
        setattr(layers[tie.user], tie.user_param.split(".")[0], layers[tie.owner].embed_tokens)
    return model, layers


def _ids(vocab: int):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, 17), generator=gen)
    return ids[:, :-1].clone(), ids[:, 1:].clone()


def _gathered(group, t: torch.Tensor, dim: int) -> torch.Tensor:
    out = torch.empty(group.size * t.numel(), dtype=t.dtype)
    group.all_gather(out, t.movedim(dim, 0).contiguous().reshape(-1), "test gather")
    return torch.cat(list(out.view(group.size, *t.movedim(dim, 0).shape)), dim=0).movedim(0, dim)


def logits_rank(group, hf_dir: str, sequence: bool = False):
    """Fast mode: this group's whole logits (padding dropped); with sequence parallelism, also
    the hidden state after the first block, which is this rank's shard of the sequence."""
    model, layers = _model(group, hf_dir, exact=False, sequence=sequence)
    x, _ = _ids(model.vocab_size)
    with torch.no_grad():
        for i, layer in enumerate(layers):
            x = layer(x, None)
            if i == 1 and sequence:
                assert x.shape[1] == 16 // group.size, x.shape
    return _gathered(group, x, -1)[..., :model.vocab_size]


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("degree,sequence", [(2, False), (2, True), pytest.param(4, False, marks=pytest.mark.slow)])
def test_fast_mode_logits_match_transformers(tmp_path, shape, degree, sequence):
    hf_dir = _hf_dir(tmp_path, shape)
    cls = transformers.Qwen2ForCausalLM if shape == "qwen2_bias" else transformers.LlamaForCausalLM
    hf = cls.from_pretrained(hf_dir).eval()
    ids, _ = _ids(SHAPES[shape]["vocab_size"])
    with torch.no_grad():
        expected = hf(ids).logits
    for got in run_group(f"{ME}:logits_rank", degree, tmp_path, hf_dir=str(hf_dir), sequence=sequence):
        assert got.shape == expected.shape
        assert (got - expected).abs().max() < 1e-5


def _grads(model, layers) -> dict[str, torch.Tensor]:
    return {f"{i}.{n}": p.grad.clone() for i, layer in enumerate(layers) for n, p in layer.named_parameters()}


def exact_rank(group, hf_dir: str, sequence: bool = False):
    """Deterministic mode: the loss, logits and every whole gradient at this group's degree (with
    the sequence cut too, ``sequence``) and, on the same process, at degree 1 (the whole model,
    no group)."""
    out = {}
    for degree in (group.size, 1):
        model, layers = _model(group, hf_dir, exact=True, degree=degree, sequence=sequence)
        x, targets = _ids(model.vocab_size)
        targets[0, :3] = -100  # masked targets are not loss tokens
        for layer in layers:
            x = layer(x, None)
        loss = model.loss_sum(x, targets)
        loss.backward()
        grads = _grads(model, layers)
        if degree > 1:  # the whole tensors, from every rank's cut
            from elaswave.model.llama_tp import _KV, _cut_dim
            replicas = model.split.kv_replicas(model.cut.m.kv_heads)
            for name, g in grads.items():
                dim = _cut_dim(name)
                if dim is not None:
                    grads[name] = _gathered(group, g, dim)
                if name.endswith(_KV) and replicas > 1:  # a replicated head's copies agree; counted once
                    pieces = grads[name].chunk(degree, dim)
                    assert all(torch.equal(p, pieces[i - i % replicas]) for i, p in enumerate(pieces)), name
                    grads[name] = torch.cat(pieces[::replicas], dim)
            x = _gathered(group, x.detach(), -1)
        out[degree] = {"loss": loss.detach(), "logits": x.detach()[..., :model.vocab_size],
                       "pad_logits": x.detach()[..., model.vocab_size:],
                       "grads": {n: g[:model.vocab_size] if "embed" in n or "lm_head" in n else g
                                 for n, g in grads.items()},
                       "pad_grads": {n: g[model.vocab_size:] for n, g in grads.items() if "embed" in n or "lm_head" in n}}
    return out


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("degree,sequence", [(2, False), (4, False), (2, True),
                                             pytest.param(4, True, marks=pytest.mark.slow)])
def test_deterministic_mode_is_bit_identical_at_every_degree(tmp_path, shape, degree, sequence):
    """Sequence parallelism too: the norms' and biases' gradients, summed from each rank's blocks
    of the sequence, and every other result equal the whole model's on one rank."""
    hf_dir = _hf_dir(tmp_path, shape)
    for rank, res in enumerate(run_group(f"{ME}:exact_rank", degree, tmp_path, hf_dir=str(hf_dir),
                                         sequence=sequence)):
        cut, whole = res[degree], res[1]
        assert torch.equal(cut["loss"], whole["loss"]), (rank, cut["loss"], whole["loss"])
        assert torch.equal(cut["logits"], whole["logits"])
        assert sorted(cut["grads"]) == sorted(whole["grads"])
        for name in whole["grads"]:
            assert torch.equal(cut["grads"][name], whole["grads"][name]), (rank, name)
        for res_at in (cut, whole):  # vocabulary padding reaches no gradient
            assert all(not g.any() for g in res_at["pad_grads"].values())
    # and the loss is the cross-entropy over the real vocabulary
    hf = (transformers.Qwen2ForCausalLM if shape == "qwen2_bias" else transformers.LlamaForCausalLM).from_pretrained(hf_dir)
    ids, targets = _ids(SHAPES[shape]["vocab_size"])
    targets[0, :3] = -100
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(hf(ids).logits.reshape(-1, SHAPES[shape]["vocab_size"]),
                                                     targets.reshape(-1), reduction="sum")
    assert abs(float(whole["loss"]) - float(expected)) < 1e-3


def test_cuts_that_do_not_fit_are_one_line_errors():
    base = config.load(None, ["model.preset=llama-tiny"]).model  # 4 heads, 2 key-value heads
    check(base, 2)
    with pytest.raises(SplitError, match=r"degree of 3 is invalid: the degree must divide 8"):
        check(base, 3)
    check(base, 4)  # 2 key-value heads, each replicated on 2 ranks
    odd = config.load(None, ["model.preset=llama-tiny", "model.d_model=48", "model.num_heads=6",
                             "model.num_kv_heads=3"]).model
    with pytest.raises(SplitError, match=r"must divide the key-value heads \(3\) or be a multiple of them"):
        check(odd, 2)
    gpt = config.load(None, ["model.preset=gpt-tiny"]).model
    with pytest.raises(SplitError, match="needs a split of each layer's tensors"):
        check(gpt, 2)
    assert padded_vocab(250) == 256 and padded_vocab(256) == 256


def test_a_shard_reads_only_its_slices_and_equals_the_cut_of_the_whole_layer(tmp_path, monkeypatch):
    import contextlib

    from safetensors.torch import load_file, save_file

    from elaswave.model import hf

    from elaswave.model.llama import Llama
    big = dict(SHAPES["gqa_tied"], hidden_size=128, intermediate_size=1024, vocab_size=2000)
    torch.manual_seed(0)
    path = tmp_path / "big"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**big)).save_pretrained(path)
    cfg = config.load(None, [f"model.init_from={path}", "model.seq_len=16"]).model
    whole = dict(Llama(cfg).build_layer(1, 0).named_parameters())
    read_whole, opened = [], hf._opened

    @contextlib.contextmanager
    def watched(f, where):  # the real file, every whole-tensor read noted
        with opened(f, where) as fh:
            class Handle:
                def __getattr__(self, name):
                    return getattr(fh, name)

                def get_tensor(self, key):
                    read_whole.append(key)
                    return fh.get_tensor(key)
            yield Handle()
    monkeypatch.setattr(hf, "_opened", watched)
    for rank in range(4):
        model = TensorParallelLlama(cfg, TensorSplit(4, rank), None, exact=False)
        for name, p in model.build_layer(1, 0).named_parameters():
            assert torch.equal(p, model.cut_tensor(name, whole[name])), name
        emb = model.build_layer(0, 0).embed_tokens.weight  # 500 rows and 4 zero rows of padding at rank 3
        rows = padded_vocab(2000) // 4
        assert emb.shape[0] == rows and (rank < 3 or not emb[2000 - 3 * rows:].any())
    # Whole from the file: the norms only (every rank holds them whole); every cut tensor is read as its slice.
    assert read_whole and all("norm" in key for key in read_whole), read_whole
    # Without a checkpoint: the keyed init of the whole layer, cut.
    keyed = config.load(None, ["model.preset=llama-tiny"]).model
    shard = TensorParallelLlama(keyed, TensorSplit(2, 1), None, exact=True).build_layer(2, 7)
    full = dict(Llama(keyed).build_layer(2, 7).named_parameters())
    assert torch.equal(shard.mlp.down_proj.weight, full["mlp.down_proj.weight"][:, 64:])
    assert torch.equal(shard.self_attn.k_proj.weight, full["self_attn.k_proj.weight"][16:])
    # A checkpoint whose tensor does not fit the cut: one line naming it.
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:1000]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(config.ConfigError, match=r"tensor model.layers.0.mlp.up_proj.weight has shape \[1000, 128\] "
                                                 r"\(cut 4 ways: \[250, 128\]\), the model expects \[256, 128\]"):
        TensorParallelLlama(cfg, TensorSplit(4, 0), None, exact=False).build_layer(1, 0)


def test_the_tensors_a_group_replicates_come_from_the_cut_itself():
    # llama-tiny with biases: at degree 4 its 2 key-value heads are each on 2 ranks; the norms and
    # o's bias are whole everywhere; nothing else (q, gate, o's weight...) is replicated.
    from elaswave.zero.flat import FlatLayer
    cfg = config.load(None, ["model.preset=llama-tiny", "model.attention_bias=true"]).model
    keys = []
    for rank in range(4):
        model = TensorParallelLlama(cfg, TensorSplit(4, rank), None, exact=False)
        layer = FlatLayer(model.build_layer(1, 0, init=False), 1)
        spans, counted = model.replicas(layer), model.positions(layer) >= 0
        for key, (offset, numel) in spans.items():  # each counts on its first holder only
            assert bool(counted[offset:offset + numel].all()) == (rank % 2 == 0 if "key-value" in key else rank == 0)
            assert bool(counted[offset:offset + numel].any()) == bool(counted[offset:offset + numel].all())
        keys.append(sorted(spans))
        assert model.replicas(FlatLayer(model.build_layer(0, 0, init=False), 0)) == {}  # the embedding: all cut
    head = "k_proj.weight (key-value heads {0}..{0})"
    assert "self_attn.o_proj.bias" in keys[0] and "input_layernorm.weight" in keys[0]
    assert f"self_attn.{head.format(0)}" in keys[0] and keys[0] == keys[1] and keys[2] == keys[3] != keys[0]
    assert not any("q_proj" in k or "o_proj.weight" in k or "mlp" in k for k in keys[0])


def _saved_bytes(fn) -> int:
    """Bytes of the tensors autograd keeps for the backward of ``fn()`` (each storage once)."""
    seen = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def activation_rank(group, hf_dir: str):
    """Bytes a block keeps for its backward on this rank of the group, with and without the
    sequence cut, and for the whole block on one rank."""
    out = {}
    for name, degree, sequence in (("whole", 1, False), ("tp", group.size, False), ("sp", group.size, True)):
        model, layers = _model(group, hf_dir, exact=False, degree=degree, sequence=sequence)
        tokens = 16 // degree if sequence else 16
        x = torch.randn(2, tokens, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
        out[name] = _saved_bytes(lambda: layers[1](x, None))
    return out


def test_sequence_parallelism_keeps_a_tp_th_of_a_block_s_activations(tmp_path):
    """Megatron's claim, measured on the runtime's own block: with the sequence cut, a rank keeps
    ~1/tp of what the whole block keeps; without it, the norms' and the residual's inputs are whole
    on every rank, so it keeps more."""
    hf_dir = _hf_dir(tmp_path, "gqa_tied")
    for res in run_group(f"{ME}:activation_rank", 2, tmp_path, hf_dir=str(hf_dir)):
        assert res["sp"] <= res["whole"] / 2 * 1.05, res
        assert res["tp"] > res["sp"] * 1.2, res
