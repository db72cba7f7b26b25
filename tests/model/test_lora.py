"""LoRA adapters through the real CLI: a Llama and a Qwen2 folder fine-tuned with adapters export a
peft adapter folder that ``peft.PeftModel.from_pretrained`` loads with elaswave's own logits, and a
merged folder that transformers loads with the same; the base weights never move, and only the
adapters hold optimizer state."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from safetensors.torch import load_file  # noqa: E402

from elaswave import config  # noqa: E402
from elaswave.model.contract import counted_numels  # noqa: E402
from elaswave.model.registry import model_for  # noqa: E402
from elaswave.pipeline.stage import Stage  # noqa: E402
from tests.helpers.spawn import TINY, run_cli  # noqa: E402

HF = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, rms_norm_eps=1e-5)
JOB = [*TINY[4:], "model.seq_len=32", "parallel.timeout_s=60", "data.source=stdlib", "train.steps=4",
       "train.lr=0.01", "model.lora.rank=4", "model.lora.alpha=8", "checkpoint.export_dtype=fp32"]


def _folder(path, qwen2: bool):
    torch.manual_seed(3)
    if qwen2:
        cfg = transformers.Qwen2Config(**dict(HF, tie_word_embeddings=False))
        transformers.Qwen2ForCausalLM(cfg).save_pretrained(path)
    else:
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF)).save_pretrained(path)
    return path


def _run(tmp_path, base, out, *sets):
    args = ["run"] + [x for s in [*JOB, f"model.init_from={base}", f"checkpoint.export_hf={out}", *sets]
                      for x in ("--set", s)]
    res = run_cli(args, tmp_path)
    assert res.returncode == 0, res.stderr
    return res


def _own_logits(base, adapters: dict, tokens, targets=("q", "k", "v", "o", "gate", "up", "down")):
    """elaswave's whole model on ``tokens``, its adapters set from peft's saved tensors."""
    cfg = config.load(None, ["model.seq_len=32", f"model.init_from={base}", "model.lora.rank=4",
                             "model.lora.alpha=8", f"model.lora.targets={';'.join(targets)}"])
    m = model_for(cfg)
    stage = Stage(cfg, (0, m.num_layers), torch.device("cpu"), m)
    for layer in stage.layers:
        for name, p in layer.module.named_parameters():
            if "lora_" in name:
                with torch.no_grad():
                    p.copy_(adapters.pop(f"base_model.model.model.layers.{layer.index - 1}.{name}.weight"))
    assert not adapters, f"tensors elaswave did not place: {sorted(adapters)}"
    with torch.no_grad():
        return stage.forward(tokens, 0, 0, train=False)


@pytest.mark.parametrize("qwen2", [False, True], ids=["llama", "qwen2"])
def test_an_adapter_folder_loads_in_peft_with_elaswaves_logits(tmp_path, qwen2):
    base = _folder(tmp_path / "base", qwen2)
    out = tmp_path / "adapter"
    _run(tmp_path, base, out, "parallel.pp=2")
    names = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names
    assert "config.json" not in names and "model.safetensors" not in names  # transformers would take it for a model
    doc = json.loads((out / "adapter_config.json").read_text())
    assert (doc["r"], doc["lora_alpha"], doc["peft_type"]) == (4, 8, "LORA")
    saved = load_file(out / "adapter_model.safetensors")
    assert len(saved) == 2 * 7 * HF["num_hidden_layers"]
    assert all(t.abs().max() > 0 for k, t in saved.items() if "lora_B" in k), "B never trained"

    tokens = torch.randint(0, HF["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(0))
    model_cls = transformers.Qwen2ForCausalLM if qwen2 else transformers.LlamaForCausalLM
    plain = model_cls.from_pretrained(base).eval()
    with torch.no_grad():
        before = plain(tokens).logits
    tuned = peft.PeftModel.from_pretrained(plain, out).eval()
    with torch.no_grad():
        theirs = tuned(tokens).logits
    ours = _own_logits(base, dict(saved), tokens)
    assert (theirs - before).abs().max() > 1e-3, "the adapters change nothing"
    assert (ours - theirs).abs().max() < 1e-5

    merged = tmp_path / "merged"
    _run(tmp_path, base, merged, "parallel.pp=2", "checkpoint.export_lora=merged")
    whole = model_cls.from_pretrained(merged).eval()
    with torch.no_grad():
        assert (whole(tokens).logits - theirs).abs().max() < 1e-5
    # Merged, only the targeted projections differ from the base; everything else is its bits.
    a, b = load_file(base / "model.safetensors"), load_file(merged / "model.safetensors")
    assert sorted(a) == sorted(b)
    moved = {k for k in a if not torch.equal(a[k], b[k])}
    assert moved and all(k.endswith("_proj.weight") for k in moved), sorted(moved)


def test_attention_adapters_on_a_mixture_of_experts_load_in_peft_with_elaswaves_logits(tmp_path):
    """A Qwen3-MoE folder tuned at pp=2 (its load-balancing loss across the stages) with adapters
    on q, k, v and o; the experts' MLPs take none yet (one line)."""
    torch.manual_seed(4)
    base = tmp_path / "base"
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**dict(
        HF, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, head_dim=16))).save_pretrained(base)
    out = tmp_path / "adapter"
    _run(tmp_path, base, out, "parallel.pp=2", "model.lora.targets=q;k;v;o")
    saved = load_file(out / "adapter_model.safetensors")
    assert len(saved) == 2 * 4 * HF["num_hidden_layers"]
    tokens = torch.randint(0, HF["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(0))
    tuned = peft.PeftModel.from_pretrained(transformers.Qwen3MoeForCausalLM.from_pretrained(base), out).eval()
    with torch.no_grad():
        theirs = tuned(tokens).logits
    ours = _own_logits(base, dict(saved), tokens, targets=("q", "k", "v", "o"))
    assert (ours - theirs).abs().max() < 1e-5
    res = run_cli(["run", "--set", f"model.init_from={base}", "--set", "model.lora.rank=4", "--set",
                   "model.seq_len=32"], tmp_path, timeout_s=60)
    assert res.returncode == 2 and "target the attention's projections, q;k;v;o" in res.stderr, res.stderr


def test_only_the_adapters_train_and_hold_optimizer_state():
    cfg = config.load(None, [*TINY[:4], "model.lora.rank=2", "model.lora.targets=q;v"])
    m = model_for(cfg)
    counts = counted_numels(m)
    d, kv = cfg.model.d_model, cfg.model.kv_heads * cfg.model.head_width
    assert counts == [0] + [2 * d + 2 * d + 2 * d + 2 * kv] * cfg.model.num_blocks + [0]  # A [2, d] and B [out, 2]
    stage = Stage(cfg, (0, m.num_layers), torch.device("cpu"), m)
    assert [layer.numel for layer in stage.layers] == counts
    frozen = [p for layer in stage.layers for p in layer.frozen.values()]
    assert frozen and not any(p.requires_grad for p in frozen)


@pytest.mark.parametrize("sets,words", [
    (["model.lora.rank=-1"], "model.lora.rank=-1 is invalid: must be >= 0"),
    (["model.lora.rank=4", "model.lora.targets=q;attn"], "model.lora.targets=['q', 'attn'] is invalid"),
    (["model.lora.rank=4", "model.lora.alpha=0"], "model.lora.alpha=0.0 is invalid"),
    (["model.lora.rank=4", "model.arch=gpt"], "adapters are built for model.arch=llama"),
    (["model.lora.rank=40"], "model.lora.rank=40 is invalid: must be <= 32, the narrowest side"),
    (["model.lora.rank=4", "model.factory=examples.custom_model:build"], "adapters are built for model.arch=llama"),
    (["model.lora.rank=4", "parallel.tp=2"], "adapters on tensor-parallel shards are not built yet"),
    (["model.lora=4"], "model.lora='4' is invalid: is a section"),
    (["model.lora.size=4"], "model.lora.size='4' is invalid: unknown key; model.lora has rank, alpha"),
    (["checkpoint.export_lora=both"], "checkpoint.export_lora='both' is invalid: must be one of adapter, merged"),
])
def test_bad_adapter_settings_are_one_line(tmp_path, sets, words):
    res = run_cli(["run"] + [x for s in [*TINY, *sets] for x in ("--set", s)], tmp_path, timeout_s=60)
    assert res.returncode == 2 and words in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_steps_of_the_reference_equal_peft_trained_with_adamw(tmp_path):
    """Four steps of elaswave's trainer with adapters, and the same steps by hand on peft's
    LoraModel over transformers (the same initial adapters, micro-batches, loss over the global
    token count, clipping, AdamW with weight decay on the adapters, the learning-rate schedule):
    every loss within 1e-5 and the final adapters within 1e-6."""
    from types import SimpleNamespace

    from elaswave.data.sampler import open_sampler
    from elaswave.reference import train_reference
    from elaswave.zero.optimizer import lr_at
    base = _folder(tmp_path / "base", qwen2=False)
    sets = [f"model.init_from={base}", "model.seq_len=24", "model.lora.rank=4", "model.lora.alpha=8",
            "model.lora.targets=q;v;gate", "train.steps=4", "train.num_micro_batches=2", "train.micro_batch_size=2",
            "train.lr=2e-2", "train.warmup_steps=1", "train.grad_clip=0.5", "train.weight_decay=0.1",
            "data.source=stdlib", "data.max_corpus_bytes=20000", "checkpoint.export_dtype=fp32"]
    cfg = config.load(None, sets)
    m = model_for(cfg)
    start = Stage(cfg, (0, m.num_layers), torch.device("cpu"), m)  # the adapters as the trainer draws them
    initial = {f"base_model.model.model.layers.{layer.index - 1}.{name}.weight": p.detach().clone()
               for layer in start.layers for name, p in layer.module.named_parameters() if "lora_" in name}
    cfg.checkpoint.export_hf = str(tmp_path / "after")
    ours = train_reference(cfg)["losses"]

    model = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(base), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "gate_proj"]))
    named = dict(model.named_parameters())
    with torch.no_grad():
        for key, value in initial.items():
            named[key.replace(".weight", ".default.weight")].copy_(value)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert len(trained) == len(initial) == 2 * 3 * HF["num_hidden_layers"]
    t = cfg.train
    opt = torch.optim.AdamW(trained, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=t.weight_decay)
    sampler = open_sampler(cfg, SimpleNamespace(vocab_size=HF["vocab_size"], seq_len=24))
    tokens = t.num_micro_batches * t.micro_batch_size * 24
    theirs = []
    for step in range(t.steps):
        opt.zero_grad()
        total = 0.0
        for mb in range(t.num_micro_batches):
            b = sampler.micro_batch(step, mb)
            loss = torch.nn.functional.cross_entropy(model(b.inputs).logits.reshape(-1, HF["vocab_size"]),
                                                     b.targets.reshape(-1), reduction="sum")
            total += float(loss.detach())
            (loss / tokens).backward()
        torch.nn.utils.clip_grad_norm_(trained, t.grad_clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, t)
        opt.step()
        theirs.append(total / tokens)
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-5, (ours, theirs)
    final = load_file(tmp_path / "after" / "adapter_model.safetensors")
    worst = max(float((final[k] - named[k.replace(".weight", ".default.weight")].detach()).abs().max()) for k in final)
    assert worst <= 1e-6, worst
    assert all(final[k].abs().max() > 1e-3 for k in final if "lora_B" in k)  # they trained: B left zero
