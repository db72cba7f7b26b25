"""The model section: presets with published shapes, explicit keys over a preset, one-line errors,
and the contract's costs for the presets (what the planner and the simulator price)."""
import dataclasses

import pytest

from elaswave import config
from elaswave.config import ConfigError
from elaswave.model.config import PRESETS, from_hf_config, preset, to_hf_config
from elaswave.model.contract import counted_numels
from elaswave.model.registry import family, model_for

# Published totals (parameters), to 0.5 %: the presets' shapes are the real ones.
PUBLISHED = {"gpt2-124m": 124.4e6, "llama3-8b": 8.03e9, "llama3-70b": 70.6e9, "llama3-405b": 405.9e9,
             "qwen2-7b": 7.62e9, "mixtral-8x7b": 46.7e9, "qwen3-30b-a3b": 30.5e9, "qwen3-235b-a22b": 235.1e9}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_the_published_sizes(name):
    m = preset(name)
    if m.arch == "gpt":  # learned positions counted; GPT-2 ties its head, ours does not
        total = sum(c.num_params for c in family(m).layer_costs()) - m.vocab_size * m.d_model
    else:
        total = sum(c.num_params for c in family(m).layer_costs())
    assert abs(total / PUBLISHED[name] - 1) < 0.005, (name, total)


def test_declared_costs_match_the_built_layers():
    for name in ("llama-tiny", "gpt-tiny"):
        model = family(preset(name))
        assert counted_numels(model) == [c.num_params for c in model.layer_costs()]
    # Mixtures of experts (every other block, with a shared expert; and every block, with query/key norms)
    for extra in (dict(num_experts=4, expert_ffn_dim=24, shared_expert_ffn_dim=40, moe_sparse_step=2),
                  dict(num_experts=6, experts_per_token=3, qk_norm=True, moe_names="mixtral")):
        model = family(dataclasses.replace(preset("llama-tiny"), **extra))
        assert counted_numels(model) == [c.num_params for c in model.layer_costs()], extra
    tied = family(preset("llama-tiny"))
    assert tied.ties and tied.layer_costs()[-1].num_params == tied.cfg.d_model  # the head's matrix is the owner's


def test_explicit_keys_override_a_preset_and_the_default_job_is_the_tiny_llama():
    cfg = config.load(None, ["model.preset=llama3-8b", "model.num_blocks=2", "model.seq_len=128"])
    assert (cfg.model.d_model, cfg.model.num_blocks, cfg.model.seq_len, cfg.model.kv_heads) == (4096, 2, 128, 8)
    default = config.load(None, ["model.d_model=32"]).model
    assert (default.preset, default.arch, default.kv_heads, default.tie_embeddings, default.d_model) == (
        "llama-tiny", "llama", 2, True, 32)
    gpt = config.load(None, ["model.arch=gpt"]).model  # naming the other architecture leaves the preset out
    assert (gpt.preset, gpt.arch, gpt.tie_embeddings) == ("", "gpt", False)
    assert config.load(None, ["model.arch=llama"]).model.preset == "llama-tiny"
    assert config.from_dict(config.load(None, []).to_dict()).to_dict() == config.load(None, []).to_dict()
    assert set(PRESETS) >= {"gpt2-124m", "llama3-8b", "llama3-70b", "llama3-405b", "qwen2-7b", "llama-tiny"}


@pytest.mark.parametrize("sets,message", [
    (["model.preset=llama9"], "model.preset='llama9' is invalid: unknown preset; known: gpt-tiny"),
    (["model.arch=llama", "model.num_kv_heads=3"], "model.num_kv_heads=3 is invalid: must divide model.num_heads=4"),
    (["model.arch=gpt", "model.tie_embeddings=true"], "model.tie_embeddings=True is invalid: has no effect with model.arch=gpt"),
    (["model.factory=nocolon"], "must look like package.module:function"),
    (["model.factory=elaswave.rng:DATA"], "elaswave.rng has no callable DATA"),
    (["model.factory=elaswave.rng:generator"], "model.factory='elaswave.rng:generator' raised TypeError"),
])
def test_bad_model_keys_are_one_line_errors(sets, message):
    with pytest.raises(ConfigError, match=None) as err:
        model_for(config.load(None, sets))
    assert message in str(err.value)


def test_a_factory_off_the_contract_says_what_is_missing():
    with pytest.raises(ConfigError) as err:
        model_for(config.load(None, ["model.factory=tests.model.test_config:_not_a_model"]))
    assert "lacks num_layers, seq_len, hidden_size, vocab_size, ties, build_layer, layer_costs" in str(err.value)


def _not_a_model(cfg):
    return object()


def test_hf_config_round_trip():
    for name in ("llama3-8b", "qwen2-7b", "llama-tiny"):
        m = preset(name)
        back = from_hf_config(to_hf_config(m), "x")
        assert all(getattr(m, k) == v or (k == "head_dim" and v == 0) for k, v in back.items()), name


def _folder(tmp_path, **fields):
    """A config.json (and a stand-in weights file: resolving reads no tensor) of a tiny Mistral/Llama."""
    import json

    import torch
    from safetensors.torch import save_file
    doc = {**dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=300, hidden_size=32,
                  intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, hidden_act="silu"), **fields}
    (tmp_path / "config.json").write_text(json.dumps(doc))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


def test_config_fields_without_effect_at_this_length_are_honoured(tmp_path):
    """A Mistral's window covering the whole sequence changes nothing, so it loads; attention_dropout
    and rms_norm_eps are read; pretraining_tp changes no product and is accepted."""
    path = _folder(tmp_path, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=4096,
                   attention_dropout=0.25, rms_norm_eps=1e-5, pretraining_tp=2)
    cfg = config.load(None, [f"model.init_from={path}", "model.seq_len=32"])
    assert (cfg.model.dropout, cfg.model.norm_eps) == (0.25, 1e-5)
    with pytest.raises(ConfigError, match="sliding-window attention over 16 positions"):
        config.load(None, [f"model.init_from={_folder(tmp_path, use_sliding_window=True, sliding_window=16)}",
                           "model.seq_len=32"])
