"""What a tensor-parallel rank computes over the whole model, beyond its slice: the gradient norm
for clipping, the optimizer state's digest and each whole layer's digest.

A slice's chunks are chunks of shards, so the per-chunk sums a dp x pp job uses would depend on
the degree. Here every value is counted where it sits in the whole layer
(:meth:`~elaswave.model.llama_tp.TensorParallelLlama.positions`), once (a tensor every shard
holds whole counts on the first shard), padding never:

- the norm, in deterministic mode, is exact: a reduced gradient is a whole multiple of
  2**-bits (it was summed in that fixed point), so the sum of squares is an integer, summed in
  16-bit limbs in int64 and exchanged as integers; the same bits at every layout and degree;
- the state digest adds one 128-bit mix per value of (layer, whole position, master, exp_avg,
  exp_avg_sq) modulo 2**128, so any split of the values over ranks gives the same total;
- a layer's digest is the sha256 of the whole layer gathered from its shards, and an export
  writes the whole layers as the Llama family lays them out.
"""
from __future__ import annotations

import hashlib
import math
from typing import Sequence

import torch

from elaswave.comm.groups import Group
from elaswave.model.contract import untie
from elaswave.zero.flat import FlatLayer

_LIMB, _LIMBS = 16, 4
_DIGIT = 62
"""Exchanged integers travel as base-2**62 digits in int64 (one contributor per entry: exact)."""
_DIGITS = 6
_BLOCK = 1 << 17
"""Values squared at once (a few int64 or float64 copies of a block: a few MiB beside the step's
other transients; each limb product is below 2**32, so a block's sums stay in int64)."""
_POSITION_BITS = 40
"""A value's key is its layer << 40 | its place in the whole layer (layers below 2**40 values)."""


class TensorShards:
    """This rank's view of the whole model: its shards' ``keys`` (per bucket slot: layer << 40 |
    whole position, -1 where it does not count) and its tensor-parallel ``group``."""

    def __init__(self, model, layers: Sequence, buckets: Sequence, group: Group | None):
        self.model, self.group = model, group
        by_index = {l.index: l for l in layers}
        self.device = layers[0].flat.device if layers else torch.device("cpu")
        self.counted = [b.my_part(b.pack([model.positions(by_index[i]) >= 0 for i in b.layers], fill=False)).clone()
                        for b in buckets]

    def vote(self, flag: bool, count: int) -> tuple[bool, int]:
        """(whether ``flag`` holds on every shard of the group, the sum of ``count`` over them), in
        one exchange: the decisions the slices must share after a step (the store lost on every
        rank; how many ranks slice 0's leader admitted -- only slice 0's ranks count them)."""
        if self.group is None or self.group.size == 1:
            return flag, count
        vec = torch.tensor([1.0 if flag else 0.0, float(count)], dtype=torch.float64, device=self.device)
        self.group.all_reduce(vec, "tensor-parallel vote")
        return int(vec[0].item()) == self.group.size, int(vec[1].item())

    def norm(self, grads: Sequence[torch.Tensor], world: Group, exact_bits: int | None) -> float:
        """The global norm of the reduced gradients (this rank's slots of each bucket)."""
        if exact_bits is None:
            local = math.fsum(_blocks_sumsq(g, c) for g, c in zip(grads, self.counted))
            return math.sqrt(_sum_floats(_sum_floats(local, world, self.device), self.group, self.device))
        local = sum(_exact_sumsq(g, c, exact_bits) for g, c in zip(grads, self.counted))
        total = _sum_ints(_sum_ints(local, world, self.device), self.group, self.device)
        return math.sqrt(total) / 2.0 ** exact_bits

    def state_sum(self, optimizer, layers: Sequence) -> int:
        """This rank's part of the state digest: its owned values' mixes, summed modulo 2**128
        (a layer at a time, a block of values at a time: a few bytes a value beside the state)."""
        optimizer.settle()
        by_index = {l.index: l for l in layers}
        total = 0
        for b, state in zip(optimizer.buckets, optimizer.state):
            per_layer: dict[int, list] = {}
            for oc in b.owned:
                per_layer.setdefault(oc.layer, []).append(oc)
            for index, chunks in per_layer.items():
                keys = _keys(self.model, by_index[index]).cpu()
                slot = torch.cat([torch.arange(oc.slot_offset, oc.slot_offset + oc.numel) for oc in chunks])
                where = torch.cat([torch.arange(oc.chunk * b.chunk_numel, oc.chunk * b.chunk_numel + oc.numel)
                                   for oc in chunks])
                for i in range(0, slot.numel(), _BLOCK):
                    k = keys[where[i:i + _BLOCK]]
                    keep = k >= 0
                    values = state.detach()[:, slot[i:i + _BLOCK].to(state.device)][:, keep.to(state.device)]
                    total += _mixed_sum(k[keep].cpu(), values.cpu().contiguous().view(torch.int32).to(torch.int64))
        return total % (1 << 128)

    def each_whole(self, layers: Sequence):
        """(index, the layer's whole flat vector gathered from its shards), a layer at a time
        (every shard of the group calls this, for the same layers: its device's)."""
        for layer in layers:
            flat = layer.flat.detach()
            if self.group is not None and self.group.size > 1:
                parts = torch.empty(self.group.size * flat.numel(), dtype=flat.dtype, device=flat.device)
                self.group.all_gather(parts, flat.contiguous(), "whole-layer gather")
                parts = list(parts.view(self.group.size, -1))
            else:
                parts = [flat]
            yield layer.index, self.model.whole_flat(layer, parts)

    def replica_digests(self, layers: Sequence) -> dict[str, str]:
        """A digest of each tensor this rank's shard holds that other shards hold too (the model's
        :meth:`~elaswave.model.llama_tp.TensorParallelLlama.replicas`), keyed ``layer/tensor``: the
        whole layers' digests read one shard's copy, so the end-of-run check compares these across
        each device's shards (:func:`elaswave.zero.digest.shard_mismatches`). O(layers) a rank."""
        out = {}
        for layer in layers:
            for key, (offset, numel) in self.model.replicas(layer).items():
                out[f"{layer.index}/{key}"] = whole_digest(layer.flat.detach()[offset:offset + numel])
        return out

    def whole_layers(self, wholes: dict[int, torch.Tensor], indices) -> list[FlatLayer]:
        """Layers ``indices`` whole, as the Llama family lays them out (for an export)."""
        out = []
        for i in sorted(indices):
            module = self.model.whole_module(i)
            untie(self.model, module, i)
            layer = FlatLayer(module, i)
            layer.flat.copy_(wholes[i])
            out.append(layer)
        return out


