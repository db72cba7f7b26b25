"""The Llama family cut across a tensor-parallel group: each rank's shard of every layer.

A shard has the layer's module and parameter names with the cut shapes (:mod:`elaswave.tensor.split`
says where): q/k/v and gate/up hold a block of output rows, o and down the matching input columns,
the embedding and the head a block of vocabulary rows (padded to whole canonical blocks), norms
and o's bias whole. Its forward runs the cut products of :mod:`elaswave.tensor.ops`: in fast
mode Megatron's (one all-reduce per product), in deterministic mode canonical blocks summed
exactly, so the logits, the loss and every gradient have the same bits at every degree -- the
whole model on one rank (degree 1) included, which is the reference of a tensor-parallel job.

With sequence parallelism (``parallel.sequence_parallel``, Megatron's) the residual stream, the
norms and what a stage sends are each rank's shard of the sequence: the cut products gather and
reduce-scatter it (:mod:`elaswave.tensor.ops`). In deterministic mode the norms (and a row
product's bias) always sum their gradients over canonical blocks of the sequence, so sequence
parallelism on or off, and every degree, give the same bits.

A shard is cut from the whole layer as :class:`~elaswave.model.llama.Llama` builds it (its keyed
init or its Hugging Face tensors), so every degree starts from the same values.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from elaswave.comm.groups import Group
from elaswave.model.config import ModelConfig
from elaswave.model.contract import LayerCost, counted_numels
from elaswave.model.hf import Cut
from elaswave.model.llama import Llama, RMSNorm, inverse_frequencies, rotate_half
from elaswave.model import recompute
from elaswave.model.masks import causal_mask
from elaswave.tensor import ops
from elaswave.tensor.split import BLOCKS, TensorSplit, check, padded_vocab


class _Cut:
    """What every shard module needs: the split, the group, the mode, and whether the sequence is cut."""

    def __init__(self, m: ModelConfig, split: TensorSplit, group: Group | None, exact: bool, seq: bool = False):
        self.m, self.split, self.group, self.exact = m, split, group, exact
        self.seq = seq and split.degree > 1

    def blocks(self, local: int) -> int:
        return local if self.exact else 0

    def _token_blocks(self, x: torch.Tensor) -> tuple[int, Group | None, int]:
        """(this rank's blocks of the sequence, the group that sums over the rest, all blocks) for
        a norm's or a bias's gradient: canonical blocks in deterministic mode (one, the whole
        sequence, where BLOCKS does not divide it -- which sequence parallelism refuses), none in fast."""
        degree = self.split.degree if self.seq else 1
        group = self.group if self.seq else None
        if not self.exact:
            return 0, group, 1
        total = BLOCKS if x.shape[1] * degree % BLOCKS == 0 else 1
        return total // degree, group, total

    def norm(self, module: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        if not (self.exact or self.seq):
            return module(x)
        return ops.norm(x, module.weight, module.eps, *self._token_blocks(x))

    def add_bias(self, y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if bias is None:
            return y
        if not (self.exact or self.seq):
            return y + bias
        return ops.add_bias(y, bias, *self._token_blocks(y))


class Attention(nn.Module):
    def __init__(self, cut: _Cut):
        super().__init__()
        m, self.cut = cut.m, cut
        self.recompute_core = False  # train.activation_checkpointing=selective (model/recompute.py)
        self.heads = m.num_heads // cut.split.degree
        self.first_head = cut.split.block(m.num_heads)[0]
        # Fewer key-value heads than ranks: each rank holds the one its query heads attend to.
        self.first_kv, end = cut.split.kv_block(m.kv_heads)
        self.kv = end - self.first_kv
        self.counts_kv = cut.split.counts_kv(m.kv_heads)
        hd = self.head_dim = m.head_width
        bias, out_bias = m.attention_bias, m.attention_bias and not m.qkv_bias_only
        self.q_proj = nn.Linear(m.d_model, self.heads * hd, bias=bias)
        self.k_proj = nn.Linear(m.d_model, self.kv * hd, bias=bias)
        self.v_proj = nn.Linear(m.d_model, self.kv * hd, bias=bias)
        self.o_proj = nn.Linear(self.heads * hd, m.d_model, bias=out_bias)
        freqs = torch.outer(torch.arange(m.seq_len).float(), inverse_frequencies(m))
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, gen: torch.Generator | None, documents: torch.Tensor | None = None):
        c, m = self.cut, self.cut.m
        q, k, v = ops.columns(x, [(self.q_proj.weight, self.q_proj.bias, c.blocks(self.heads)),
                                  (self.k_proj.weight, self.k_proj.bias, c.blocks(self.kv), self.counts_kv),
                                  (self.v_proj.weight, self.v_proj.bias, c.blocks(self.kv), self.counts_kv)],
                              c.group, m.num_heads + 2 * m.kv_heads, c.seq)
        b, t = q.shape[0], q.shape[1]  # the whole sequence: x may be this rank's shard of it
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.kv, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.kv, self.head_dim).transpose(1, 2)
        cos, sin = self.cos[:t].to(x.dtype), self.sin[:t].to(x.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if m.num_heads > m.kv_heads:  # GQA: a key-value head's gradient summed alike at every degree
            k, v = ops.shared_kv(k, v, self.heads // self.kv, self.first_kv, m.kv_heads, m.num_heads // m.kv_heads,
                                 c.exact, c.split.kv_replicas(m.kv_heads) > 1, c.group)
        blocked = causal_mask(t, x.device)
        if documents is not None:
            blocked = (blocked | (documents[:, :, None] != documents[:, None, :]))[:, None]
        keep = None
        if gen is not None and m.dropout > 0.0:  # the whole model's draw, this rank's heads of it
            drawn = torch.rand((b, m.num_heads, t, t), generator=gen, device=x.device)
            keep = drawn[:, self.first_head:self.first_head + self.heads] >= m.dropout
        fixed = (blocked,) if keep is None else (blocked, keep)
        y = recompute.attention_core(self, self._core, q, k, v, *fixed)
        y = ops.row(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim), self.o_proj.weight,
                    c.blocks(self.heads), c.group, m.num_heads, c.seq)
        return c.add_bias(y, self.o_proj.bias)

    def _core(self, q, k, v, blocked, keep=None, gen=None):
        """Scores to values for this rank's heads (``keep``: their share of the whole model's dropout draw)."""
        c, m = self.cut, self.cut.m
        if not c.exact and keep is None:
            return (F.scaled_dot_product_attention(q, k, v, is_causal=True) if blocked.dim() == 2 else
                    F.scaled_dot_product_attention(q, k, v, attn_mask=~blocked))
        # Deterministic: one head at a time, the same kernel on the same shape at every degree.
        heads = [slice(h, h + 1) for h in range(self.heads)] if c.exact else [slice(0, self.heads)]
        outs = []
        for hs in heads:
            att = (q[:, hs] @ k[:, hs].transpose(-2, -1)) * self.head_dim ** -0.5
            att = att.masked_fill(blocked, float("-inf")).softmax(dim=-1, dtype=torch.float32).to(q.dtype)
            if keep is not None:
                att = att * keep[:, hs] / (1.0 - m.dropout)
            outs.append(att @ v[:, hs])
        return torch.cat(outs, dim=1)


class MLP(nn.Module):
    def __init__(self, cut: _Cut):
        super().__init__()
        m, self.cut = cut.m, cut
        width = m.ffn_width // cut.split.degree
        self.local_blocks = BLOCKS // cut.split.degree
        self.gate_proj = nn.Linear(m.d_model, width, bias=m.mlp_bias)
        self.up_proj = nn.Linear(m.d_model, width, bias=m.mlp_bias)
        self.down_proj = nn.Linear(width, m.d_model, bias=m.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, n = self.cut, self.cut.blocks(self.local_blocks)
        gate, up = ops.columns(x, [(self.gate_proj.weight, self.gate_proj.bias, n),
                                   (self.up_proj.weight, self.up_proj.bias, n)], c.group, 2 * BLOCKS, c.seq)
        y = ops.row(F.silu(gate) * up, self.down_proj.weight, n, c.group, BLOCKS, c.seq)
        return c.add_bias(y, self.down_proj.bias)


class Embedding(nn.Module):
    def __init__(self, cut: _Cut):
        super().__init__()
        self.cut = cut
        self.start, end = cut.split.block(padded_vocab(cut.m.vocab_size))
        self.embed_tokens = nn.Embedding(end - self.start, cut.m.d_model)

    def forward(self, idx, gen, documents=None):
        return ops.embed(idx, self.embed_tokens.weight, self.start, self.cut.group, self.cut.seq)


class Block(nn.Module):
    def __init__(self, cut: _Cut):
        super().__init__()
        m, self.cut = cut.m, cut
        self.input_layernorm = RMSNorm(m.d_model, m.norm_eps)
        self.self_attn = Attention(cut)
        self.post_attention_layernorm = RMSNorm(m.d_model, m.norm_eps)
        self.mlp = MLP(cut)

    def forward(self, x, gen, documents=None):
        x = x + self.self_attn(self.cut.norm(self.input_layernorm, x), gen, documents)
        return x + self.mlp(self.cut.norm(self.post_attention_layernorm, x))


class Head(nn.Module):
    """The final norm and this rank's vocabulary columns of the logits (padding columns included;
    the loss masks them)."""

    def __init__(self, cut: _Cut):
        super().__init__()
        self.cut = cut
        self.start, end = cut.split.block(padded_vocab(cut.m.vocab_size))
        self.norm = RMSNorm(cut.m.d_model, cut.m.norm_eps)
        self.lm_head = nn.Linear(cut.m.d_model, end - self.start, bias=False)

    def forward(self, x, gen, documents=None):
        c = self.cut
        return ops.column(c.norm(self.norm, x), self.lm_head.weight, None, c.blocks(BLOCKS // c.split.degree),
                          c.group, BLOCKS, c.seq)


# Where each parameter of a whole layer is cut: the dimension, and how many canonical units it has.
_ROWS, _COLS = 0, 1
_KV = ("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")


def _cut_dim(name: str) -> int | None:
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias",
                      "v_proj.bias", "gate_proj.weight", "up_proj.weight", "gate_proj.bias", "up_proj.bias",
                      "embed_tokens.weight", "lm_head.weight")):
        return _ROWS
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return _COLS
    return None  # norms, o's and down's bias: whole on every rank


class TensorParallelLlama(Llama):
    """The model contract for one rank of a tensor-parallel group: :meth:`build_layer` gives its
    shard. ``group``: the rank's tensor-parallel group (None: degree 1, the reference)."""

    def __init__(self, cfg: ModelConfig, split: TensorSplit, group: Group | None, exact: bool,
                 fused_attention: bool = False, weights=None, sequence_parallel: bool = False):
        check(cfg, split.degree)
        super().__init__(cfg, fused_attention, weights)
        self.split, self.cut = split, _Cut(cfg, split, group, exact, sequence_parallel)

    @property
    def boundary_tokens(self) -> int:
        """Tokens of each sequence a stage sends on: this rank's shard of it under sequence parallelism."""
        return self.seq_len // self.split.degree if self.cut.seq else self.seq_len

    def build_layer(self, index: int, seed: int, init: bool = True) -> nn.Module:
        if not 0 <= index < self.num_layers:
            raise ValueError(f"layer index {index} out of range 0..{self.num_layers - 1}")
        cls = Embedding if index == 0 else Head if index == self.num_layers - 1 else Block
        shard = cls(self.cut)
        if init and self.weights is not None:  # only this rank's slices are read from the files
            skip = {t.user_param for t in self.ties if t.user == index}
            self.weights.load_layer(shard, index, self.num_layers, skip, cut=self.hf_cut)
        elif init:  # the whole layer's keyed init, cut: the same values at every degree
            mine = dict(shard.named_parameters())
            with torch.no_grad():
                for name, p in super().build_layer(index, seed).named_parameters():
                    if name in mine:
                        mine[name].copy_(self.cut_tensor(name, p))
        return shard

    def hf_cut(self, name: str, whole: tuple[int, ...]) -> Cut | None:
        """The part of parameter ``name`` (whole shape ``whole``) this rank holds; None: all of it."""
        dim = _cut_dim(name)
        if dim is None:
            return None
        size = padded_vocab(whole[0]) if name.endswith(("embed_tokens.weight", "lm_head.weight")) else whole[dim]
        start, end = self._rows_held(name, size) if dim == _ROWS else self.split.block(size)
        return Cut(dim, start, end, self.split.degree)

    def _rows_held(self, name: str, rows: int) -> tuple[int, int]:
        """[start, end) of the ``rows`` rows of a row-cut tensor this rank holds (a key-value
        tensor: its key-value heads' rows, replicated where there are fewer heads than ranks)."""
        if name.endswith(_KV):
            first, end = self.split.kv_block(self.cut.m.kv_heads)
            width = rows // self.cut.m.kv_heads
            return first * width, end * width
        return self.split.block(rows)

    def _whole_rows(self, name: str, held: int) -> int:
        """The whole (padded) tensor's rows, from the ``held`` rows of this rank's part."""
        if name.endswith(_KV):
            first, end = self.split.kv_block(self.cut.m.kv_heads)
            return held // (end - first) * self.cut.m.kv_heads
        return held * self.split.degree

    def _counts(self, name: str) -> bool:
        """Whether this rank's copy of ``name`` counts (a replicated key-value head's: its first holder's)."""
        return not name.endswith(_KV) or self.split.counts_kv(self.cut.m.kv_heads)

    def cut_tensor(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of parameter ``name`` of a whole layer (vocabulary rows padded with zeros)."""
        part = self.hf_cut(name, tuple(whole.shape))
        return whole if part is None else part.read(whole, tuple(whole.shape))

    def positions(self, layer) -> torch.Tensor:
        """Where each value of this rank's shard of ``layer`` (a FlatLayer) sits in the whole
        layer's flat vector, padding rows left out; -1 for a value that is not this shard's to
        count: a vocabulary padding row, or a tensor every shard holds whole (the first shard
        counts it). What norms and state digests count, so that every degree counts the same."""
        degree, me = self.split.degree, self.split.rank
        out, at = [], 0
        for (name, _), p in zip(layer.offsets.items(), layer.params):
            rows, dim = p.shape[0], _cut_dim(name)
            cols = p.numel() // rows if rows else 0
            if dim is None:
                pos = torch.arange(p.numel()) + at if me == 0 else torch.full((p.numel(),), -1)
                at += p.numel()
            elif dim == _ROWS:
                whole_rows = self._whole_rows(name, rows)
                real = self._real_rows(name, whole_rows)
                whole_row = torch.arange(rows) + self._rows_held(name, whole_rows)[0]
                pos = at + whole_row[:, None] * cols + torch.arange(cols)[None, :]
                pos[whole_row >= real] = -1
                if not self._counts(name):
                    pos[:] = -1
                at += real * cols
            else:
                pos = at + torch.arange(rows)[:, None] * (cols * degree) + me * cols + torch.arange(cols)[None, :]
                at += rows * cols * degree
            out.append(pos.reshape(-1))
        return torch.cat(out).to(layer.flat.device)

    def replicas(self, layer) -> dict[str, tuple[int, int]]:
        """The tensors of this rank's shard of ``layer`` that other shards hold too, value for value:
        a tensor every shard holds whole (norms, o's and down's bias), and a key-value tensor whose
        heads are replicated. Key -> (offset, numel) in the flat vector; two shards' equal keys
        must hold equal values (a replicated head's key names its heads). :meth:`positions` and
        the digests count one shard's copy only: the end-of-run check compares the others."""
        kv_heads = self.cut.m.kv_heads
        out = {}
        for (name, offset), p in zip(layer.offsets.items(), layer.params):
            if _cut_dim(name) is None:
                out[name] = (offset, p.numel())
            elif name.endswith(_KV) and self.split.kv_replicas(kv_heads) > 1:
                first, end = self.split.kv_block(kv_heads)
                out[f"{name} (key-value heads {first}..{end - 1})"] = (offset, p.numel())
        return out

    def whole_flat(self, layer, parts: list[torch.Tensor]) -> torch.Tensor:
        """The whole layer's flat vector (padding rows left out) from every shard's flat vector of
        it, in shard order: what its digest and an export read."""
        out = []
        for (name, offset), p in zip(layer.offsets.items(), layer.params):
            pieces = [part[offset:offset + p.numel()].view(p.shape) for part in parts]
            dim = _cut_dim(name)
            if dim is None:
                whole = pieces[0]
            else:
                if name.endswith(_KV):  # a replicated head once, from its first holder
                    pieces = pieces[::self.split.kv_replicas(self.cut.m.kv_heads)]
                whole = torch.cat(pieces, dim=dim)
                if dim == _ROWS:
                    whole = whole[:self._real_rows(name, whole.shape[0])]
            out.append(whole.reshape(-1))
        return torch.cat(out)

    def whole_module(self, index: int) -> nn.Module:
        """Layer ``index`` whole, as the Llama family builds it (values not set): what a whole
        layer gathered from the shards is exported through (:meth:`whole_flat` is its order)."""
        return Llama.build_layer(self, index, 0, init=False)

    def _real_rows(self, name: str, rows: int) -> int:
        return self.vocab_size if name.endswith(("embed_tokens.weight", "lm_head.weight")) else rows

    def layer_costs(self) -> list[LayerCost]:
        """A shard's: its share of the multiply-adds, the parameters it holds."""
        return [LayerCost(c.flops_per_token / self.split.degree, n, c.core_flops_per_token / self.split.degree)
                for c, n in zip(super().layer_costs(), counted_numels(self))]

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        c = self.cut
        start = c.split.block(padded_vocab(self.vocab_size))[0]
        return ops.vocab_loss_sum(logits, targets, start, self.vocab_size, c.blocks(BLOCKS // c.split.degree),
                                  c.group, BLOCKS)
