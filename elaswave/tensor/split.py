"""Where a Llama layer's tensors are cut across a tensor-parallel group (pure: no process groups).

Megatron's split: attention by heads and the SwiGLU MLP by its hidden width, column-parallel in
(q/k/v, gate/up: a rank holds a block of output rows) and row-parallel out (o, down: the matching
block of input columns), the embedding and the head by vocabulary rows; norms (and a row-parallel
layer's bias) are whole on every rank.

Deterministic mode computes every cut product as *canonical blocks* that do not depend on the
degree: one block per attention head, :data:`BLOCKS` blocks of the MLP's hidden width and of the
(padded) vocabulary. A rank holds whole blocks, so any degree dividing the blocks runs the same
block products on the same shapes, and sums across blocks are exact (:mod:`elaswave.tensor.ops`).
"""
from __future__ import annotations

from dataclasses import dataclass

from elaswave.errors import ConfigError, fail
from elaswave.model.config import ModelConfig

BLOCKS = 8
"""Canonical blocks of the MLP's hidden width and of the vocabulary: the largest degree is 8 (a node)."""


class SplitError(ConfigError):
    """A model that this tensor-parallel degree cannot cut; one line saying why and what would do."""


@dataclass(frozen=True)
class TensorSplit:
    degree: int
    rank: int
    """This rank's place in its tensor-parallel group, 0..degree-1."""

    def block(self, total: int) -> tuple[int, int]:
        """[start, end) of this rank's share of ``total`` units (``degree`` divides ``total``)."""
        share = total // self.degree
        return self.rank * share, (self.rank + 1) * share

    def kv_block(self, kv_heads: int) -> tuple[int, int]:
        """[first, end) of the key-value heads this rank holds: its share, or -- with fewer heads
        than ranks -- the one head its query heads attend to, replicated on :meth:`kv_replicas` ranks."""
        if kv_heads >= self.degree:
            return self.block(kv_heads)
        head = self.rank // self.kv_replicas(kv_heads)
        return head, head + 1

    def kv_replicas(self, kv_heads: int) -> int:
        """How many ranks hold each key-value head (1 unless there are fewer heads than ranks)."""
        return max(1, self.degree // kv_heads)

    def counts_kv(self, kv_heads: int) -> bool:
        """Whether this rank is the first of its key-value head's holders: the one whose copy counts
        (in the input's gradient, the norm, digests and exports) -- the others hold the same values."""
        return self.rank % self.kv_replicas(kv_heads) == 0


def padded_vocab(vocab_size: int) -> int:
    """The vocabulary rounded up to whole canonical blocks: rows past ``vocab_size`` are padding
    that no token looks up and no loss, gradient, digest or export sees."""
    return -(-vocab_size // BLOCKS) * BLOCKS


def check(m: ModelConfig, degree: int, where: str = "") -> None:
    """One :class:`SplitError` if ``m`` cannot be cut ``degree`` ways (``where``: the setting named
    in the message)."""
    where = where or f"a tensor-parallel degree of {degree}"
    if degree < 1 or BLOCKS % degree:
        raise SplitError(f"{where} is invalid: the degree must divide {BLOCKS} (1, 2, 4 or 8: the GPUs of a node)")
    if m.arch != "llama" or m.factory:
        raise SplitError(f"{where} is invalid for model {m.factory or m.arch}: tensor parallelism needs a split of "
                         "each layer's tensors, which the Llama family has (model.arch=llama); a model.factory "
                         "model would need to declare one")
    if m.num_heads % degree:
        raise SplitError(f"{where} is invalid: it must divide the attention heads ({m.num_heads})")
    if m.kv_heads % degree and degree % m.kv_heads:
        raise SplitError(f"{where} is invalid: it must divide the key-value heads ({m.kv_heads}) or be a multiple "
                         "of them (fewer key-value heads than ranks are replicated, each on degree / heads ranks)")
    if m.ffn_width % BLOCKS:
        raise SplitError(f"{where} is invalid: the MLP width {m.ffn_width} must be a multiple of {BLOCKS}")


def check_job(job) -> None:
    """What a tensor-parallel job (a JobConfig with parallel.tp > 1) needs, and what is not built
    for one yet: one line each."""
    tp = job.parallel.tp
    check(job.model, tp, where=f"parallel.tp={tp!r}")
    if job.parallel.sequence_parallel and job.model.seq_len % BLOCKS:
        fail("parallel.sequence_parallel", True, f"needs model.seq_len a multiple of {BLOCKS} (the canonical blocks of "
                                                 f"the sequence that keep the bits at every degree), not "
                                                 f"{job.model.seq_len}")
    elastic = job.elastic
    if job.emulate.enabled:
        fail("emulate.enabled", True, f"with parallel.tp={tp}: emulated compute prices whole layers, not "
                                      "tensor-parallel shards (parallel.tp=1 has it)")
    # The job grows by whole devices: joins asked for must make them.
    for fault in elastic.faults if elastic.enabled else ():
        if fault.kind == "join" and fault.count % tp:
            fail("elastic.inject", ";".join(elastic.inject),
                 f"join:step={fault.step},count={fault.count} must add whole devices with parallel.tp={tp}: "
                 f"a count that is a multiple of {tp}")
    devices = job.parallel.dp * job.parallel.pp
    if elastic.enabled and elastic.snapshots and elastic.snapshot_copies > max(1, devices - 1):
        fail("elastic.snapshot_copies", elastic.snapshot_copies,
             f"must be <= {max(1, devices - 1)} with parallel.tp={tp}: a rank's snapshot is kept by ranks of "
             f"its own shard index, {devices} of them")
