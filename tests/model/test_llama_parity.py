"""Parity with the implementation people trust: transformers' LlamaForCausalLM (test-only).

Tiny configs are built offline with random weights and saved with ``save_pretrained``; elaswave
loads them through ``model.init_from`` and must give the same logits (1e-5, fp32) and loss, for
each architecture option, with the layers split as the layouts 1x1, 2x2 and 1x3 split them; one
optimizer step of the reference trainer must equal torch.optim.AdamW on the transformers model.
"""
import math
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from elaswave import config  # noqa: E402
from elaswave.model.registry import model_for  # noqa: E402
from elaswave.pipeline.stage import Stage  # noqa: E402
from elaswave.plan.partition import partition  # noqa: E402

VOCAB, SEQ = 300, 24
BASE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=64, rope_theta=10000.0)
OPTIONS = {
    "plain": {},
    "gqa": dict(num_key_value_heads=2),
    "head_dim": dict(head_dim=16),
    "rope_theta": dict(rope_theta=500000.0),
    "llama3_rope_scaling": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "attention_bias": dict(attention_bias=True),
    "mlp_bias": dict(mlp_bias=True),
    "tied": dict(tie_word_embeddings=True),
    "rms_norm_eps": dict(rms_norm_eps=1e-5),  # transformers' default is 1e-6; real Llamas use 1e-5
    "all": dict(num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 16}),
}
LAYOUTS = {"1x1": 1, "2x2": 2, "1x3": 3}  # the layer split of a pipeline of that many stages


def _save(tmp_path, seed=0, arch="llama", **options):
    torch.manual_seed(seed)
    if arch == "qwen2":
        hf_cfg = transformers.Qwen2Config(**{**BASE, **options})
        model = transformers.Qwen2ForCausalLM(hf_cfg)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**BASE, **options}))
    # Non-trivial biases and norms, so a bias or norm wired to the wrong place shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path)
    return model.eval()


def _ours(path, extra=()):
    cfg = config.load(None, [f"model.init_from={path}", f"model.seq_len={SEQ}", "train.deterministic=true",
                             "parallel.dp=1", "parallel.pp=1", *extra])
    return cfg, model_for(cfg)


def _stages(cfg, model, num_stages):
    ranges = partition([c.flops_per_token for c in model.layer_costs()], num_stages)
    return [Stage(cfg, r, torch.device("cpu"), model) for r in ranges]


def _logits(stages, ids):
    x = ids
    for stage in stages:
        x = stage.forward(x, 0, 0, train=False)
    return x


def _compare(ref, cfg, model, layout):
    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = ref(ids, labels=ids)
        ours = _logits(_stages(cfg, model, LAYOUTS[layout]), ids[:, :-1])
    loss = float(model.loss_sum(ours, ids[:, 1:])) / ids[:, 1:].numel()
    return float((ours - out.logits[:, :-1]).abs().max()), abs(loss - float(out.loss))


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_logits_and_loss_equal_transformers_in_every_layout(tmp_path, option):
    ref = _save(tmp_path, **OPTIONS[option])
    cfg, model = _ours(tmp_path)
    for layout in LAYOUTS:
        d_logit, d_loss = _compare(ref, cfg, model, layout)
        print(f"parity {option:>20} {layout}: max|dlogit| {d_logit:.2e}  |dloss| {d_loss:.2e}")
        assert d_logit <= 1e-5 and d_loss <= 1e-5, (option, layout, d_logit, d_loss)


def test_qwen2_biases_on_qkv_only_equal_transformers(tmp_path):
    ref = _save(tmp_path, arch="qwen2", num_key_value_heads=2)
    cfg, model = _ours(tmp_path)
    assert cfg.model.attention_bias and cfg.model.qkv_bias_only
    for layout in LAYOUTS:
        d_logit, d_loss = _compare(ref, cfg, model, layout)
        assert d_logit <= 1e-5 and d_loss <= 1e-5, (layout, d_logit, d_loss)


def test_fused_attention_fast_mode_equals_transformers(tmp_path):
    ref = _save(tmp_path, num_key_value_heads=2)
    cfg = config.load(None, [f"model.init_from={tmp_path}", f"model.seq_len={SEQ}", "parallel.dp=1", "parallel.pp=1"])
    model = model_for(cfg)
    assert model.fused
    d_logit, d_loss = _compare(ref, cfg, model, "2x2")
    assert d_logit <= 1e-5 and d_loss <= 1e-5


