"""The Llama family on the model contract: [embed_tokens, decoder block x N, (norm, lm_head)].

RMSNorm, rotary position embeddings (``rope_theta``; Llama-3 ``rope_scaling``), a SwiGLU MLP,
grouped-query attention (``num_kv_heads``), ``head_dim``, optional biases (Qwen2: on q/k/v only)
and a tied embedding/head. Module and parameter names are Hugging Face's, so its checkpoints map
onto the layers by a table (:mod:`elaswave.model.hf`).

Attention: with dropout off and fast mode on, ``scaled_dot_product_attention`` (fused kernels on
GPU); in deterministic mode, or with dropout, the attention is written out as Hugging Face's eager
path computes it: a fused kernel may pick its algorithm by device and shape, and its dropout does
not draw from our keyed streams.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from elaswave import rng
from elaswave.model import lora, recompute
from elaswave.model.moe import SparseMoE
from elaswave.model.config import ModelConfig
from elaswave.model.contract import LayerCost, Tie
from elaswave.model.masks import causal_mask


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32 whatever the input's dtype, as Hugging Face's LlamaRMSNorm does.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def inverse_frequencies(m: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies, with Llama-3's frequency-dependent scaling when configured."""
    dim = m.head_width
    inv = 1.0 / (m.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if not m.rope_scaling_factor:
        return inv
    factor, low, high = m.rope_scaling_factor, m.rope_low_freq_factor, m.rope_high_freq_factor
    old_len = m.rope_original_max_positions
    wavelen = 2 * math.pi / inv
    # Long wavelengths are slowed by the factor, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(is_medium, blended, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def positions_in_documents(documents: torch.Tensor) -> torch.Tensor:
    """Each token's place in its own document (``documents``: ``[b, t]`` ids, each document one
    run, as the sampler's windows hold them: an id that came back after another would restart):
    what transformers' DataCollatorWithFlattening passes as ``position_ids``."""
    t = documents.shape[1]
    place = torch.arange(t, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return place - torch.where(starts, place, 0).cummax(dim=1).values


class Attention(nn.Module):
    def __init__(self, m: ModelConfig, fused: bool, per_document: bool = False):
        super().__init__()
        self.per_document = per_document
        self.num_heads, self.num_kv_heads, self.head_dim = m.num_heads, m.kv_heads, m.head_width
        self.p = m.dropout
        self.fused = fused
        self.recompute_core = False
        """train.activation_checkpointing=selective: the core runs again in the backward (model/recompute.py)."""
        bias, out_bias = m.attention_bias, m.attention_bias and not m.qkv_bias_only
        self.q_proj = nn.Linear(m.d_model, m.num_heads * m.head_width, bias=bias)
        self.k_proj = nn.Linear(m.d_model, m.kv_heads * m.head_width, bias=bias)
        self.v_proj = nn.Linear(m.d_model, m.kv_heads * m.head_width, bias=bias)
        self.o_proj = nn.Linear(m.num_heads * m.head_width, m.d_model, bias=out_bias)
        if m.qk_norm:  # Qwen3: over each head's width, before the rotation
            self.q_norm = RMSNorm(m.head_width, m.norm_eps)
            self.k_norm = RMSNorm(m.head_width, m.norm_eps)
        self.qk_norm = m.qk_norm
        # Built on the meta device (counted, not run), the table is only its shape: arithmetic on
        # meta tensors runs Python references that import torch._dynamo (2.6 s a rank), and computing
        # it on the CPU took 8 s of a 2,048-GPU simulation of qwen3-235b-a22b.
        here = torch.get_default_device()
        if here.type == "meta":  # (made on the CPU and moved: a meta factory imports sympy)
            shape = torch.empty(m.seq_len, m.head_width, device="cpu")  # (head_width is even)
            self.register_buffer("cos", shape.to(here), persistent=False)
            self.register_buffer("sin", shape.to(here), persistent=False)
        else:
            freqs = torch.outer(torch.arange(m.seq_len, device=here).float(), inverse_frequencies(m).to(here))
            angles = torch.cat((freqs, freqs), dim=-1)
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, gen: torch.Generator | None, documents: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q = lora.project(self.q_proj, x, gen).view(b, t, self.num_heads, self.head_dim)
        k = lora.project(self.k_proj, x, gen).view(b, t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = lora.project(self.v_proj, x, gen).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.per_document and documents is not None:  # [b, 1, t, head_dim]: each row its own positions
            where = positions_in_documents(documents)
            cos, sin = self.cos[where][:, None].to(x.dtype), self.sin[where][:, None].to(x.dtype)
        else:
            cos, sin = self.cos[:t].to(x.dtype), self.sin[:t].to(x.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        # Query head h reads key/value head h // group (Hugging Face's repeat_kv).
        group = self.num_heads // self.num_kv_heads
        k, v = (z.repeat_interleave(group, dim=1) if group > 1 else z for z in (k, v))
        fused = self.fused and (gen is None or self.p == 0.0)
        blocked = None  # fused, without documents: the kernel masks by itself, no [t, t] mask is built
        if not fused or documents is not None:
            blocked = causal_mask(t, x.device)
            if documents is not None:  # block-causal: a token sees the earlier tokens of its own document only
                blocked = (blocked | (documents[:, :, None] != documents[:, None, :]))[:, None]
        core = self._fused_core if fused else self._core
        y = recompute.attention_core(self, core, q, k, v, *(() if blocked is None else (blocked,)), gen=gen)
        return lora.project(self.o_proj, y.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim), gen)

    @staticmethod
    def _fused_core(q, k, v, blocked=None, gen=None):
        return (F.scaled_dot_product_attention(q, k, v, is_causal=True) if blocked is None else
                F.scaled_dot_product_attention(q, k, v, attn_mask=~blocked))

    def _core(self, q, k, v, blocked, gen=None):
        att = (q @ k.transpose(-2, -1)) * self.head_dim ** -0.5
        att = att.masked_fill(blocked, float("-inf")).softmax(dim=-1, dtype=torch.float32)
        att = rng.keyed_dropout(att.to(q.dtype), self.p, gen)
        return att @ v


class MLP(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(m.d_model, m.ffn_width, bias=m.mlp_bias)
        self.up_proj = nn.Linear(m.d_model, m.ffn_width, bias=m.mlp_bias)
        self.down_proj = nn.Linear(m.ffn_width, m.d_model, bias=m.mlp_bias)

    def forward(self, x: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        h = F.silu(lora.project(self.gate_proj, x, gen)) * lora.project(self.up_proj, x, gen)
        return lora.project(self.down_proj, h, gen)


class Embedding(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(m.vocab_size, m.d_model)

    def forward(self, idx: torch.Tensor, gen: torch.Generator | None, documents: torch.Tensor | None = None) -> torch.Tensor:
        return self.embed_tokens(idx)


class Block(nn.Module):
    """``block``: its place among the blocks (which of them are mixtures of experts)."""

    def __init__(self, m: ModelConfig, fused: bool, per_document: bool = False, block: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(m.d_model, m.norm_eps)
        self.self_attn = Attention(m, fused, per_document)
        self.post_attention_layernorm = RMSNorm(m.d_model, m.norm_eps)
        # Under the name its checkpoints give it: Mixtral's experts are block_sparse_moe, Qwen's mlp.
        self.ffn = "block_sparse_moe" if m.is_moe_block(block) and m.moe_names == "mixtral" else "mlp"
        setattr(self, self.ffn, SparseMoE(m, m.moe_blocks_before(block)) if m.is_moe_block(block) else MLP(m))

    def forward(self, x: torch.Tensor, gen: torch.Generator | None, documents: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), gen, documents)
        return x + getattr(self, self.ffn)(self.post_attention_layernorm(x), gen)


class Head(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(m.d_model, m.norm_eps)
        self.lm_head = nn.Linear(m.d_model, m.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, gen: torch.Generator | None, documents: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(self.norm(x))


def _keyed_init(layer: nn.Module, gen: torch.Generator) -> None:
    """Hugging Face's Llama init (normal, std 0.02; biases zero, norms one) from a keyed stream."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


class Llama:
    """``weights``: where initial tensors come from instead of the keyed init (a Hugging Face
    directory reader, :class:`elaswave.model.hf.HFWeights`)."""

    def __init__(self, cfg: ModelConfig, fused_attention: bool = False, weights=None,
                 per_document_positions: bool = False):
        self.cfg = cfg
        self.fused = fused_attention
        self.per_document_positions = per_document_positions
        """data.position_ids=per_document: rotary positions restart at each document."""
        self.num_layers = cfg.num_layers
        self.seq_len = cfg.seq_len
        self.hidden_size = cfg.d_model
        self.vocab_size = cfg.vocab_size
        self.ties = ((Tie(0, "embed_tokens.weight", self.num_layers - 1, "lm_head.weight"),)
                     if cfg.tie_embeddings else ())
        if weights is None and cfg.init_from:
            from elaswave.model.hf import HFWeights
            weights = HFWeights(cfg.init_from)
        self.weights = weights

    def build_layer(self, index: int, seed: int, init: bool = True) -> nn.Module:
        if not 0 <= index < self.num_layers:
            raise ValueError(f"layer index {index} out of range 0..{self.num_layers - 1}")
        if index == 0:
            layer: nn.Module = Embedding(self.cfg)
        elif index == self.num_layers - 1:
            layer = Head(self.cfg)
        else:
            layer = Block(self.cfg, self.fused, self.per_document_positions, index - 1)
        if init and self.weights is not None:
            skip = {t.user_param for t in self.ties if t.user == index}
            self.weights.load_layer(layer, index, self.num_layers, skip)
        elif init:
            _keyed_init(layer, rng.generator(seed, rng.INIT, index))
        if self.cfg.lora.enabled:  # after the base weights: they load by their own names
            lora.attach(layer, self.cfg.lora, lora.init_stream(seed, index) if init else None)
        return layer

    def layer_costs(self) -> list[LayerCost]:
        m = self.cfg
        d, v, f, hd = m.d_model, m.vocab_size, m.ffn_width, m.head_width
        q, kv = m.num_heads * hd, m.kv_heads * hd
        attn_bias = (q + 2 * kv + (0 if m.qkv_bias_only else d)) if m.attention_bias else 0
        attn_params = 2 * d + 2 * d * q + 2 * d * kv + attn_bias + (2 * hd if m.qk_norm else 0)
        attn_flops = 2 * d * q + 2 * d * kv + 2 * m.seq_len * q
        dense = (attn_params + 3 * d * f + ((2 * f + d) if m.mlp_bias else 0), attn_flops + 3 * d * f)
        fe, fs = m.expert_ffn_width, m.shared_expert_ffn_dim
        shared = (3 * d * fs + d if fs else 0, 3 * d * fs + d if fs else 0)
        # A mixture of experts holds all its experts and runs k of them a token (and the router).
        moe = (attn_params + m.num_experts * (3 * d * fe + d) + shared[0],
               attn_flops + m.experts_per_token * 3 * d * fe + m.num_experts * d + shared[1])
        blocks = [moe if m.is_moe_block(b) else dense for b in range(m.num_blocks)]
        head_params = d + (0 if m.tie_embeddings else v * d)
        core = float(2 * m.seq_len * q)  # the scores and the weighted sum: what selective recomputes
        return ([LayerCost(float(d), v * d)] + [LayerCost(float(flops), params, core) for params, flops in blocks]
                + [LayerCost(float(d * v), head_params)])

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="sum")

    def identity(self) -> dict:
        m = self.cfg
        return {"arch": "llama", "vocab_size": m.vocab_size, "d_model": m.d_model, "num_heads": m.num_heads,
                "num_kv_heads": m.kv_heads, "head_dim": m.head_width, "ffn_dim": m.ffn_width,
                "num_blocks": m.num_blocks, "attention_bias": m.attention_bias, "qkv_bias_only": m.qkv_bias_only,
                "mlp_bias": m.mlp_bias, "tie_embeddings": m.tie_embeddings, "qk_norm": m.qk_norm,
                **({"num_experts": m.num_experts, "experts_per_token": m.experts_per_token,
                    "expert_ffn_dim": m.expert_ffn_width, "shared_expert_ffn_dim": m.shared_expert_ffn_dim,
                    "moe_norm_topk": m.moe_norm_topk, "moe_sparse_step": m.moe_sparse_step}
                   if m.num_experts else {})}
