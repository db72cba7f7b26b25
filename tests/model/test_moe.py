"""Mixture-of-experts models from Hugging Face folders equal transformers' (test-only): Mixtral,
Qwen2-MoE (with its gated shared expert) and Qwen3-MoE (query/key norms), and a dense Qwen3 --
logits within 1e-5 and the load-balancing loss within 1e-6, in one stage and split into a
pipeline's stages; the checks fail on a wrong expert order, a wrong top-k normalisation or a
dropped auxiliary term."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from elaswave import config  # noqa: E402
from elaswave.model import moe  # noqa: E402
from elaswave.model.registry import model_for  # noqa: E402
from elaswave.pipeline.stage import Stage  # noqa: E402

VOCAB, SEQ = 300, 16
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
FAMILIES = {
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2,
                                                           router_aux_loss_coef=0.02)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2,
                                                               moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                                               norm_topk_prob=False, router_aux_loss_coef=0.001)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(num_experts=6, num_experts_per_tok=3,
                                                               moe_intermediate_size=24, norm_topk_prob=True,
                                                               head_dim=16, router_aux_loss_coef=0.001)),
    "qwen3_moe_sparse_step_2": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=2)),
    "qwen3_dense": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=16)),
}


def _save(path, family):
    model_cls, cfg_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**{**BASE, **extra}))
    with torch.no_grad():  # non-trivial norms and routers: a norm or router wired wrong shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("gate.weight") and "proj" not in name:
                p.mul_(20.0)  # peaked routing: a wrong top-k choice moves the logits
    model.save_pretrained(path)
    return model.eval()


def _ours(path, stages=1):
    cfg = config.load(None, [f"model.init_from={path}", f"model.seq_len={SEQ}", "train.deterministic=true",
                             "parallel.pp=1"])
    model = model_for(cfg)
    n = model.num_layers
    cuts = [0, *[round(n * (i + 1) / stages) for i in range(stages - 1)], n]
    return cfg, model, [Stage(cfg, (a, b), torch.device("cpu"), model) for a, b in zip(cuts, cuts[1:])]


def _run(stages, ids):
    x = ids
    with moe.recording() as record:
        for stage in stages:
            x = stage.forward(x, 0, 0, train=False)
    return x, record


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_the_load_balancing_loss_equal_transformers(tmp_path, family):
    ref = _save(tmp_path, family)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = ref(ids, output_router_logits=family != "qwen3_dense")
    for stages in (1, 3):
        cfg, model, parts = _ours(tmp_path, stages)
        with torch.no_grad():
            logits, record = _run(parts, ids)
        assert float((logits - out.logits).abs().max()) <= 1e-5, (family, stages)
        if family == "qwen3_dense":
            assert not record and cfg.model.qk_norm and not cfg.model.num_experts
            continue
        ours = moe.aux_loss(record, cfg.model.num_experts)
        assert abs(float(ours) - float(out.aux_loss)) <= 1e-6, (family, stages, float(ours), float(out.aux_loss))
        assert cfg.model.moe_aux_loss_coef == FAMILIES[family][2].get("router_aux_loss_coef", 0.001)


@pytest.mark.parametrize("bug", ["expert_order", "normalisation", "dropped_aux"])
def test_the_checks_fail_on_a_planted_bug(tmp_path, monkeypatch, bug):
    ref = _save(tmp_path, "qwen3_moe")
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = ref(ids, output_router_logits=True)
    cfg, model, parts = _ours(tmp_path)
    if bug == "expert_order":  # experts read in reverse: expert e's tokens run through expert E-1-e
        for stage in parts:
            for layer in stage.layers:
                for m in layer.module.modules():
                    if isinstance(m, moe.SparseMoE):
                        m.experts = torch.nn.ModuleList(list(m.experts)[::-1])
    elif bug == "normalisation":
        for stage in parts:
            for layer in stage.layers:
                for m in layer.module.modules():
                    if isinstance(m, moe.SparseMoE):
                        m.normalize = not m.normalize
    with torch.no_grad():
        logits, record = _run(parts, ids)
    if bug == "dropped_aux":
        record.clear()  # a stage that forgot to record its blocks
        assert moe.aux_loss(record, cfg.model.num_experts) is None
        return
    assert float((logits - out.logits).abs().max()) > 1e-3


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_steps_of_the_reference_equal_adamw_on_transformers_with_the_aux_loss(tmp_path, family):
    """Three steps of elaswave's trainer on each family's folder against transformers trained by hand
    on the same micro-batches: the mean token loss of the global batch plus the folder's
    router_aux_loss_coef times each forward's load-balancing loss (its share of the sequences),
    clipping, AdamW with decay on matrices. Losses within 1e-5 (the aux losses as recorded, too),
    parameters within 1e-4 (below); and a run without the aux term differs."""
    import math
    from types import SimpleNamespace

    from elaswave.data.sampler import open_sampler
    from elaswave.reference import train_reference
    from elaswave.zero.optimizer import lr_at
    from safetensors.torch import load_file
    ref = _save(tmp_path / "base", family).train()
    sets = [f"model.init_from={tmp_path / 'base'}", f"model.seq_len={SEQ}", "train.steps=3", "train.num_micro_batches=2",
            "parallel.pp=1", "parallel.dp=1",
            "train.micro_batch_size=2", "train.lr=1e-2", "train.warmup_steps=1", "train.grad_clip=0.5",
            "model.moe_aux_loss_coef=0.5", "data.source=stdlib", "data.max_corpus_bytes=20000",
            "checkpoint.export_dtype=fp32", f"checkpoint.export_hf={tmp_path / 'after'}"]
    cfg = config.load(None, sets)
    records = []
    ours = train_reference(cfg, on_step=records.append)
    t = cfg.train
    params = dict(ref.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": t.weight_decay},
                             {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}],
                            lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    sampler = open_sampler(cfg, SimpleNamespace(vocab_size=VOCAB, seq_len=SEQ))
    tokens = t.num_micro_batches * t.micro_batch_size * SEQ
    theirs, auxes = [], []
    for step in range(t.steps):
        opt.zero_grad()
        total, step_aux = 0.0, []
        for mb in range(t.num_micro_batches):
            b = sampler.micro_batch(step, mb)
            out = ref(b.inputs, output_router_logits=True)
            ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB), b.targets.reshape(-1), reduction="sum")
            total += float(ce.detach())
            step_aux.append(float(out.aux_loss))
            (ce / tokens + 0.5 * out.aux_loss * (b.inputs.shape[0] / (t.num_micro_batches * t.micro_batch_size))).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), t.grad_clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, t)
        opt.step()
        theirs.append(total / tokens)
        auxes.append(math.fsum(step_aux) / len(step_aux))
    assert max(abs(a - b) for a, b in zip(ours["losses"], theirs)) < 1e-5, (ours["losses"], theirs)
    recorded = [r["aux_loss"] for r in records if r["event"] == "step"]
    assert max(abs(a - b) for a, b in zip(recorded, auxes)) < 1e-5, (recorded, auxes)
    after = load_file(tmp_path / "after" / "model.safetensors")
    worst = max(float((after[n] - p).detach().abs().max()) for n, p in params.items() if n in after)
    # 1e-4, 1 % of one step's rate: Adam's first update is g / (|g| + eps), so where a gradient is
    # near eps (the shared expert's, under a closed sigmoid gate) float noise of 1e-12 in it moves
    # the update by 1e-5 -- measured 9.5e-6 after one step and after three.
    assert worst <= 1e-4, sorted(((float((after[n] - p).detach().abs().max()), n) for n, p in params.items()
                                  if n in after), reverse=True)[:3]
    # Without the term, the parameters go elsewhere: the test sees the aux loss's gradient.
    plain = config.load(None, [*sets[:-1], "model.moe_aux_loss_coef=0", f"checkpoint.export_hf={tmp_path / 'plain'}"])
    train_reference(plain)
    other = load_file(tmp_path / "plain" / "model.safetensors")
    gates = [n for n in after if n.endswith(".gate.weight") and "shared_expert" not in n]  # the routers
    assert gates and max(float((after[n] - other[n]).abs().max()) for n in gates) > 1e-4


def test_a_moe_folder_comes_back_exactly_and_its_trained_export_loads_in_transformers(tmp_path):
    from safetensors.torch import load_file

    from tests.helpers.spawn import run_cli
    _save(tmp_path / "base", "qwen2_moe")
    job = ["run", *[x for s in [f"model.init_from={tmp_path / 'base'}", f"model.seq_len={SEQ}", "parallel.pp=1",
                                "parallel.dp=2", "train.num_micro_batches=2", "train.micro_batch_size=2",
                                "data.source=stdlib", "data.max_corpus_bytes=20000", "parallel.timeout_s=60"]
                    for x in ("--set", s)]]
    same = run_cli([*job, "--set", "train.steps=0", "--set", f"checkpoint.export_hf={tmp_path / 'same'}"], tmp_path)
    assert same.returncode == 0, same.stderr
    a, b = load_file(tmp_path / "base" / "model.safetensors"), load_file(tmp_path / "same" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    trained = run_cli([*job, "--set", "train.steps=2", "--set", f"checkpoint.export_hf={tmp_path / 'trained'}"], tmp_path)
    assert trained.returncode == 0, trained.stderr
    assert all(r["aux_loss"] > 0 for r in trained.records if r["event"] == "step")
    back = transformers.Qwen2MoeForCausalLM.from_pretrained(tmp_path / "trained").eval()
    cfg = config.load(None, [f"model.init_from={tmp_path / 'trained'}", f"model.seq_len={SEQ}", "parallel.pp=1"])
    model = model_for(cfg)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = Stage(cfg, (0, model.num_layers), torch.device("cpu"), model).forward(ids, 0, 0, train=False)
        assert float((back(ids).logits - ours).abs().max()) <= 1e-5


SHAPES = {  # models built from keys (no folder): written as the family that computes them
    "MixtralForCausalLM": ["model.num_experts=4", "model.moe_names=mixtral", "model.tie_embeddings=false"],
    "Qwen2MoeForCausalLM": ["model.num_experts=4", "model.expert_ffn_dim=24", "model.shared_expert_ffn_dim=40",
                            "model.moe_norm_topk=false", "model.attention_bias=true", "model.qkv_bias_only=true"],
    "Qwen3MoeForCausalLM": ["model.num_experts=6", "model.experts_per_token=3", "model.expert_ffn_dim=24",
                            "model.qk_norm=true", "model.moe_sparse_step=2"],
    "Qwen3ForCausalLM": ["model.qk_norm=true", "model.head_dim=24"],
}


@pytest.mark.parametrize("arch", sorted(SHAPES))
def test_a_model_built_from_keys_exports_as_its_family_with_its_logits(tmp_path, arch):
    from tests.helpers.spawn import run_cli
    sets = [f"model.seq_len={SEQ}", "model.dropout=0", "parallel.pp=1", "parallel.dp=1", *SHAPES[arch]]
    res = run_cli(["run", *[x for s in [*sets, "train.steps=0", "checkpoint.export_dtype=fp32",
                                        f"checkpoint.export_hf={tmp_path / 'out'}"] for x in ("--set", s)]], tmp_path)
    assert res.returncode == 0, res.stderr
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(theirs).__name__ == arch
    cfg = config.load(None, [*sets, "train.deterministic=true"])
    model = model_for(cfg)
    ids = torch.randint(0, cfg.model.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = Stage(cfg, (0, model.num_layers), torch.device("cpu"), model).forward(ids, 0, 0, train=False)
        assert float((theirs(ids).logits - ours).abs().max()) <= 1e-5


def test_a_shape_no_family_has_is_refused_before_it_trains(tmp_path):
    from tests.helpers.spawn import run_cli
    res = run_cli(["run", "--set", "model.num_experts=4", "--set", "parallel.pp=1", "--set",
                   f"checkpoint.export_hf={tmp_path / 'x'}"], tmp_path, timeout_s=60)  # Qwen names, no shared expert
    assert res.returncode == 2 and "no Hugging Face family's" in res.stderr and "shared expert" in res.stderr, res.stderr


@pytest.mark.parametrize("family,edit,message", [
    ("mixtral", {"router_jitter_noise": 0.1}, "sets router_jitter_noise=0.1, which elaswave does not implement (only 0)"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, "sets mlp_only_layers=[1], which elaswave does not implement"),
    ("mixtral", {"architectures": ["DeepseekV3ForCausalLM"]}, "declares architectures ['DeepseekV3ForCausalLM']; supported:"),
])
def test_a_moe_folder_of_an_unknown_family_or_routing_option_is_refused_by_name(tmp_path, family, edit, message):
    import json
    _save(tmp_path, family)
    doc = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**doc, **edit}))
    with pytest.raises(config.ConfigError) as err:
        model_for(config.load(None, [f"model.init_from={tmp_path}", "parallel.pp=1"]))
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_more_experts_a_token_than_there_are_is_one_line_and_exit_2(tmp_path):
    from tests.helpers.spawn import run_cli
    res = run_cli(["run", "--set", "model.num_experts=4", "--set", "model.experts_per_token=5", "--set",
                   "parallel.pp=1"], tmp_path, timeout_s=60)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert "model.experts_per_token=5 is invalid: must be in 1..model.num_experts=4" in lines[0], res.stderr