@pytest.mark.parametrize("bug", ["rotary", "gqa", "tie"])
def test_parity_fails_on_a_planted_bug(tmp_path, monkeypatch, bug):
    """The parity check can fail: a wrong rotary, a transposed GQA head mapping or a missed tie."""
    from elaswave.model import llama
    ref = _save(tmp_path, num_key_value_heads=2, tie_word_embeddings=bug == "tie")
    if bug == "rotary":
        monkeypatch.setattr(llama, "rotate_half", lambda x: torch.cat((x[..., x.shape[-1] // 2:],
                                                                        -x[..., :x.shape[-1] // 2]), dim=-1))
    elif bug == "gqa":  # head h reading kv head h % kv instead of h // group
        monkeypatch.setattr(torch.Tensor, "repeat_interleave",
                            lambda self, n, dim: torch.cat([self] * n, dim=dim))
    cfg, model = _ours(tmp_path)
    if bug == "tie":
        model.ties = ()  # a model that forgets the tie keeps a head of its own, never loaded
        monkeypatch.setattr(model.weights, "load_layer", _skipping_lm_head(model.weights.load_layer))
    d_logit, _ = _compare(ref, cfg, model, "2x2")
    assert d_logit > 1e-3


def _skipping_lm_head(load):
    def wrapped(layer, index, num_layers, skip=()):
        return load(layer, index, num_layers, set(skip) | {"lm_head.weight"})
    return wrapped


@pytest.mark.parametrize("tied", [False, True])
def test_one_reference_step_equals_adamw_on_the_transformers_model(tmp_path, tied):
    from elaswave.reference import train_reference
    ref = _save(tmp_path, num_key_value_heads=2, tie_word_embeddings=tied).train()
    sets = [f"model.init_from={tmp_path}", f"model.seq_len={SEQ}", "train.steps=1", "train.num_micro_batches=2",
            "train.micro_batch_size=2", "train.lr=1e-2", "train.warmup_steps=0", "train.grad_clip=0.05",
            "train.weight_decay=0.1", "data.max_corpus_bytes=20000"]
    cfg = config.load(None, sets)
    export_dir = tmp_path / "after"
    cfg.checkpoint.export_hf = str(export_dir)
    train_reference(cfg)
    # The same step by hand: the same micro-batches, loss over the global token count, clipping, AdamW.
    from elaswave.data.sampler import open_sampler
    t = cfg.train
    sampler = open_sampler(cfg, SimpleNamespace(vocab_size=VOCAB, seq_len=SEQ))
    params = dict(ref.named_parameters())
    decay = [p for n, p in params.items() if p.dim() >= 2]
    no_decay = [p for n, p in params.items() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    tokens = t.num_micro_batches * t.micro_batch_size * SEQ
    for mb in range(t.num_micro_batches):
        b = sampler.micro_batch(0, mb)
        logits = ref(b.inputs).logits
        (torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), b.targets.reshape(-1), reduction="sum")
         / tokens).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), t.grad_clip)
    assert float(norm.detach()) > t.grad_clip  # clipping is in play
    opt.step()
    after = transformers.AutoModelForCausalLM.from_pretrained(export_dir)
    theirs = dict(after.named_parameters())
    worst = max(float((theirs[n] - p).detach().abs().max()) for n, p in params.items())
    assert worst <= 1e-6, worst
    assert not math.isnan(worst)


def test_positions_restart_at_each_document_as_each_document_alone_sees_them(tmp_path):
    """data.position_ids=per_document: a packed window of three documents, block-causal, gives each
    document the logits transformers gives it alone (1e-5), as continuous positions do (the same
    function: rotary attention reads distances). transformers itself, given the restarting
    position_ids DataCollatorWithFlattening makes and no mask, lets attention cross the documents
    under eager and sdpa (only flash-attention kernels cut there): its packed logits are far off."""
    from elaswave.model.llama import positions_in_documents
    from elaswave.model.registry import family
    assert positions_in_documents(torch.tensor([[0, 0, 0, 1, 1, 2], [5, 6, 6, 6, 6, 6]])).tolist() == [
        [0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]]
    ref = _save(tmp_path, num_key_value_heads=2)
    lengths, starts = [7, 9, 8], [0, 7, 16]
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(4))
    documents = torch.tensor([[d for d, n in enumerate(lengths) for _ in range(n)]])
    with torch.no_grad():
        alone = torch.cat([ref(ids[:, s:s + n]).logits for s, n in zip(starts, lengths)], dim=1)
        flattened = ref(ids, position_ids=positions_in_documents(documents)).logits
    cfg, _ = _ours(tmp_path)
    for per_document in (True, False):
        model = family(cfg.model, per_document_positions=per_document)
        with torch.no_grad():
            ours = Stage(cfg, (0, model.num_layers), torch.device("cpu"), model).forward(ids, 0, 0, train=False,
                                                                                         documents=documents)
        d = float((ours - alone).abs().max())
        print(f"per_document={per_document}: max|dlogit| against each document alone {d:.2e}")
        assert d <= 1e-5
    assert float((flattened - alone).abs().max()) > 1e-2
