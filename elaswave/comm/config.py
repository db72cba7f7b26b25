"""The job's layout and communication settings (``parallel.*``): how many pipelines, stages and
tensor-parallel shards, which backend, and the bounds on every wait."""
from __future__ import annotations

from dataclasses import dataclass

from elaswave.errors import fail as _fail

BACKENDS = ("auto", "gloo", "nccl")
SCHEDULES = ("1f1b", "zb-h1", "interleaved")


@dataclass
class ParallelConfig:
    dp: int = 2
    """Pipelines (data-parallel replicas)."""
    pp: int = 2
    """Stages per pipeline."""
    tp: int = 1
    """Tensor-parallel degree (model.arch=llama; 1, 2, 4 or 8): each stage's layers cut across this
    many ranks, laid out dp x pp x tp, tp innermost (elaswave/tensor/layout.py)."""
    ep: int = 1
    """Expert parallelism (a mixture of experts): each MoE block's experts spread over this many
    pipelines' ranks of a stage, tokens exchanged by all-to-all (elaswave/expert/exchange.py); must
    divide parallel.dp and model.num_experts. The parameters stay on every data-parallel rank."""
    schedule: str = "1f1b"
    """The pipeline schedule: 1f1b; zb-h1 (zero bubble: each backward split into the input's
    gradient, sent on at once, and the weights', run later where 1F1B would wait; the same bits,
    elaswave/pipeline/zero_bubble.py); or interleaved (Megatron's interleaved 1F1B over
    ``virtual_stages`` model chunks a rank). A plan with detours (the reroute baseline) runs its own."""
    virtual_stages: int = 1
    """Model chunks a rank holds under parallel.schedule=interleaved (Megatron's V, >= 2): rank s of a
    pipeline of p holds virtual stages s, s + p, ..., and the bubble is 1/V of 1F1B's."""
    sequence_parallel: bool = False
    """With parallel.tp > 1: Megatron's sequence parallelism -- the residual stream, the norms and
    what a stage sends are each rank's 1/tp of the sequence, gathered and reduce-scattered around the
    cut products instead of all-reduced (the same bits in deterministic mode; model.seq_len a
    multiple of 8)."""
    overlap_grad_reduce: bool = True
    """Start each gradient bucket's sum over its holder group as soon as this rank's schedule has
    made it whole -- within the backward (or ZB-H1's W) that does, as it passes the bucket's layers
    -- while the rest computes (Megatron's name; integer sums in deterministic mode, so the same
    bits). false: every sum starts when the rank's schedule ends (zero/reduce.py, zero/watch.py)."""
    overlap_param_gather: bool = True
    """Start the parameter all-gathers that follow ZeRO-1's update at the step's end and wait for
    each bucket's only before the next step's first forward of a chunk that reads it (Megatron's
    name), so they overlap that step's first forwards -- under interleaved 1F1B every chunk's but
    the first. false: every all-gather is waited for before the step ends."""
    bucket_numel: int = 40_000_000
    """Most values in one gradient bucket (Megatron's bucket size): a holder group's layers are cut
    into buckets at model chunks and at this size (never within a layer), each bucket summed and
    all-gathered on its own, so a forward waits only for its own layer's all-gather. 0: cut at
    model chunks only."""
    backend: str = "auto"
    """auto: nccl when CUDA is available, else gloo."""
    chunk_numel: int = 4096
    """ZeRO-1 chunk size in elements; chunk c of a layer is owned by holder c mod n."""
    timeout_s: float = 120.0
    """Bound on every collective and p2p wait."""
    stage_memory_mb: str = "auto"
    """Most memory (MiB) one rank may hold at its peak in a step, as elaswave/plan/memory.py models
    it (layers, gradients, optimizer share, snapshots, activations in flight under 1F1B); every
    partition -- at the start, after a loss, at a join -- keeps within it or says why none can,
    naming the least that would do. ``auto``: the smallest GPU's memory in the job less
    ``memory_reserve_mb``, agreed through the store at the start and carried in the plan (a joiner
    takes the job's); CPU ranks have no device memory of their own, so ``auto`` plans without a
    limit there. ``off`` (or 0): no limit. A number: that many MiB."""
    memory_reserve_mb: float = 8192.0
    """Under ``stage_memory_mb=auto``: what each GPU keeps outside the plan -- the CUDA context,
    NCCL's buffers, the allocator's fragmentation (an assumption, as the simulator's --reserve-gib)."""
    bind_address: str = ""
    """The address gloo's transfers bind to. Empty: loopback under `elaswave run` (one host), the
    host's own name under torchrun (GLOO_SOCKET_IFNAME picks an interface there)."""

    @property
    def stage_memory_limit_mb(self) -> float | None:
        """The configured limit: MiB, 0.0 for none, None for ``auto`` (agreed by the ranks at the start)."""
        text = str(self.stage_memory_mb).strip().lower()
        if text == "auto":
            return None
        if text == "off":
            return 0.0
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not value >= 0 or value == float("inf"):
            _fail("parallel.stage_memory_mb", self.stage_memory_mb,
                  "must be auto (the smallest GPU's memory less parallel.memory_reserve_mb), off (or 0: no limit), "
                  "or a number of MiB > 0")
        return value

    def check_experts(self, num_experts: int) -> None:
        """The settings a mixture of experts (``num_experts`` > 0; 0: a dense model) needs."""
        if self.ep > 1 and not num_experts:
            _fail("parallel.ep", self.ep, "needs a mixture of experts (model.num_experts > 0, model.arch=llama); "
                  "use parallel.ep=1")
        if self.ep > 1 and (self.dp % self.ep or num_experts % self.ep):
            _fail("parallel.ep", self.ep, f"must divide parallel.dp={self.dp} and model.num_experts={num_experts}")
        if num_experts and self.tp > 1:
            _fail("model.num_experts", num_experts, f"a mixture of experts on tensor-parallel shards is not built yet "
                  f"(parallel.tp={self.tp}); use parallel.tp=1")

    def validate(self) -> None:
        for name in ("dp", "pp", "tp", "ep"):
            if getattr(self, name) < 1:
                _fail(f"parallel.{name}", getattr(self, name), "must be >= 1")
        if self.schedule not in SCHEDULES:
            _fail("parallel.schedule", self.schedule, f"must be one of {', '.join(SCHEDULES)}")
        if self.schedule == "interleaved" and self.virtual_stages < 2:
            _fail("parallel.virtual_stages", self.virtual_stages, "must be >= 2 with parallel.schedule=interleaved "
                  "(1 is parallel.schedule=1f1b)")
        if self.schedule != "interleaved" and self.virtual_stages != 1:
            _fail("parallel.virtual_stages", self.virtual_stages, f"must be 1 with parallel.schedule={self.schedule}; "
                  "model chunks are interleaved only by parallel.schedule=interleaved")
        if self.sequence_parallel and self.tp == 1:
            _fail("parallel.sequence_parallel", self.sequence_parallel, "needs parallel.tp > 1: it cuts the sequence "
                  "across a tensor-parallel group")
        if self.backend not in BACKENDS:
            _fail("parallel.backend", self.backend, f"must be one of {', '.join(BACKENDS)}")
        if self.bucket_numel < 0:
            _fail("parallel.bucket_numel", self.bucket_numel, "must be >= 0 (0: one bucket a holder group's model chunk)")
        if self.chunk_numel < 64:
            _fail("parallel.chunk_numel", self.chunk_numel, "must be >= 64")
        if self.timeout_s <= 0:
            _fail("parallel.timeout_s", self.timeout_s, "must be > 0")
        _ = self.stage_memory_limit_mb  # says what is wrong with a bad value
        if self.memory_reserve_mb < 0:
            _fail("parallel.memory_reserve_mb", self.memory_reserve_mb, "must be >= 0")
