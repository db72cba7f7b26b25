"""Digests of the whole training state, and the end-of-run check that every replica agrees.

``params_sha256`` covers one copy of the parameters. Two runs can agree on it and still differ: in an
Adam moment (the next update would differ), in a step counter (the bias correction would), or in a
second holder's copy of a layer that the first holder never sees. So at the end of a run:

- ``state_sha256`` covers the step counter and every chunk's float32 master, exp_avg and exp_avg_sq
  (valid elements, not padding). Each chunk is hashed with its (layer, chunk) key and the hashes
  are *added* modulo 2**256, so each owner posts one number for all its chunks and the total is
  the same for any layout and for the single-process reference, which owns every chunk;
- every holder of a layer posts one digest of its copy, and all holders' must be equal; each chunk
  owner (itself a holder) checks that its copy equals its master, so every copy equals the master.
  A mismatch fails the run (:class:`StateMismatch`);
- with tensor parallelism, the holders compared are those of one shard, and the whole layer's
  digest reads a tensor every shard holds (a norm, a replicated key-value head, a row-parallel
  bias) from one shard only: so each rank also posts a digest of each such tensor it holds, and
  every shard of a device must hold the same (:func:`shard_mismatches`).

What travels is O(ranks x layers held), never O(chunks): a 70B model has millions of chunks.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Iterable, Mapping

import torch

MODULUS = 1 << 256


class StateMismatch(RuntimeError):
    """Two copies of the same state differ at the end of a run."""


def owned_state_sum(optimizer) -> int:
    """Sum mod 2**256 of sha256(layer, chunk, [master, exp_avg, exp_avg_sq]) over the chunks owned
    here (the state is float32 whatever the layers compute in)."""
    optimizer.settle()
    total = 0
    for b, s in zip(optimizer.buckets, optimizer.state):
        for oc in b.owned:
            h = hashlib.sha256(f"{oc.layer}/{oc.chunk}:".encode())
            h.update(s[:, oc.slot_offset:oc.slot_offset + oc.numel].detach().cpu().contiguous().numpy().tobytes())
            total = (total + int.from_bytes(h.digest(), "big")) % MODULUS
    return total


def state_sha256(step_counter: int, state_sums: Iterable[int]) -> str:
    """The job's optimizer state: its step counter and the sum of every owner's :func:`owned_state_sum`."""
    total = sum(state_sums) % MODULUS
    return hashlib.sha256(f"step_counter={step_counter}:{total:064x}".encode()).hexdigest()


def masters_mismatches(optimizer, layers: Iterable, rank: int) -> list[str]:
    """On one rank: every chunk it owns against its own copy of that chunk's parameters (which the
    all-gather filled from the master; at the end both are float32)."""
    optimizer.settle()
    by_index = {l.index: l for l in layers}
    problems = []
    for b, s in zip(optimizer.buckets, optimizer.state):
        for oc in b.owned:
            flat = by_index[oc.layer].flat
            start = oc.chunk * b.chunk_numel
            copy = flat[start:start + oc.numel]
            master = s[0, oc.slot_offset:oc.slot_offset + oc.numel]
            if copy.dtype != master.dtype or not torch.equal(copy, master):
                problems.append(f"layer {oc.layer} chunk {oc.chunk}: rank {rank}'s parameters differ from its own master")
    return problems


def layer_digests(layers: Iterable) -> dict[str, str]:
    """This copy of each layer held here: layer index -> sha256 of its parameters (hex)."""
    return {str(l.index): l.digest().hex() for l in layers}


def replica_mismatches(held: Mapping[int, Mapping[str, str]]) -> list[str]:
    """``held[rank]``: its :func:`layer_digests`. One line per layer whose holders disagree."""
    by_layer: dict[str, dict[str, list[int]]] = {}
    for rank, digests in held.items():
        for layer, d in digests.items():
            by_layer.setdefault(layer, {}).setdefault(d, []).append(rank)
    return [f"layer {layer}: its holders disagree: " + "; ".join(f"ranks {rs} hold {d[:12]}" for d, rs in copies.items())
            for layer, copies in sorted(by_layer.items(), key=lambda kv: int(kv[0])) if len(copies) > 1]


def shard_mismatches(held: Mapping[int, Mapping[str, str]], device_of: Callable[[int], int],
                     shard_of: Callable[[int], int]) -> list[str]:
    """``held[rank]``: its digests of the tensors other shards hold too (``layer/tensor`` -> hex,
    :meth:`~elaswave.tensor.shards.TensorShards.replica_digests`). One line per tensor of a device
    (named by ``device_of``, its shard 0's rank) whose shards disagree."""
    by_tensor: dict[tuple[int, str], dict[str, list[int]]] = {}
    for rank, digests in held.items():
        for key, d in digests.items():
            by_tensor.setdefault((device_of(rank), key), {}).setdefault(d, []).append(rank)
    out = []
    for (device, key), copies in sorted(by_tensor.items(), key=lambda kv: (int(kv[0][1].split("/")[0]), kv[0])):
        if len(copies) > 1:
            layer, _, tensor = key.partition("/")
            out.append(f"layer {layer} {tensor}: the tensor-parallel shards of device {device} disagree: " + "; ".join(
                f"shards {[shard_of(r) for r in sorted(rs)]} (ranks {sorted(rs)}) hold {d[:12]}" for d, rs in copies.items()))
    return out


def check_replicas(parts: Mapping[int, dict], device_of: Callable[[int], int], shard_of: Callable[[int], int]) -> None:
    """Every copy of the state equals its owner's (the copies of one shard of a layer compared
    across its holders), every tensor a device's shards each hold is the same on each, and every
    owner is at the same step: else the run fails here, naming each difference."""
    problems = [p for doc in parts.values() for p in doc["master_problems"]]
    for shard in sorted({shard_of(r) for r in parts}):
        problems += replica_mismatches({r: doc["layer_copies"] for r, doc in parts.items() if shard_of(r) == shard})
    problems += shard_mismatches({r: doc["shard_replicas"] for r, doc in parts.items() if doc.get("shard_replicas")},
                                 device_of, shard_of)
    counters = {r: doc["step_counter"] for r, doc in parts.items()}
    if len(set(counters.values())) > 1:
        problems.append(f"the ranks' optimizer step counters differ: {counters}")
    if problems:
        raise StateMismatch("the replicas of the training state differ at the end of the run: " + " | ".join(problems))
