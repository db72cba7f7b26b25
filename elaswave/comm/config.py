"""The job's layout and communication settings (``parallel.*``): how many pipelines, stages and
tensor-parallel shards, which backend, and the bounds on every wait."""
from __future__ import annotations

from dataclasses import dataclass

from elaswave.errors import fail as _fail

BACKENDS = ("auto", "gloo", "nccl")


@dataclass
class ParallelConfig:
    dp: int = 2
    """Pipelines (data-parallel replicas)."""
    pp: int = 2
    """Stages per pipeline."""
    tp: int = 1
    """Tensor-parallel degree (model.arch=llama; 1, 2, 4 or 8): each stage's layers cut across this
    many ranks, laid out dp x pp x tp, tp innermost (elaswave/tensor/layout.py)."""
    backend: str = "auto"
    """auto: nccl when CUDA is available, else gloo."""
    chunk_numel: int = 4096
    """ZeRO-1 chunk size in elements; chunk c of a layer is owned by holder c mod n."""
    timeout_s: float = 120.0
    """Bound on every collective and p2p wait."""
    stage_memory_mb: float = 0.0
    """Most memory (MiB) one rank may hold at its peak in a step, as elaswave/plan/memory.py models
    it (layers, gradients, optimizer share, snapshots, activations in flight under 1F1B); every
    partition -- at the start, after a loss, at a join -- keeps within it or says why none can,
    naming the least that would do. 0: no limit."""
    bind_address: str = ""
    """The address gloo's transfers bind to. Empty: loopback under `elaswave run` (one host), the
    host's own name under torchrun (GLOO_SOCKET_IFNAME picks an interface there)."""

    def validate(self) -> None:
        for name in ("dp", "pp", "tp"):
            if getattr(self, name) < 1:
                _fail(f"parallel.{name}", getattr(self, name), "must be >= 1")
        if self.backend not in BACKENDS:
            _fail("parallel.backend", self.backend, f"must be one of {', '.join(BACKENDS)}")
        if self.chunk_numel < 64:
            _fail("parallel.chunk_numel", self.chunk_numel, "must be >= 64")
        if self.timeout_s <= 0:
            _fail("parallel.timeout_s", self.timeout_s, "must be > 0")
        if self.stage_memory_mb < 0:
            _fail("parallel.stage_memory_mb", self.stage_memory_mb, "must be >= 0 (0: no limit)")
