"""ZeRO-1 AdamW over owned chunks, with the learning-rate schedule and global-norm clipping.

The same functions run in the single-process reference (one holder owns every chunk) and in the
workers (each holder owns chunk c with c mod n == its slot), on the same chunk-padded layout: the
element-wise update gives the same bits in both.
"""
from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

import torch

from elaswave.config import TrainConfig
from elaswave.plan.chunks import ChunkIndex, ChunkKey
from elaswave.zero.bucket import Bucket
from elaswave.zero.flat import FlatLayer


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr`` at the last step (step counts from 0)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def clip_coef(chunk_sumsq: Sequence[float], max_norm: float) -> tuple[float, float]:
    """(global norm, factor); the norm sums per-chunk squares in chunk order, exactly (fsum)."""
    return clip_of_norm(math.sqrt(math.fsum(chunk_sumsq)), max_norm)


def clip_of_norm(norm: float, max_norm: float) -> tuple[float, float]:
    """(``norm``, the factor that clips a gradient of that norm to ``max_norm``)."""
    if max_norm <= 0 or not math.isfinite(norm):
        return norm, 1.0
    return norm, min(1.0, max_norm / (norm + 1e-6))


NORM_BLOCK = 1 << 18
"""Values of a slot squared in float64 at once by the fast-mode norm (4 MiB of float64)."""


