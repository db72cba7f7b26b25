"""The products a tensor-parallel group computes between its ranks, and their communication.

``group``: this rank's tensor-parallel :class:`~elaswave.comm.groups.Group` (``None``: the whole
tensor on one rank -- the reference, or degree 1). ``blocks``: this rank's canonical blocks of the
cut dimension (:mod:`elaswave.tensor.split`), or 0 in fast mode.

Fast mode is Megatron's: one product on the shard and one float all-reduce. Deterministic mode
computes each canonical block's product alone and sums blocks with :func:`exact_sum`: each
partial turned into int64 fixed point at one scale that every rank derives from the same peak,
the integers summed -- on one rank or across ranks alike, in any order -- and turned back once. So
the bits do not depend on the degree. What it costs: the sum keeps 62 - log2(blocks) bits below
the largest partial's magnitude, so a value more than ~2^-50 below the tensor's largest is
rounded away (float32 keeps 24 bits of each value, however small).

``seq`` (sequence parallelism, Megatron's): between the cut products a rank holds only its shard of
the sequence (dim 1). A column product all-gathers its input's shards first, and the sum that
completes a row product (or the input's gradient of a column one) is reduce-scattered along the
sequence instead of all-reduced. Deterministic mode sums the same integers either way, so the bits
do not change; the norms and a row product's bias, which then see only a shard's tokens, sum their
weights' gradients over :data:`~elaswave.tensor.split.BLOCKS` canonical blocks of the sequence
(:func:`norm`, :func:`add_bias`), on one rank or across ranks alike.

ZB-H1 splits a backward in two (:mod:`elaswave.pipeline.zero_bubble`): B asks a product for its
input's gradient alone, W later for its weights' alone, by setting ``split_pass`` on the product's
autograd node. Each half computes only its own gradients and runs only its own collectives (the
input gradient's sum in B; the weights' sums, and the gather of a sequence shard they read again,
in W), so B + W do one backward's work and every gradient has its bits.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from elaswave.comm.groups import Group


def exact_sum(parts: Sequence[torch.Tensor], group: Group | None, total_parts: int, seq: bool = False) -> torch.Tensor:
    """The sum of every rank's ``parts`` (``total_parts`` in the group), the same bits whichever
    rank holds which part (``seq``: this rank's shard of the sequence of it)."""
    if parts[0].device.type == "meta":  # shapes only (the memory model's run): nothing to sum
        return torch.stack(list(parts)).sum(0)
    peak = torch.stack([p.detach().abs().max().float() for p in parts]).max().reshape(1)
    if group is not None and group.size > 1:
        peaks = torch.empty(group.size, dtype=peak.dtype, device=peak.device)
        group.all_gather(peaks, peak, "tensor-parallel peak")
        peak = peaks.max()
    top = float(peak)
    if not math.isfinite(top):
        raise FloatingPointError(f"a tensor-parallel partial sum is not finite (peak {top})")
    like = parts[0]
    if top == 0.0:
        zeros = torch.zeros_like(like)
        return _seq_scatter(zeros, group, "", summed=True) if seq else zeros
    # Each partial below 2**e; their sum below 2**62 however many there are.
    _, e = math.frexp(top)
    scale = 2.0 ** (62 - e - max(1, math.ceil(math.log2(total_parts))))
    acc = torch.round(parts[0].double() * scale).to(torch.int64)
    for p in parts[1:]:
        acc += torch.round(p.double() * scale).to(torch.int64)
    if seq:
        acc = _seq_scatter(acc, group, "sequence-parallel sum")
    elif group is not None and group.size > 1:
        group.all_reduce(acc, "tensor-parallel sum")
    return (acc.double() / scale).to(like.dtype)


def _seq_gather(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """The whole sequence (dim 1) from every rank's shard of it, in group order."""
    if group is None or group.size == 1:
        return x
    out = torch.empty(group.size * x.numel(), dtype=x.dtype, device=x.device)
    group.all_gather(out, x.contiguous().reshape(-1), "sequence-parallel all-gather")
    return torch.cat(out.view(group.size, *x.shape).unbind(0), dim=1)


def _seq_scatter(t: torch.Tensor, group: Group | None, what: str, summed: bool = False) -> torch.Tensor:
    """This rank's shard of the sequence (dim 1) of the sum of every rank's ``t`` (``summed``: of
    ``t``, already the same on every rank)."""
    if group is None or group.size == 1:
        return t
    n = group.size
    if summed:
        return t.chunk(n, dim=1)[group.group_rank].contiguous()
    if t.is_cuda:  # NCCL moves 1/n of the bytes an all-reduce would
        inp = torch.stack(t.chunk(n, dim=1)).contiguous()
        out = torch.empty_like(inp[0])
        group.reduce_scatter(out.view(-1), inp.view(-1), what)
        return out
    group.all_reduce(t, what)  # gloo's reduce-scatter is an all-reduce and a slice
    return t.chunk(n, dim=1)[group.group_rank].contiguous()


def _all_reduce(t: torch.Tensor, group: Group | None, what: str) -> torch.Tensor:
    if group is not None and group.size > 1:
        group.all_reduce(t, what)
    return t


def _halves(ctx) -> tuple[bool, bool]:
    """Whether this backward computes the input's gradient and the weights': both, unless ZB-H1's
    B (``split_pass`` "input") or W ("weight") asks for one."""
    half = getattr(ctx, "split_pass", None)
    return half != "weight", half != "input"


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _Columns(torch.autograd.Function):
    """``x`` whole on every rank; per product a ``weight`` of this rank's rows (and its bias): its
    columns of ``x @ weight.T + bias``. Products of one input (q, k and v; gate and up) share one
    sum of the input's gradient over the group, as Megatron's fused projections do."""

    @staticmethod
    def forward(ctx, x, spec, group: Group | None, total: int, seq: bool, *params):
        weights, biases = _weights_and_biases(spec, params)
        ctx.save_for_backward(x, *weights)  # a sequence shard is kept as such and gathered again
        ctx.spec, ctx.group, ctx.total, ctx.seq = spec, group, total, seq
        if seq:
            x = _seq_gather(x, group)
        outs = []
        for (blocks, _, _), w, b in zip(spec, weights, biases):
            if not blocks:
                outs.append(F.linear(x, w, b))
            else:
                bs = b.chunk(blocks) if b is not None else [None] * blocks
                outs.append(torch.cat([F.linear(x, wb, bb) for wb, bb in zip(w.chunk(blocks), bs)], dim=-1))
        return tuple(outs)

    splits_backward = True  # see _halves

    @staticmethod
    def backward(ctx, *dys):
        x, *weights = ctx.saved_tensors
        want_x, want_w = _halves(ctx)
        if ctx.seq and want_w:
            x = _seq_gather(x, ctx.group)
        grads, partials = [], []
        for (blocks, has_bias, counted), w, dy in zip(ctx.spec, weights, dys):
            n = max(1, blocks)
            dyc, wc = dy.chunk(n, dim=-1), w.chunk(n)
            grads.append(torch.cat([_rows(d).T @ _rows(x) for d in dyc]) if want_w else None)
            if has_bias:
                grads.append(torch.cat([_rows(d).sum(0) for d in dyc]) if want_w else None)
            if counted and want_x:  # a replicated product's share of the input's gradient counts on one holder
                partials.extend(d @ wb for d, wb in zip(dyc, wc))
        if not want_x:
            d_x = None
        elif not ctx.spec[0][0]:
            d_x = torch.stack(partials).sum(0) if len(partials) > 1 else partials[0]
            d_x = (_seq_scatter(d_x, ctx.group, "sequence-parallel input gradient") if ctx.seq
                   else _all_reduce(d_x, ctx.group, "tensor-parallel input gradient"))
        else:
            d_x = exact_sum(partials, ctx.group, ctx.total, ctx.seq)
        return (d_x, None, None, None, None, *grads)


def _weights_and_biases(spec, params):
    weights, biases, at = [], [], 0
    for _, has_bias, _ in spec:
        weights.append(params[at])
        biases.append(params[at + 1] if has_bias else None)
        at += 2 if has_bias else 1
    return weights, biases


class _Row(torch.autograd.Function):
    """``x`` this rank's columns, ``weight`` the matching columns: ``x @ weight.T`` summed over the
    group (``seq``: this rank's shard of the sequence of the sum)."""

    @staticmethod
    def forward(ctx, x, weight, blocks: int, group: Group | None, total: int, seq: bool):
        ctx.save_for_backward(x, weight)
        ctx.blocks, ctx.group, ctx.seq = blocks, group, seq
        if not blocks:
            y = F.linear(x, weight)
            return _seq_scatter(y, group, "sequence-parallel output") if seq else _all_reduce(
                y, group, "tensor-parallel output")
        return exact_sum([F.linear(xb, wb) for xb, wb in zip(x.chunk(blocks, dim=-1), weight.chunk(blocks, dim=1))],
                         group, total, seq)

    splits_backward = True  # see _halves

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        want_x, want_w = _halves(ctx)
        if ctx.seq:  # each half gathers it (W's would otherwise keep a whole sequence's from B)
            dy = _seq_gather(dy, ctx.group)
        n = max(1, ctx.blocks)
        xs, ws = x.chunk(n, dim=-1), weight.chunk(n, dim=1)
        d_x = torch.cat([dy @ w for w in ws], dim=-1) if want_x else None
        d_weight = torch.cat([_rows(dy).T @ _rows(xb) for xb in xs], dim=1) if want_w else None
        return d_x, d_weight, None, None, None, None


def columns(x, products, group: Group | None, total: int, seq: bool = False) -> tuple[torch.Tensor, ...]:
    """Column-parallel products of one input: ``products`` is (weight, bias or None, this rank's
    blocks of it[, counted]) each -- ``counted`` False on a rank whose rows another rank also holds
    (a replicated key-value head), whose share of the input's gradient that one gives; ``total``:
    the canonical blocks of all of them in the group, each counted once."""
    spec = tuple((p[2], p[1] is not None, p[3] if len(p) > 3 else True) for p in products)
    params = [t for weight, bias, *_ in products for t in ((weight, bias) if bias is not None else (weight,))]
    return _Columns.apply(x, spec, group, total, seq, *params)


def column(x, weight, bias, blocks: int, group: Group | None, total: int, seq: bool = False) -> torch.Tensor:
    return columns(x, [(weight, bias, blocks)], group, total, seq)[0]


class _SharedKV(torch.autograd.Function):
    """Key-value heads repeated for the query heads that attend to them (GQA). The backward sums a
    key-value head's gradient over its query heads: in deterministic mode exactly, at one scale per
    key-value head (from the peak over all its query heads, wherever they are), so the bits do not
    depend on how the query heads are spread over ranks; a head replicated on several ranks (fewer
    key-value heads than ranks) has its sum completed across the group."""

    @staticmethod
    def forward(ctx, k, v, per: int, first: int, total: int, queries: int, exact: bool, shared: bool,
                group: Group | None):
        ctx.args = (per, first, total, queries, exact, shared, group)
        return k.repeat_interleave(per, dim=1), v.repeat_interleave(per, dim=1)

    @staticmethod
    def backward(ctx, dk, dv):
        per, first, total, queries, exact, shared, group = ctx.args
        d = torch.stack([dk, dv])
        two, b, heads, t, width = d.shape
        d = d.reshape(two, b, heads // per, per, t, width)
        mine = slice(first, first + heads // per)
        if not exact:
            acc = d.sum(3)
            if shared:
                acc = _completed(acc, group, total, mine)
            return acc[0], acc[1], *(None,) * 7
        if d.device.type == "meta":
            return dk.new_empty(b, heads // per, t, width), dv.new_empty(b, heads // per, t, width), *(None,) * 7
        peak = d.detach().abs().amax(dim=(1, 3, 4, 5)).float()  # (k or v, this rank's key-value heads)
        if shared:  # every holder's query heads of a head: its peak is the largest of theirs
            peak = _completed(peak, group, total, mine, gather=True)
        if not torch.isfinite(peak).all():
            raise FloatingPointError(f"a key-value head's gradient is not finite (peak {peak.max().item()})")
        # As exact_sum: each part below 2**e, the sum over the head's query heads below 2**62.
        e = torch.frexp(peak).exponent.double()
        scale = torch.where(peak > 0, torch.pow(2.0, 62 - e - max(1, math.ceil(math.log2(queries)))),
                            torch.ones_like(e))[:, None, :, None, None, None]
        acc = torch.round(d.double() * scale).to(torch.int64).sum(3)
        if shared:
            acc = _completed(acc, group, total, mine)
        out = (acc.double() / scale[:, :, :, 0]).to(dk.dtype)
        return out[0], out[1], *(None,) * 7


def _completed(part: torch.Tensor, group: Group | None, total: int, mine: slice, gather: bool = False):
    """Each key-value head's sum (or, ``gather``, largest value) over every rank holding it: this
    rank's heads placed among all ``total`` (dim 1 of a (k, v, ...) pair, dim 2 of a gradient's)."""
    dim = 1 if gather else 2
    shape = list(part.shape)
    shape[dim] = total
    full = part.new_zeros(shape)
    full.narrow(dim, mine.start, mine.stop - mine.start).copy_(part)
    if gather:
        every = torch.empty(group.size * full.numel(), dtype=full.dtype, device=full.device)
        group.all_gather(every, full.reshape(-1).contiguous(), "shared key-value peaks")
        full = every.view(group.size, *full.shape).amax(dim=0)
    else:
        group.all_reduce(full, "shared key-value gradient")
    return full.narrow(dim, mine.start, mine.stop - mine.start)


def shared_kv(k, v, per: int, first: int, total: int, queries: int, exact: bool, shared: bool, group: Group | None):
    """``k`` and ``v`` (batch, this rank's key-value heads from ``first`` of ``total``, time, width)
    repeated ``per`` times each for this rank's query heads; ``queries``: the query heads of one
    key-value head in the whole layer; ``shared``: each head is held by several ranks."""
    return _SharedKV.apply(k, v, per, first, total, queries, exact, shared, group)


def row(x, weight, blocks: int, group: Group | None, total: int, seq: bool = False) -> torch.Tensor:
    return _Row.apply(x, weight, blocks, group, total, seq)


class _Gather(torch.autograd.Function):
    """Every rank's piece summed (exact: all but one rank's piece is zero): the embedding's rows
    (``seq``: this rank's shard of the sequence of them)."""

    @staticmethod
    def forward(ctx, x, group: Group | None, seq: bool):
        ctx.group, ctx.seq = group, seq
        if seq:
            return _seq_scatter(x.clone(), group, "sequence-parallel embedding")
        return _all_reduce(x.clone(), group, "tensor-parallel embedding")

    @staticmethod
    def backward(ctx, dy):
        return (_seq_gather(dy, ctx.group) if ctx.seq else dy), None, None


def embed(ids: torch.Tensor, weight: torch.Tensor, start: int, group: Group | None, seq: bool = False) -> torch.Tensor:
    """Vocabulary-parallel lookup: this rank's rows [start, start + len(weight)), the others' zero."""
    local = ids - start
    outside = (local < 0) | (local >= weight.shape[0])
    out = F.embedding(local.masked_fill(outside, 0), weight)
    return _Gather.apply(out.masked_fill(outside[..., None], 0.0), group, seq)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # In float32 whatever the input's dtype, as Hugging Face's LlamaRMSNorm (and model.llama.RMSNorm) does.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class _Norm(torch.autograd.Function):
    """RMSNorm of this rank's tokens, computed block by block of the sequence; the weight's
    gradient is the exact sum of the blocks' (``blocks`` > 0: this rank's canonical blocks, summed
    over ``group`` too when it holds a shard of the sequence) or, in fast mode, a float all-reduce
    of this rank's shard's (``blocks`` 0)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, blocks: int, group: Group | None, total: int):
        ctx.save_for_backward(x, weight)
        ctx.args = (eps, blocks, group, total)
        return torch.cat([_rms(xb, weight, eps) for xb in x.chunk(max(1, blocks), dim=1)], dim=1)

    splits_backward = True  # see _halves

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        eps, blocks, group, total = ctx.args
        want_x, want_w = _halves(ctx)
        d_xs, d_ws = [], []
        for xb, db in zip(x.chunk(max(1, blocks), dim=1), dy.chunk(max(1, blocks), dim=1)):
            with torch.enable_grad():
                xb, w = xb.detach().requires_grad_(want_x), weight.detach().requires_grad_(want_w)
                wanted = [t for t in (xb, w) if t.requires_grad]
                got = list(torch.autograd.grad(_rms(xb, w, eps), wanted, db))
            d_xs.append(got.pop(0) if want_x else None)
            d_ws.append(got.pop(0) if want_w else None)
        d_x = torch.cat(d_xs, dim=1) if want_x else None
        if not want_w:
            return d_x, None, None, None, None, None
        d_w = exact_sum(d_ws, group, total) if blocks else _all_reduce(d_ws[0], group, "sequence-parallel norm")
        return d_x, d_w, None, None, None, None


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float, blocks: int, group: Group | None,
         total: int) -> torch.Tensor:
    """RMSNorm of ``x`` (see :class:`_Norm`): ``group`` None where every rank holds every token."""
    return _Norm.apply(x, weight, eps, blocks, group, total)


class _Bias(torch.autograd.Function):
    """``y + bias``; the bias's gradient summed as :class:`_Norm` sums its weight's."""

    @staticmethod
    def forward(ctx, y, bias, blocks: int, group: Group | None, total: int):
        ctx.args = (blocks, group, total)
        return y + bias

    splits_backward = True  # see _halves

    @staticmethod
    def backward(ctx, dy):
        blocks, group, total = ctx.args
        want_x, want_w = _halves(ctx)
        if not want_w:
            return dy, None, None, None, None
        if blocks:
            d_b = exact_sum([db.sum(dim=(0, 1)) for db in dy.chunk(blocks, dim=1)], group, total)
        else:
            d_b = _all_reduce(dy.sum(dim=(0, 1)), group, "sequence-parallel bias")
        return (dy if want_x else None), d_b, None, None, None


def add_bias(y: torch.Tensor, bias: torch.Tensor, blocks: int, group: Group | None, total: int) -> torch.Tensor:
    return _Bias.apply(y, bias, blocks, group, total)


class _VocabLoss(torch.autograd.Function):
    """Cross-entropy summed over tokens from vocabulary-parallel logits: no rank holds a whole row."""

    @staticmethod
    def forward(ctx, logits, targets, start: int, valid: int, blocks: int, group: Group | None, total: int):
        z = logits.float()
        cols = torch.arange(start, start + z.shape[-1], device=z.device)
        z = z.masked_fill(cols >= valid, float("-inf"))  # vocabulary padding: never a class
        peak = z.detach().max(dim=-1).values
        if group is not None and group.size > 1:  # max is exact in any order
            peaks = torch.empty(group.size * peak.numel(), dtype=peak.dtype, device=peak.device)
            group.all_gather(peaks, peak.reshape(-1).contiguous(), "tensor-parallel logit peak")
            peak = peaks.view(group.size, *peak.shape).max(dim=0).values
        e = torch.exp(z - peak[..., None])
        if blocks:
            sums = exact_sum([b.sum(-1) for b in e.chunk(blocks, dim=-1)], group, total)
        else:
            sums = _all_reduce(e.sum(-1), group, "tensor-parallel softmax sum")
        local = targets - start
        mine = (local >= 0) & (local < z.shape[-1])
        picked = torch.where(mine, z.gather(-1, local.clamp(0, z.shape[-1] - 1)[..., None])[..., 0], 0.0)
        picked = _all_reduce(picked, group, "tensor-parallel target logit")  # one rank's, the rest zero
        keep = targets != -100
        ctx.save_for_backward(e, sums, local, mine & keep, keep)
        ctx.dtype = logits.dtype
        return ((torch.log(sums) + peak - picked) * keep).sum()

    @staticmethod
    def backward(ctx, dloss):
        e, sums, local, mine, keep = ctx.saved_tensors
        grad = e / sums[..., None] * keep[..., None]
        rows = mine.nonzero(as_tuple=True)
        grad[rows + (local[rows],)] -= 1.0
        return (grad * dloss).to(ctx.dtype), None, None, None, None, None, None


def vocab_loss_sum(logits, targets, start: int, valid: int, blocks: int, group: Group | None, total: int):
    """The summed token loss of this rank's vocabulary columns [start, start + width) of the
    logits (``valid``: the real vocabulary; targets of -100 are not loss tokens)."""
    return _VocabLoss.apply(logits, targets, start, valid, blocks, group, total)