def whole_digest(flat: torch.Tensor) -> str:
    """A whole layer's (or tensor's) sha256: its float values' bytes, as FlatLayer.digest hashes them."""
    flat = flat.cpu().contiguous()
    if flat.dtype == torch.bfloat16:  # numpy has no bfloat16; the bytes are the same
        flat = flat.view(torch.int16)
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def state_total(sums: Sequence[int]) -> int:
    """The job's state digest total from every rank's :meth:`TensorShards.state_sum`."""
    return sum(sums) % (1 << 128)


def _keys(model, layer) -> torch.Tensor:
    pos = model.positions(layer)
    return torch.where(pos >= 0, pos + (layer.index << _POSITION_BITS), pos)


def _blocks_sumsq(g: torch.Tensor, counted: torch.Tensor) -> float:
    return math.fsum(float(torch.where(counted[i:i + _BLOCK], g[i:i + _BLOCK].double(), 0.0).pow(2).sum())
                     for i in range(0, g.numel(), _BLOCK))


def _exact_sumsq(g: torch.Tensor, counted: torch.Tensor, bits: int) -> int:
    """sum((g * 2**bits)**2) over the counted values, as an exact integer."""
    total = 0
    for i in range(0, g.numel(), _BLOCK):
        j = torch.where(counted[i:i + _BLOCK], g[i:i + _BLOCK].double() * 2.0 ** bits, 0.0).abs().to(torch.int64)
        limbs = [(j >> (_LIMB * k)) & ((1 << _LIMB) - 1) for k in range(_LIMBS)]
        for a in range(_LIMBS):
            for b in range(a, _LIMBS):
                s = int((limbs[a] * limbs[b]).sum())
                total += (s if a == b else 2 * s) << (_LIMB * (a + b))
    return total


def _sum_ints(value: int, group: Group | None, device: torch.device) -> int:
    """The sum over ``group`` of every member's non-negative integer, exactly (below 2**372:
    squares of at most 2**62 a value, for fewer than 2**248 values)."""
    if group is None or group.size == 1:
        return value
    vec = torch.zeros(group.size, _DIGITS, dtype=torch.int64)
    for k in range(_DIGITS):
        vec[group.group_rank, k] = (value >> (_DIGIT * k)) & ((1 << _DIGIT) - 1)
    vec = vec.to(device)
    group.all_reduce(vec, "exact norm exchange")
    return sum(int(d) << (_DIGIT * k) for row in vec.tolist() for k, d in enumerate(row))


def _sum_floats(value: float, group: Group | None, device: torch.device) -> float:
    if group is None or group.size == 1:
        return value
    vec = torch.zeros(group.size, dtype=torch.float64)
    vec[group.group_rank] = value
    vec = vec.to(device)
    group.all_reduce(vec, "norm exchange")
    return math.fsum(vec.tolist())


_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping products; shifts made logical by masks)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _M1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _M2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def _mixed_sum(keys: torch.Tensor, bits: torch.Tensor) -> int:
    """Sum over values of two 64-bit mixes of (key, its three float32 words), the second lane
    shifted by 64 bits: taken modulo 2**128 by the caller, after any sum over ranks."""
    total = 0
    for lane in range(2):
        h = _mix(keys ^ (lane + 1))
        for row in bits:
            h = _mix(h ^ row)
        lo, hi = int((h & 0xFFFFFFFF).sum()), int(((h >> 32) & 0xFFFFFFFF).sum())
        total += (lo + (hi << 32)) << (64 * lane)  # no lane wraps alone: a sum of parts is the whole's
    return total