class ShardedAdamW:
    """Owns, per bucket, this rank's slot as one float32 ``[3, slot_numel]`` tensor: master parameter
    shard, exp_avg, exp_avg_sq. It keeps two *generations* -- the state at the start of step ``gen`` and of the step
    before -- so a step that must be redone after a failure can always be redone from here."""

    def __init__(self, buckets: Sequence[Bucket], layers: Sequence[FlatLayer], cfg: TrainConfig,
                 gen: int = 0, chunks: Mapping[ChunkKey, torch.Tensor] | None = None):
        """Parameters come from ``layers`` (moments zero) unless ``chunks`` gives a chunk's
        ``[3, chunk_numel]`` state (a recovery)."""
        self.cfg = cfg
        self.buckets = list(buckets)
        self.gen = gen
        by_index = {l.index: l for l in layers}
        self.state, self.decay = [], []
        for b in self.buckets:
            flats = [by_index[i].flat for i in b.layers]
            # Float32 whatever the layers compute in: these are the master weights (train.precision).
            state = torch.zeros(3, b.slot_numel, dtype=torch.float32, device=flats[0].device)
            state[0] = b.my_part(b.pack([f.detach() for f in flats]))
            for oc in b.owned:
                if chunks is not None and (oc.layer, oc.chunk) in chunks:
                    state[:, oc.slot_offset:oc.slot_offset + b.chunk_numel] = chunks[(oc.layer, oc.chunk)]
            self.state.append(state)
            # Which values of the slot decay, from each layer's rule per tensor (padding: none), as
            # runs (start, end): a few per tensor the slot holds, not a byte per value.
            masks = [by_index[i].decay_of(0, by_index[i].numel) for i in b.layers]
            self.decay.append(_runs(b.my_part(b.pack(masks, fill=False))))
        # The generation before is read only by a recovery: on a GPU it waits in pinned host
        # memory (copied there on the compute stream, which the update then follows).
        on_gpu = bool(self.state) and self.state[0].device.type == "cuda"
        self.prev = [torch.empty(s.shape, dtype=s.dtype, pin_memory=True) if on_gpu else torch.empty_like(s)
                     for s in self.state]
        self._prev_copied = None
        self.prev_gen: int | None = None
        self._arriving: list[tuple[Callable[[], None], list[ChunkKey], torch.Tensor]] = []

    # -- moments still on their way (a recovery's non-blocking migration) ----------------------
    def moments_arriving(self, wait: Callable[[], None], keys: list[ChunkKey], buf: torch.Tensor) -> None:
        """``buf`` (``[len(keys), 2, chunk_numel]``) will hold these chunks' Adam moments once
        ``wait()`` returns: nothing but the update needs them, so they travel during the forwards."""
        self._arriving.append((wait, list(keys), buf))

    def settle(self) -> None:
        """Wait for moments still arriving and put them in place (before anything reads them)."""
        arriving, self._arriving = self._arriving, []
        for wait, keys, buf in arriving:
            wait()
            for key, part in zip(keys, buf):
                b, oc = self._slot_of(key)
                self.state[b][1:, oc.slot_offset:oc.slot_offset + self.buckets[b].chunk_numel] = part

    def _slot_of(self, key: ChunkKey):
        for i, b in enumerate(self.buckets):
            for oc in b.owned:
                if (oc.layer, oc.chunk) == key:
                    return i, oc
        raise KeyError(f"chunk {key} is not owned here")

    @property
    def params(self) -> list[torch.Tensor]:
        return [s[0] for s in self.state]

    @property
    def exp_avg(self) -> list[torch.Tensor]:
        return [s[1] for s in self.state]

    @property
    def exp_avg_sq(self) -> list[torch.Tensor]:
        return [s[2] for s in self.state]

    def chunk_sumsq(self, grads: Sequence[torch.Tensor], index: ChunkIndex, owned_only: bool,
                    exact_layout: bool = True) -> dict[int, float]:
        """Sum of squares per chunk, keyed by global chunk number: of every chunk in ``grads`` (whole
        buckets or slots), or only of the chunks this rank owns. With ``exact_layout`` (deterministic
        mode) each is one dot over the same chunk-padded slice whoever computes it, so the bits
        agree in every layout; without it (fast mode) each slot's chunks are summed as the rows of
        one matrix: a kernel per slot instead of per chunk."""
        keys, sums = [], []
        if not exact_layout:
            for b, g in zip(self.buckets, grads):
                whole = g.numel() > b.slot_numel
                for slot in (range(b.num_holders) if whole else [b.my_slot]):
                    owned = b.owned_by(slot)
                    if (owned_only and slot != b.my_slot) or not owned:
                        continue
                    base = slot * b.slot_numel if whole else 0
                    rows = g[base:base + len(owned) * b.chunk_numel].view(len(owned), b.chunk_numel)
                    keys.extend(index.offsets[oc.layer] + oc.chunk for oc in owned)
                    # In float64 a block of rows at a time: the slot's float64 square is not
                    # allocated whole (16 bytes a value, more than the step's other transients).
                    step = max(1, NORM_BLOCK // b.chunk_numel)
                    sums.extend(rows[i:i + step].double().pow(2).sum(dim=1) for i in range(0, len(owned), step))
            return dict(zip(keys, torch.cat(sums).tolist())) if sums else {}
        for b, g in zip(self.buckets, grads):
            whole = g.numel() > b.slot_numel
            for slot in (range(b.num_holders) if whole else [b.my_slot]):
                if owned_only and slot != b.my_slot:
                    continue
                base = slot * b.slot_numel if whole else 0
                for oc in b.owned_by(slot):
                    piece = g[base + oc.slot_offset:base + oc.slot_offset + b.chunk_numel].double()
                    keys.append(index.offsets[oc.layer] + oc.chunk)
                    sums.append(torch.dot(piece, piece))
        # One dot per chunk (the same kernel on the same shape in every layout), read back once: a
        # read per chunk waited for the GPU thousands of times a step (bench/gpu/checklist.py).
        return dict(zip(keys, torch.stack(sums).tolist())) if sums else {}

    def step(self, grads: Sequence[torch.Tensor], step: int, lr: float, coef: float) -> None:
        self.settle()
        if step != self.gen:
            raise RuntimeError(f"optimizer state is at step {self.gen}, cannot apply step {step}")
        for prev, state in zip(self.prev, self.state):
            prev.copy_(state, non_blocking=True)
        if self.state and self.state[0].device.type == "cuda":
            self._prev_copied = torch.cuda.Event()
            self._prev_copied.record()
        self.prev_gen = self.gen
        c = self.cfg
        t = step + 1
        bc1, bc2 = 1.0 - c.beta1 ** t, 1.0 - c.beta2 ** t
        for p, g, m, v, decay in zip(self.params, grads, self.exp_avg, self.exp_avg_sq, self.decay):
            if coef != 1.0:
                g.mul_(coef)  # in place: the reduced gradient is the step's own, read no more
            decay_runs(p, decay, -lr * c.weight_decay)
            m.mul_(c.beta1).add_(g, alpha=1.0 - c.beta1)
            v.mul_(c.beta2).addcmul_(g, g, value=1.0 - c.beta2)
            denom = (v.sqrt() / math.sqrt(bc2)).add_(c.eps)
            p.addcdiv_(m, denom, value=-lr / bc1)
        self.gen = step + 1

    # -- generations, for snapshots and recovery ---------------------------------------------
    def keys(self) -> list[ChunkKey]:
        return [(oc.layer, oc.chunk) for b in self.buckets for oc in b.owned]

    def holding(self) -> dict[int, list[ChunkKey]]:
        """Generations of whole chunks here: not those whose moments are still arriving (their
        sender may be the rank that just died; the chunk's other copies are the source then)."""
        gens = [self.gen] + ([self.prev_gen] if self.prev_gen is not None else [])
        missing = {k for _, keys, _ in self._arriving for k in keys}
        return {g: [k for k in self.keys() if k not in missing] for g in gens}

    def chunk(self, key: ChunkKey, gen: int) -> torch.Tensor:
        """A ``[3, chunk_numel]`` copy of one owned chunk's state at generation ``gen``."""
        if any(key in keys for _, keys, _ in self._arriving):
            self.settle()
        source = self.state if gen == self.gen else self.prev if gen == self.prev_gen else None
        if source is None:
            raise KeyError(f"generation {gen} of chunk {key} is not here (have {self.gen}, {self.prev_gen})")
        if source is self.prev and self._prev_copied is not None:
            self._prev_copied.synchronize()
        for b, s, here in zip(self.buckets, source, self.state):
            for oc in b.owned:
                if (oc.layer, oc.chunk) == key:
                    return s[:, oc.slot_offset:oc.slot_offset + b.chunk_numel].to(here.device, copy=True)
        raise KeyError(f"chunk {key} is not owned here")

    def snapshot_slots(self) -> list[tuple[list[ChunkKey], torch.Tensor]]:
        """Per bucket, the chunks owned in slot order and the ``[3, slot_numel]`` state itself: what
        a snapshot sends (no copy: the state is next written by the update, after the sends)."""
        self.settle()
        return [([(oc.layer, oc.chunk) for oc in b.owned], s) for b, s in zip(self.buckets, self.state)]

    def payload(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every owned chunk's current state, ``[num_owned, 3, chunk_numel]`` in :meth:`keys` order
        (written into ``out`` when given)."""
        self.settle()
        parts = [s[:, oc.slot_offset:oc.slot_offset + b.chunk_numel]
                 for b, s in zip(self.buckets, self.state) for oc in b.owned]
        if not parts:
            return out if out is not None else torch.zeros(0, 3, self.buckets[0].chunk_numel if self.buckets else 1)
        return torch.stack(parts, out=out) if out is not None else torch.stack(parts)

    def state_bytes(self) -> int:
        """Optimizer-state bytes this rank holds (exp_avg + exp_avg_sq, padding included)."""
        return sum(m.numel() * m.element_size() + v.numel() * v.element_size()
                   for m, v in zip(self.exp_avg, self.exp_avg_sq))

    def master_bytes(self) -> int:
        """Bytes of this rank's float32 master parameter shard (padding included)."""
        return sum(p.numel() * p.element_size() for p in self.params)


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """The (start, end) runs of True in a 1-D bool ``mask``."""
    edges = torch.diff(mask.to(torch.int8), prepend=mask.new_zeros(1, dtype=torch.int8),
                       append=mask.new_zeros(1, dtype=torch.int8)).nonzero().flatten().tolist()
    return list(zip(edges[0::2], edges[1::2]))


def decay_runs(p: torch.Tensor, runs: Sequence[tuple[int, int]], factor: float) -> None:
    """``p += factor * p`` on each run. A product rounded on its own, then a sum: nothing a compiler
    could fuse into one rounding in some loops (a run's vector body) and not in others (its tail),
    which would make a value's bits depend on where a layout put the run's ends."""
    for lo, hi in runs:
        run = p[lo:hi]
        run.add_(run * factor)
