"""The model section of a job's config, its presets, and how a Hugging Face ``config.json`` maps
onto it (pure: no torch).

One dataclass covers both families by flags (as litgpt does): ``arch = gpt`` is the small
byte-level GPT (learned positions, LayerNorm, GELU MLP), ``arch = llama`` the Llama family
(RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention; Qwen2 is Llama with attention
biases). Presets carry published shapes; keys set explicitly override a preset's. With
``init_from`` the shapes come from the checkpoint's ``config.json``, and setting one of them to
another value is an error (the weights fix it).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields, replace
from typing import Iterable

from elaswave.errors import fail as _fail
from elaswave.model.lora_config import LoraConfig


ARCHS = ("gpt", "llama")
MOE_NAMES = ("qwen", "mixtral")

# Keys a checkpoint's config.json decides; seq_len and dropout stay the job's choice.
SHAPE_KEYS = ("arch", "vocab_size", "d_model", "num_heads", "num_blocks", "num_kv_heads", "head_dim", "ffn_dim",
              "rope_theta", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
              "rope_original_max_positions", "norm_eps", "attention_bias", "qkv_bias_only", "mlp_bias", "tie_embeddings",
              "qk_norm", "num_experts", "experts_per_token", "expert_ffn_dim", "shared_expert_ffn_dim", "moe_norm_topk",
              "moe_sparse_step", "moe_names")


@dataclass
class ModelConfig:
    """A decoder-only transformer as layers: embedding + ``num_blocks`` blocks + head."""

    arch: str = "gpt"
    """gpt: the small byte-level GPT; llama: the Llama family (also Qwen2 with attention_bias)."""
    preset: str = ""
    """A named shape (see elaswave.model.config.PRESETS); keys set explicitly override it. Unset:
    DEFAULT_PRESET (the default job's model), unless init_from, factory, or another arch is set --
    then the field defaults below (a factory reads what it needs from them)."""
    init_from: str = ""
    """A local Hugging Face directory (config.json + *.safetensors): shapes and initial weights."""
    factory: str = ""
    """package.module:function returning a model that follows elaswave's model contract."""
    vocab_size: int = 256
    """Byte-level corpora need 256; a token file needs more than its largest token id."""
    seq_len: int = 64
    d_model: int = 64
    num_heads: int = 4
    num_blocks: int = 4
    dropout: float = 0.1
    """gpt: on embeddings, attention and residual branches; llama: on attention probabilities
    (Hugging Face's attention_dropout). Masks come from keyed streams either way."""
    num_kv_heads: int = 0
    """llama: key/value heads (grouped-query attention); 0: num_heads."""
    head_dim: int = 0
    """llama: width of one head; 0: d_model // num_heads."""
    ffn_dim: int = 0
    """MLP hidden width; 0: 4 x d_model (gpt), or Llama's rounding of 8/3 x d_model (llama)."""
    rope_theta: float = 10000.0
    rope_scaling_factor: float = 0.0
    """llama: Llama-3 rope scaling factor (0: none); with the three keys below."""
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    norm_eps: float = 1e-5
    attention_bias: bool = False
    """llama: biases on the attention projections (q, k, v and o, as Llama's config means it)."""
    qkv_bias_only: bool = False
    """llama: with attention_bias, no bias on the output projection (Qwen2's layout)."""
    mlp_bias: bool = False
    tie_embeddings: bool = False
    """llama: the output head uses the input embedding's matrix (one logical parameter)."""
    qk_norm: bool = False
    """llama: an RMSNorm over each head's queries and keys before the rotation (Qwen3's q_norm, k_norm)."""
    num_experts: int = 0
    """llama: experts in each mixture-of-experts block (0: a dense MLP; see elaswave/model/moe.py)."""
    experts_per_token: int = 2
    """Top k: the experts each token is routed to."""
    expert_ffn_dim: int = 0
    """One expert's hidden width (Qwen's moe_intermediate_size); 0: ffn_dim (Mixtral's)."""
    shared_expert_ffn_dim: int = 0
    """Qwen2-MoE: the hidden width of the shared expert every token also runs, gated (0: none)."""
    moe_norm_topk: bool = True
    """Renormalise the top-k probabilities to sum to one (Mixtral always; Qwen's norm_topk_prob)."""
    moe_aux_loss_coef: float = 0.0
    """The load-balancing loss's weight in the objective (router_aux_loss_coef)."""
    moe_sparse_step: int = 1
    """Every this-many-th block is a mixture of experts, the others dense (Qwen's decoder_sparse_step)."""
    moe_names: str = "qwen"
    """How checkpoints name the block: qwen (mlp.experts.E.gate_proj...) or mixtral (block_sparse_moe.experts.E.w1...)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """llama: low-rank adapters (model.lora.rank > 0): the base weights frozen, only adapters train."""

    @property
    def num_layers(self) -> int:
        return self.num_blocks + 2

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_width(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    @property
    def expert_ffn_width(self) -> int:
        return self.expert_ffn_dim or self.ffn_width

    def is_moe_block(self, block: int) -> bool:
        """Block ``block`` (0-based) is a mixture of experts."""
        return self.num_experts > 0 and (block + 1) % self.moe_sparse_step == 0

    def moe_blocks_before(self, block: int) -> int:
        """Mixtures of experts among blocks 0..block-1 (a block's place among them: its ordinal)."""
        return sum(self.is_moe_block(b) for b in range(block))

    @property
    def ffn_width(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        if self.arch == "gpt":
            return 4 * self.d_model
        hidden = int(2 * (4 * self.d_model) / 3)
        return 256 * ((hidden + 255) // 256)  # Llama's multiple_of=256

    def validate(self) -> None:
        if self.arch not in ARCHS:
            _fail("model.arch", self.arch, f"must be one of {', '.join(ARCHS)}")
        for name in ("vocab_size", "seq_len", "d_model", "num_heads", "num_blocks"):
            if getattr(self, name) < 1:
                _fail(f"model.{name}", getattr(self, name), "must be >= 1")
        for name in ("num_kv_heads", "head_dim", "ffn_dim", "rope_original_max_positions"):
            if getattr(self, name) < 0:
                _fail(f"model.{name}", getattr(self, name), "must be >= 0 (0: the default)")
        if not 0.0 <= self.dropout < 1.0:
            _fail("model.dropout", self.dropout, "must be in [0, 1)")
        self.lora.validate(self.arch, self.factory)
        if self.lora.enabled and self.arch == "llama":
            q, kv = self.num_heads * self.head_width, self.kv_heads * self.head_width
            widths = {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv, "self_attn.o_proj": q,
                      "mlp.gate_proj": self.ffn_width, "mlp.up_proj": self.ffn_width, "mlp.down_proj": self.ffn_width}
            narrowest = min(min(widths[p], self.d_model) for p in self.lora.paths())
            if self.lora.rank > narrowest:
                _fail("model.lora.rank", self.lora.rank, f"must be <= {narrowest}, the narrowest side of the targeted "
                                                         "projections (a larger rank adds nothing a full update lacks)")
        if self.arch == "gpt":
            if self.d_model % self.num_heads:
                _fail("model.d_model", self.d_model, f"must be divisible by model.num_heads={self.num_heads}")
            for name in ("num_kv_heads", "head_dim", "rope_scaling_factor", "attention_bias", "qkv_bias_only",
                         "mlp_bias", "tie_embeddings", "qk_norm", "num_experts"):
                if getattr(self, name) != getattr(_DEFAULT, name):
                    _fail(f"model.{name}", getattr(self, name), "has no effect with model.arch=gpt; "
                                                                "set model.arch=llama or leave it unset")
        else:
            if not self.head_dim and self.d_model % self.num_heads:
                _fail("model.d_model", self.d_model, f"must be divisible by model.num_heads={self.num_heads} "
                                                     "(or set model.head_dim)")
            if self.num_heads % self.kv_heads:
                _fail("model.num_kv_heads", self.num_kv_heads,
                      f"must divide model.num_heads={self.num_heads} (grouped-query attention)")
            if self.head_width % 2:
                _fail("model.head_dim", self.head_width, "must be even (rotary embeddings rotate pairs)")
            if self.rope_theta <= 0 or self.norm_eps <= 0:
                _fail("model.rope_theta" if self.rope_theta <= 0 else "model.norm_eps",
                      self.rope_theta if self.rope_theta <= 0 else self.norm_eps, "must be > 0")
            if self.num_experts < 0 or self.num_experts == 1:
                _fail("model.num_experts", self.num_experts, "must be 0 (a dense MLP) or >= 2")
            if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
                _fail("model.experts_per_token", self.experts_per_token,
                      f"must be in 1..model.num_experts={self.num_experts}")
            if self.num_experts and self.moe_names not in MOE_NAMES:
                _fail("model.moe_names", self.moe_names, f"must be one of {', '.join(MOE_NAMES)}")
            if self.moe_sparse_step < 1 or self.moe_aux_loss_coef < 0:
                _fail("model.moe_sparse_step" if self.moe_sparse_step < 1 else "model.moe_aux_loss_coef",
                      self.moe_sparse_step if self.moe_sparse_step < 1 else self.moe_aux_loss_coef, "must be >= 1 (>= 0)")
            if self.num_experts and self.lora.enabled and any(p.startswith("mlp.") for p in self.lora.paths()):
                _fail("model.lora.targets", list(self.lora.targets), "adapters on a mixture of experts' MLPs are not "
                      "built yet (model.num_experts > 0): target the attention's projections, q;k;v;o")
            if self.rope_scaling_factor < 0 or (self.rope_scaling_factor and not
                                                self.rope_high_freq_factor > self.rope_low_freq_factor > 0):
                _fail("model.rope_scaling_factor", self.rope_scaling_factor,
                      "must be >= 0, with 0 < model.rope_low_freq_factor < model.rope_high_freq_factor")


_DEFAULT = ModelConfig()

_GPT = dict(arch="gpt", dropout=0.0)
_LLAMA3 = dict(arch="llama", vocab_size=128256, rope_theta=500000.0, rope_scaling_factor=8.0,
               rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_positions=8192,
               num_kv_heads=8, norm_eps=1e-5, dropout=0.0, seq_len=8192)
DEFAULT_PRESET = "llama-tiny"
PRESETS: dict[str, dict] = {
    # The small byte-level GPT of the default job, named.
    "gpt-tiny": dict(arch="gpt", vocab_size=256, seq_len=64, d_model=64, num_heads=4, num_blocks=4, dropout=0.1),
    "gpt2-124m": dict(_GPT, vocab_size=50257, seq_len=1024, d_model=768, num_heads=12, num_blocks=12),
    "gpt-1.3b": dict(_GPT, vocab_size=50257, seq_len=2048, d_model=2048, num_heads=16, num_blocks=24),
    "gpt-13b": dict(_GPT, vocab_size=50257, seq_len=2048, d_model=5120, num_heads=40, num_blocks=40),
    "gpt-175b": dict(_GPT, vocab_size=50257, seq_len=2048, d_model=12288, num_heads=96, num_blocks=96),
    # The default job's model: a Llama small enough for tests on two cores, with GQA, tied embeddings,
    # a byte vocabulary and attention dropout (so every run draws keyed random numbers).
    "llama-tiny": dict(arch="llama", vocab_size=256, seq_len=64, d_model=64, num_heads=4, num_kv_heads=2,
                       num_blocks=4, ffn_dim=128, rope_theta=10000.0, tie_embeddings=True, dropout=0.1),
    "llama3-8b": dict(_LLAMA3, d_model=4096, num_heads=32, num_blocks=32, ffn_dim=14336),
    "llama3-70b": dict(_LLAMA3, d_model=8192, num_heads=64, num_blocks=80, ffn_dim=28672),
    "llama3-405b": dict(_LLAMA3, d_model=16384, num_heads=128, num_blocks=126, ffn_dim=53248),
    # Mixtures of experts (all experts held, experts_per_token of them run a token).
    "mixtral-8x7b": dict(arch="llama", vocab_size=32000, seq_len=32768, d_model=4096, num_heads=32, num_kv_heads=8,
                         num_blocks=32, ffn_dim=14336, rope_theta=1000000.0, num_experts=8, experts_per_token=2,
                         moe_names="mixtral", moe_aux_loss_coef=0.02, dropout=0.0),
    "qwen3-30b-a3b": dict(arch="llama", vocab_size=151936, seq_len=32768, d_model=2048, num_heads=32, num_kv_heads=4,
                          head_dim=128, num_blocks=48, ffn_dim=6144, rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True,
                          num_experts=128, experts_per_token=8, expert_ffn_dim=768, moe_aux_loss_coef=0.001,
                          dropout=0.0),
    "qwen3-235b-a22b": dict(arch="llama", vocab_size=151936, seq_len=32768, d_model=4096, num_heads=64, num_kv_heads=4,
                            head_dim=128, num_blocks=94, ffn_dim=12288, rope_theta=1000000.0, norm_eps=1e-6,
                            qk_norm=True, num_experts=128, experts_per_token=8, expert_ffn_dim=1536,
                            moe_aux_loss_coef=0.001, dropout=0.0),
    "qwen2-7b": dict(arch="llama", vocab_size=152064, seq_len=32768, d_model=3584, num_heads=28, num_kv_heads=4,
                     num_blocks=28, ffn_dim=18944, rope_theta=1000000.0, norm_eps=1e-6, attention_bias=True,
                     qkv_bias_only=True, dropout=0.0),
}


def preset(name: str) -> ModelConfig:
    """The named shape as a whole ModelConfig (the simulator prices these)."""
    if name not in PRESETS:
        _fail("model.preset", name, f"unknown preset; known: {', '.join(PRESETS)}")
    return replace(ModelConfig(), preset=name, **PRESETS[name])


# -- Hugging Face config.json ---------------------------------------------------------------------
HF_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM",
                    "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
_QKV_BIAS_ONLY = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
"""Architectures with biases on q, k and v but not on the output projection."""


ACTIVATIONS = ("silu", "swish")
"""hidden_act values elaswave computes (transformers' names for one function: x * sigmoid(x))."""
NO_EFFECT = {"partial_rotary_factor": (None, 1.0), "attn_logit_softcapping": (None,),
             "final_logit_softcapping": (None,), "use_qk_norm": (None, False)}
"""config.json fields of related architectures that change the model's function unless they hold
one of these values; elaswave implements none of them, so any other value is refused. Fields that
change nothing computed are accepted: ``pretraining_tp`` (transformers 4 slices the same products;
5 ignores it), ids, ``use_cache``, ``initializer_range``."""


def from_hf_config(doc: dict, where: str, seq_len: int | None = None) -> dict:
    """The shape keys that a Hugging Face ``config.json`` (Llama family) sets; a field whose effect
    elaswave does not implement is a one-line error. ``seq_len``: the job's, which decides whether
    a sliding window has any effect (none when it covers the whole window)."""
    archs = doc.get("architectures") or [doc.get("model_type", "?")]
    if not any(a in HF_ARCHITECTURES for a in archs):
        _fail("model.init_from", where, f"its config.json declares architectures {archs}; supported: "
                                        f"{', '.join(HF_ARCHITECTURES)}")
    act = doc.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        _fail("model.init_from", where, f"its config.json sets hidden_act={act!r}, which elaswave does not implement "
                                        f"(supported: {', '.join(ACTIVATIONS)})")
    for key, fine in NO_EFFECT.items():
        if doc.get(key) not in fine:
            _fail("model.init_from", where, f"its config.json sets {key}={doc[key]!r}, which elaswave does not "
                                            f"implement (only {' or '.join(map(repr, fine))})")
    window = doc.get("sliding_window")
    windowed = (doc.get("use_sliding_window") or doc.get("model_type") in ("mistral", "mixtral")
                or "sliding_attention" in (doc.get("layer_types") or []))
    if windowed and window and (seq_len is None or seq_len > int(window)):
        _fail("model.init_from", where, f"uses sliding-window attention over {window} positions, shorter than "
                                        f"model.seq_len={seq_len}; elaswave implements none: set model.seq_len "
                                        f"<= {window}, where the window covers every position")
    d, heads = int(doc["hidden_size"]), int(doc["num_attention_heads"])
    arch = next(a for a in archs if a in HF_ARCHITECTURES)
    qkv_bias = arch in _QKV_BIAS_ONLY and bool(doc.get("qkv_bias", True))
    out = dict(arch="llama", vocab_size=int(doc["vocab_size"]), d_model=d, num_heads=heads,
               num_blocks=int(doc["num_hidden_layers"]), num_kv_heads=int(doc.get("num_key_value_heads") or heads),
               head_dim=int(doc.get("head_dim") or d // heads), ffn_dim=int(doc["intermediate_size"]),
               rope_theta=float(doc.get("rope_theta", 10000.0)), norm_eps=float(doc.get("rms_norm_eps", 1e-6)),
               attention_bias=qkv_bias or (arch not in _QKV_BIAS_ONLY and bool(doc.get("attention_bias", False))),
               qkv_bias_only=qkv_bias, qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
               mlp_bias=bool(doc.get("mlp_bias", False)), tie_embeddings=bool(doc.get("tie_word_embeddings", False)),
               rope_scaling_factor=0.0)
    if out["head_dim"] == d // heads:
        out["head_dim"] = 0  # the default, so a round trip writes what it read
    out.update(_experts_of(doc, arch, where))
    scaling = doc.get("rope_scaling") or doc.get("rope_parameters")
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if scaling and kind == "llama3":
        out.update(rope_scaling_factor=float(scaling["factor"]),
                   rope_low_freq_factor=float(scaling["low_freq_factor"]),
                   rope_high_freq_factor=float(scaling["high_freq_factor"]),
                   rope_original_max_positions=int(scaling["original_max_position_embeddings"]))
        out["rope_theta"] = float(scaling.get("rope_theta", out["rope_theta"]))
    elif scaling and kind != "default":
        _fail("model.init_from", where, f"rope_scaling type {kind!r} is not supported (supported: llama3, none)")
    elif scaling:
        out["rope_theta"] = float(scaling.get("rope_theta", out["rope_theta"]))
    return out


def _experts_of(doc: dict, arch: str, where: str) -> dict:
    """The mixture-of-experts keys of a Mixtral, Qwen2-MoE or Qwen3-MoE config.json (none for a dense one)."""
    if arch == "MixtralForCausalLM":
        if doc.get("router_jitter_noise"):
            _fail("model.init_from", where, f"its config.json sets router_jitter_noise={doc['router_jitter_noise']!r}, "
                                            "which elaswave does not implement (only 0)")
        return dict(num_experts=int(doc["num_local_experts"]), experts_per_token=int(doc["num_experts_per_tok"]),
                    moe_norm_topk=True, moe_aux_loss_coef=float(doc.get("router_aux_loss_coef", 0.0)),
                    moe_names="mixtral")
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        if doc.get("mlp_only_layers"):
            _fail("model.init_from", where, f"its config.json sets mlp_only_layers={doc['mlp_only_layers']!r}, which "
                                            "elaswave does not implement (only [] with decoder_sparse_step)")
        return dict(num_experts=int(doc.get("num_experts") or doc["num_local_experts"]),
                    experts_per_token=int(doc["num_experts_per_tok"]),
                    expert_ffn_dim=int(doc["moe_intermediate_size"]),
                    shared_expert_ffn_dim=int(doc.get("shared_expert_intermediate_size") or 0)
                    if arch == "Qwen2MoeForCausalLM" else 0,
                    moe_norm_topk=bool(doc.get("norm_topk_prob", False)),
                    moe_aux_loss_coef=float(doc.get("router_aux_loss_coef", 0.0)),
                    moe_sparse_step=int(doc.get("decoder_sparse_step", 1)), moe_names="qwen")
    return {}


def hf_architecture(m: ModelConfig) -> str:
    """The transformers class a llama-architecture config is written as, or a ValueError saying
    why none computes it (a shape no family has)."""
    qkv_only = m.attention_bias and m.qkv_bias_only
    if m.num_experts and m.moe_names == "mixtral":
        if m.qk_norm or m.attention_bias or m.mlp_bias or m.shared_expert_ffn_dim or m.moe_sparse_step != 1 \
                or not m.moe_norm_topk:
            raise ValueError("Mixtral has no query/key norms, biases, shared expert, dense blocks or unnormalised top k")
        return "MixtralForCausalLM"
    if m.num_experts:
        if m.mlp_bias:
            raise ValueError("Qwen's MoE blocks have no MLP biases")
        if m.qk_norm:
            if qkv_only or m.shared_expert_ffn_dim:
                raise ValueError("Qwen3-MoE has no q/k/v-only biases and no shared expert")
            return "Qwen3MoeForCausalLM"
        if not m.shared_expert_ffn_dim or (m.attention_bias and not qkv_only):
            raise ValueError("Qwen2-MoE always has a shared expert and biases on q, k and v only (or none)")
        return "Qwen2MoeForCausalLM"
    if m.qk_norm:
        if qkv_only:
            raise ValueError("Qwen3 has no q/k/v-only biases")
        return "Qwen3ForCausalLM"
    return "Qwen2ForCausalLM" if qkv_only else "LlamaForCausalLM"


def to_hf_config(m: ModelConfig) -> dict:
    """A Hugging Face ``config.json`` for a llama-architecture config (:func:`hf_architecture`)."""
    arch = hf_architecture(m)
    qwen2 = arch == "Qwen2ForCausalLM"  # Llama's attention_bias would add an output bias
    doc = {"architectures": [arch], "model_type": _MODEL_TYPES[arch], "vocab_size": m.vocab_size,
           "hidden_size": m.d_model, "intermediate_size": m.ffn_width, "num_hidden_layers": m.num_blocks,
           "num_attention_heads": m.num_heads, "num_key_value_heads": m.kv_heads, "head_dim": m.head_width,
           "hidden_act": "silu", "max_position_embeddings": max(m.seq_len, m.rope_original_max_positions
                                                              if m.rope_scaling_factor else m.seq_len),
           "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta, "attention_bias": m.attention_bias and not qwen2,
           "mlp_bias": m.mlp_bias, "tie_word_embeddings": m.tie_embeddings, "attention_dropout": m.dropout,
           "initializer_range": 0.02, "torch_dtype": "float32", "bos_token_id": None, "eos_token_id": None,
           "rope_scaling": None}
    if m.rope_scaling_factor:
        doc["rope_scaling"] = {"rope_type": "llama3", "factor": m.rope_scaling_factor,
                               "low_freq_factor": m.rope_low_freq_factor, "high_freq_factor": m.rope_high_freq_factor,
                               "original_max_position_embeddings": m.rope_original_max_positions}
    if arch == "MixtralForCausalLM":
        doc.update(intermediate_size=m.expert_ffn_width, num_local_experts=m.num_experts, sliding_window=None,
                   num_experts_per_tok=m.experts_per_token, router_aux_loss_coef=m.moe_aux_loss_coef,
                   router_jitter_noise=0.0, output_router_logits=False)
    elif arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        doc.update(num_experts=m.num_experts, num_experts_per_tok=m.experts_per_token,
                   moe_intermediate_size=m.expert_ffn_width, norm_topk_prob=m.moe_norm_topk,
                   decoder_sparse_step=m.moe_sparse_step, mlp_only_layers=[], router_aux_loss_coef=m.moe_aux_loss_coef,
                   output_router_logits=False, use_sliding_window=False, sliding_window=None)
        if arch == "Qwen2MoeForCausalLM":
            doc.update(shared_expert_intermediate_size=m.shared_expert_ffn_dim, qkv_bias=m.attention_bias,
                       attention_bias=False)
    elif arch == "Qwen3ForCausalLM":
        doc.update(use_sliding_window=False, sliding_window=None)
    return doc


_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe"}


def read_hf_config(path: str) -> dict:
    """``config.json`` of a Hugging Face directory, with one-line errors for what is missing."""
    if not os.path.exists(path):
        _fail("model.init_from", path, "no such directory")
    if not os.path.isdir(path):
        _fail("model.init_from", path, "is not a directory (give the folder holding config.json and *.safetensors)")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        _fail("model.init_from", path, "has no config.json")
    if not any(f.endswith(".safetensors") for f in os.listdir(path)):
        _fail("model.init_from", path, "has no *.safetensors weights")
    try:
        with open(cfg_path) as fh:
            return json.load(fh)
    except ValueError as exc:
        _fail("model.init_from", path, f"config.json is not valid JSON ({exc})")
    raise AssertionError  # unreachable


def resolve(m: ModelConfig, explicit: Iterable[str]) -> ModelConfig:
    """Apply the preset or the checkpoint's config.json to ``m``; ``explicit``: the model keys the
    user set (they override a preset's; with init_from, a shape key set to another value is an error)."""
    explicit = set(explicit)
    if not (m.preset or m.init_from or m.factory) and ("arch" not in explicit
                                                         or m.arch == PRESETS[DEFAULT_PRESET]["arch"]):
        m = replace(m, preset=DEFAULT_PRESET)
    if sum(bool(x) for x in (m.preset, m.init_from, m.factory)) > 1:
        _fail("model.preset" if m.preset else "model.init_from", m.preset or m.init_from,
              "pick one of model.preset, model.init_from and model.factory")
    if m.preset:
        base = preset(m.preset)
        keep = {f.name: getattr(m, f.name) for f in fields(m) if f.name in explicit}
        return replace(base, **{"lora": m.lora, **keep})  # no preset sets adapters: the job's own
    if m.init_from:
        doc = read_hf_config(m.init_from)
        hf = from_hf_config(doc, m.init_from, m.seq_len)
        if "dropout" not in explicit:
            hf["dropout"] = float(doc.get("attention_dropout") or 0.0)
        if "moe_aux_loss_coef" in explicit:  # a training choice, not the weights': the job's to set
            hf.pop("moe_aux_loss_coef", None)
        for key, value in hf.items():
            if key in explicit and getattr(m, key) != value:
                _fail(f"model.{key}", getattr(m, key), f"has no effect with model.init_from={m.init_from!r}, whose "
                                                       f"config.json sets {value!r}; leave it unset")
        return replace(m, **hf)
    return m
