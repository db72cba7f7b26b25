"""The memory model: the bytes a rank holds at its peak in a step, by part (pure; no process groups).

What a rank holds, and why each term has the size it has:

- *layers*: every layer it holds (its stage's range and tie owners) as one flat vector in the
  compute dtype, its gradient sum (deterministic mode: int64 fixed point beside a flat gradient of
  the compute dtype; fast mode: float32 -- a bfloat16 layer's gradients are added into it as
  autograd writes them, no bfloat16 flat gradient kept; a float32 layer's sum is its gradient),
  and a gradient for each tied use of another layer's tensor where a flat gradient is kept.
- *optimizer*: its ZeRO share of each holder group it is in -- float32 master, exp_avg and
  exp_avg_sq (12 bytes a value), twice (the generation before is kept to redo a step; on a GPU in
  pinned host memory): 24 bytes per value of its slot (12 on a GPU's device), chunk padding
  included. Which values decay is kept as runs, a few per tensor.
- *snapshots*: of each rank whose snapshot it keeps, the generation at rest, the next one arriving
  and a spare buffer (3 x 12 bytes a value of the owner's slots; on a GPU the ones kept go to host
  memory, and the device holds only the one arriving). Its own snapshot is sent straight from its
  optimizer state: no copy.
- *data*: the token corpus, on the first and the last stage (they read the inputs and the targets).
- *update*: after the backward, the reduce's copy of the sums, the reduced gradient and Adam's
  temporaries, the all-gather's bucket (:meth:`MemoryModel.update_bytes`); the activations are
  gone by then, so the peak is the larger of the two.
- *activations*: under 1F1B, stage ``s`` of ``S`` has ``min(S - s, M)`` micro-batches between their
  forward and their backward (under ZB-H1 every stage up to ``min(S, M)``, each kept until its
  W); each keeps what autograd saved of every layer (measured by the model contract), or only its
  input for a layer that is recomputed; the micro-batch in its backward holds a recomputed layer's
  activations again while the layers after it are already freed. The activation a stage sent on,
  and the gradient it sent back, stay alive until the step's sends are drained: ``M`` of each.

The planner checks ``parallel.stage_memory_mb`` against it when it partitions layers (at the start,
at every re-partition and join), and the simulator prices a cluster with the same functions.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import lru_cache
from typing import Callable, Sequence

from elaswave.pipeline.routed import guests_in_flight, layout_stage
from elaswave.pipeline.schedule import alive_counts

MIB = 2 ** 20
STATE_BYTES = 12  # float32 master, exp_avg, exp_avg_sq
OPTIMIZER_BYTES = 2 * STATE_BYTES  # two generations (which values decay is a few runs a tensor: no bytes a value)
SNAPSHOT_COPIES = 3  # a peer's generation at rest, the next one arriving, a spare buffer


@dataclass(frozen=True)
class MemoryModel:
    layer_numels: tuple[int, ...]
    layer_activation_bytes: tuple[float, ...]
    """Bytes autograd saves from one micro-batch's forward of each layer (contract.saved_activation_bytes)."""
    boundary_bytes: float
    """One micro-batch's activation between two layers: what a recomputed layer keeps, what a stage sends."""
    param_bytes: int
    """Bytes of one value in the compute dtype (2: bfloat16, 4: float32)."""
    sum_bytes: int
    """Bytes per value of the gradient sum beside the gradient (8, 4 or 0; see the module doc)."""
    chunk_numel: int
    ties: tuple[tuple[int, int], ...] = ()
    tied_numels: tuple[int, ...] = ()
    """Values of each tie's tensor (in ``ties`` order): the user's stage keeps a gradient for its use."""
    recomputed: frozenset[int] = frozenset()
    snapshots: bool = True
    snapshot_copies: int = 1
    """Peers keeping each rank's snapshot, so snapshots of as many owners kept on each rank."""
    snapshots_to_host: bool = False
    """On a GPU a kept snapshot moves to host memory: the device holds only the one arriving (a
    rank's own is sent from its optimizer state)."""
    data_bytes: float = 0.0
    """The token corpus, in memory on a stage that reads batches (the first and the last)."""
    grad_bytes: int | None = None
    """Bytes per value of the flat gradient kept beside the sum: 0 where autograd's gradients go
    straight into the sum (fast mode, bfloat16); None: ``param_bytes``."""
    reduce_whole: bool = False
    """gloo: the reduce-scatter is an all-reduce, so every holder gets the whole reduced bucket."""
    generation_before_to_host: bool = False
    """On a GPU the optimizer's generation before waits in pinned host memory: not on the device."""
    frozen_numels: tuple[int, ...] = ()
    """Values of each layer that never train (LoRA's base weights; empty: none): held in the compute
    dtype, with no gradient, sum or optimizer state -- not in ``layer_numels``."""
    plan_recomputation: bool = False
    """train.activation_checkpointing=auto: the plan chooses which blocks each rank recomputes
    (``Plan.recomputed``, plan/recompute.py) to fit the limit, beside ``recomputed``."""
    split_backward: bool = False
    """ZB-H1 (parallel.schedule=zb-h1): a micro-batch keeps its graph from its forward to its W,
    which stage ``s`` holds back ``s`` micro-batches, so every stage has as many in flight as
    1F1B's first stage."""
    layer_held_for_w_bytes: tuple[float, ...] = ()
    """Under ZB-H1, what one micro-batch's B keeps for its W beside its activations, per layer: the
    gradients flowing into its weights' products (``pipeline.zero_bubble.held_for_w_bytes``; empty:
    not counted)."""
    slot_chunk_numel: int = 0
    """The chunk size whose padding a rank's optimizer slots and snapshots pay, where the plan's
    chunks are a coarser planning grain (the simulator's 2^24 values; the runtime's are
    parallel.chunk_numel, 4,096): each bucket's slot is its values over its holders rounded up to
    it. 0: the plan's own chunks (``chunk_numel``), as the runtime deals them."""
    expert_numels: tuple[int, ...] = ()
    """Values of each expert unit (Plan.unit_layers' order; counted in ``layer_numels`` too): a
    rank holds only those the plan's ``expert_holders`` give it (plan/experts.py)."""
    expert_layers: tuple[int, ...] = ()
    """The layer of each expert unit (Plan.unit_layers)."""
    expert_share: float = 1.0
    """The share of its layers' experts a rank holds in a whole expert-parallel group (1/ep): what
    a partition prices a stage's experts at before the plan places them (:meth:`stage_memory`;
    :func:`rank_bytes` counts the plan's own placement, and a re-plan is checked by it)."""
    overlap_grad_reduce: bool = True
    """parallel.overlap_grad_reduce: under interleaved 1F1B a chunk's packed sums are alive while
    the chunks before it still hold activations (:func:`_overlap_peak`), and within a backward a
    bucket's while the layers below it still hold theirs (:func:`_within_peak`)."""
    overlap_param_gather: bool = True
    """parallel.overlap_param_gather: the last update's all-gather buffers are alive until the
    forward that reads them, beside the activations kept by then (:func:`_gather_peak`)."""

    def in_flight(self, stage: int, num_stages: int, num_micro_batches: int) -> int:
        """Micro-batches whose activations stage ``stage`` of ``num_stages`` holds at its peak."""
        return min(num_stages if self.split_backward else num_stages - stage, num_micro_batches)

    def held_for_w(self, stage: int, num_micro_batches: int) -> int:
        """Micro-batches between their B and their W on stage ``stage`` at its peak: ZB-H1 holds a W
        back until ``stage`` + 1 are waiting (pipeline.schedule.zb_h1)."""
        return min(stage + 1, num_micro_batches) if self.split_backward and self.layer_held_for_w_bytes else 0

    def held_for_w_bytes(self, start: int, end: int) -> float:
        """What one micro-batch's B on layers [start, end) keeps for its W: a first stage has no B, and
        its W (the whole backward) keeps only the gradient into its output."""
        if start == 0:
            return self.boundary_bytes if end < len(self.layer_numels) else 0.0
        return sum(self.layer_held_for_w_bytes[start:end])

    def to_doc(self) -> dict:
        doc = {f.name: getattr(self, f.name) for f in fields(self)}
        doc["recomputed"] = sorted(self.recomputed)
        return doc

    @staticmethod
    def from_doc(doc: dict) -> "MemoryModel":
        out = {k: tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v
               for k, v in doc.items()}
        out["recomputed"] = frozenset(doc["recomputed"])
        return MemoryModel(**out)

    @property
    def gradient_bytes(self) -> int:
        return self.param_bytes if self.grad_bytes is None else self.grad_bytes

    @property
    def value_bytes(self) -> int:
        """Bytes a held layer's value costs: weight, flat gradient, gradient sum."""
        return self.param_bytes + self.gradient_bytes + self.sum_bytes

    def update_bytes(self, held: float, slot: float) -> float:
        """Bytes alive beside the static state after the backward (the activations gone), for
        ``held`` layer values and an optimizer slot of ``slot``, at the most of its phases: the
        reduce (the sums packed into the bucket's layout: a copy; a reduce-scatter's slot out; in
        deterministic mode the int64 result turned float through float64), the update (the
        float32 reduced gradient kept, Adam's two slot-sized temporaries), the all-gather (the
        bucket of parameters in the compute dtype and the shard cast to it)."""
        summed = self.sum_bytes or self.param_bytes  # a float32 layer's sum is its gradient
        reduced = held if self.reduce_whole else slot  # gloo: every holder gets the whole bucket
        reduce = summed * held + (0 if self.reduce_whole else summed * slot)
        if self.sum_bytes == 8:
            reduce += (8 + 4) * reduced
        return max(reduce, 4 * reduced + 8 * slot, self.param_bytes * (held + slot))

    @property
    def optimizer_bytes(self) -> int:
        """Bytes per value of an optimizer slot on the device."""
        return OPTIMIZER_BYTES - (STATE_BYTES if self.generation_before_to_host else 0)

    def peer_copies(self) -> int:
        """Buffers of the peer's snapshot this rank's device holds."""
        return 1 if self.snapshots_to_host else SNAPSHOT_COPIES

    def held_layers(self, start: int, end: int) -> list[int]:
        return sorted(set(range(start, end)) | {o for o, u in self.ties if start <= u < end})

    def frozen_bytes(self, layers) -> float:
        return self.param_bytes * sum(self.frozen_numels[i] for i in layers) if self.frozen_numels else 0.0

    def layer_bytes(self, start: int, end: int) -> float:
        uses = sum(n for (o, u), n in zip(self.ties, self.tied_numels) if start <= u < end)
        held = self.held_layers(start, end)
        return (self.value_bytes * sum(self.layer_numels[i] for i in held) + self.gradient_bytes * uses
                + self.frozen_bytes(held))

    def activation_bytes(self, start: int, end: int, in_flight: int, sends: int = 0, held_for_w: int = 0) -> float:
        """Activations of a stage running layers [start, end) with ``in_flight`` micro-batches
        alive at once and at most ``sends`` of its sends (activations and gradients) not yet freed
        (:func:`sends_alive`), ``held_for_w`` of them between their B and W (:meth:`held_for_w`)."""
        kept = [self.boundary_bytes if i in self.recomputed else self.layer_activation_bytes[i]
                for i in range(start, end)]
        return ((in_flight - 1) * sum(kept) + self._backward_peak(start, kept) + sends * self.boundary_bytes
                + (held_for_w * self.held_for_w_bytes(start, end) if held_for_w else 0.0))

    def sends_alive(self, stage: int, num_stages: int, num_micro_batches: int, num_chunks: int = 1) -> int:
        """The most of a stage's sends alive at once: each is freed once its peer must have taken it
        (pipeline/release.py), not at the step's end."""
        from elaswave.pipeline.release import alive_sends  # late: the plan needs no schedule

        schedule = "interleaved" if num_chunks > 1 else "zb-h1" if self.split_backward else "1f1b"
        return alive_sends(schedule, stage, num_stages, num_micro_batches, num_chunks) if num_micro_batches else 0

    def _backward_peak(self, start: int, kept: Sequence[float]) -> float:
        """The most one micro-batch holds: all it kept, or -- while recomputed layer ``i`` runs its
        backward, the layers after it already freed -- what the layers before ``i`` kept and all of
        ``i``'s activations again."""
        peak, before = sum(kept), 0.0
        for k, value in enumerate(kept):
            if start + k in self.recomputed:
                peak = max(peak, before + self.layer_activation_bytes[start + k])
            before += value
        return peak

    # -- what the partitioner checks -----------------------------------------------------
    def stage_memory(self, num_stages: int, holders: int, num_micro_batches: int) -> "Callable[[int, int, int], float]":
        """``(stage, start, end) -> MiB``: a stage's modelled peak when every layer it holds has
        ``holders`` holders (as many as there are pipelines; chunk padding aside) and the job has
        ``num_micro_batches``, its pipeline an even share of them (rounded up)."""
        n = len(self.layer_numels)
        micro_batches = -(-num_micro_batches // holders)
        per_value = self.value_bytes
        kept = self.snapshot_copies * self.peer_copies()
        share = (self.optimizer_bytes + (kept * STATE_BYTES if self.snapshots else 0)) / holders
        kept = [self.boundary_bytes if i in self.recomputed else self.layer_activation_bytes[i] for i in range(n)]
        values, acts, away = [0.0], [0.0], [0.0] * (n + 1)
        for i in range(n):
            values.append(values[-1] + self.layer_numels[i])
            acts.append(acts[-1] + kept[i])
        for layer, numel in zip(self.expert_layers, self.expert_numels):  # other members' experts
            away[layer + 1] += (1.0 - self.expert_share) * numel
        for i in range(n):
            away[i + 1] += away[i]
        # The backward's peak of one micro-batch (see _backward_peak) is acts[end] - acts[start] or
        # max over recomputed i in range of acts[i] + activations of i, less acts[start]: a range
        # maximum, answered from a sparse table in O(1) (the partitioner asks O(L^2 S) times).
        again = [acts[i] + self.layer_activation_bytes[i] if i in self.recomputed else float("-inf") for i in range(n)]
        table, width = [again], 2
        while width <= n:  # table[k][i]: the maximum of again[i:i + 2**k]
            prev = table[-1]
            table.append([max(prev[i], prev[i + width // 2]) for i in range(n - width + 1)])
            width *= 2

        def recompute_peak(start: int, end: int) -> float:
            k = (end - start).bit_length() - 1
            return max(table[k][start], table[k][end - (1 << k)])

        by_stage: dict[int, tuple[float, int]] = {}  # the partitioner asks O(L^2 S) times, each stage's alike

        def memory(stage: int, start: int, end: int) -> float:
            own = values[end] - values[start]
            borrowed = lent = uses = 0
            if self.ties:
                borrowed = sum(self.layer_numels[o] for o in {o for o, u in self.ties if start <= u < end
                                                               and not start <= o < end})
                lent = sum(self.layer_numels[o] for o in {o for o, u in self.ties if start <= o < end
                                                           and not start <= u < end})
                uses = sum(t for (o, u), t in zip(self.ties, self.tied_numels) if start <= u < end)
            held = own + borrowed
            # A tied owner's chunks are shared by the holders of both its layers: half each. (An
            # expert's chunks are shared by its owners, 1/ep of the holders, each holding 1/ep of
            # the experts: the same share of the state as a layer's.)
            shared = own + (borrowed - lent) / 2
            held -= away[end] - away[start]
            if stage not in by_stage:
                by_stage[stage] = (self.sends_alive(stage, num_stages, micro_batches) * self.boundary_bytes,
                                   self.in_flight(stage, num_stages, num_micro_batches),
                                   self.held_for_w(stage, micro_batches))
            sent, in_flight, waiting = by_stage[stage]
            data = self.data_bytes if start == 0 or end == n else 0.0
            activations = ((in_flight - 1) * (acts[end] - acts[start]) + sent
                           + max(acts[end], recompute_peak(start, end)) - acts[start]
                           + (waiting * self.held_for_w_bytes(start, end) if waiting else 0.0))
            frozen = self.frozen_bytes(self.held_layers(start, end)) if self.frozen_numels else 0.0
            return (held * per_value + shared * share + self.gradient_bytes * uses + data + frozen
                    + max(activations, self.update_bytes(held, shared / holders))) / MIB
        return memory


def bytes_per_parameter(model: MemoryModel, holders: int) -> dict[str, float]:
    """What each parameter costs a rank that holds its layer, by what the bytes are for, when each
    layer has ``holders`` holders (ZeRO shares its optimizer state among them; chunk padding
    aside). Megatron's distributed optimizer, for comparison, keeps 2 + 4 + 12/dp: bf16 weights,
    float32 gradients, and its share of the float32 master weights and two moments."""
    kept = model.snapshot_copies * model.peer_copies() if model.snapshots else 0
    return {
        "weights": float(model.param_bytes),
        "gradient": float(model.gradient_bytes),
        "gradient sum": float(model.sum_bytes),
        "optimizer (master, moments)": STATE_BYTES / holders,
        "optimizer, the generation before (a step can be redone)": (
            0.0 if model.generation_before_to_host else STATE_BYTES) / holders,
        "snapshots kept for peers (on the device)": STATE_BYTES * kept / holders,
    }


def rank_bytes(model: MemoryModel, plan, rank: int) -> dict[str, float]:
    """The modelled peak of ``rank`` under ``plan`` (an elaswave Plan), by part, with chunk padding,
    the holder groups and snapshot pairing the plan really has. Under interleaved 1F1B every model
    chunk's layers count, and its activations as the schedule keeps them alive
    (:func:`_interleaved_activations`). The blocks the plan recomputes count as ``recomputed``."""
    if getattr(plan, "recomputed", ()):
        model = replace(model, recomputed=model.recomputed | plan.recomputed_of(rank))
    d, s = plan.position(rank)
    depth = len(plan.pipelines[d])
    mbs = len(plan.schedule_of(d))  # (a ghost is in flight too: its experts' work on its group mates' rows)
    chunks = plan.chunk_ranges(rank)
    held = sorted({i for start, end in chunks for i in model.held_layers(start, end)})
    slot = _slot_values(model, plan, rank)
    peers = (sum(_slot_values(model, plan, owner) for owner in plan.snapshot_owners(rank))
             if model.snapshots and len(plan.ranks) > 1 else 0)
    # From here on each layer's values are what this rank holds of it: its own, and its experts.
    model = _as_held(model, plan, rank, held)
    out = {"layers": sum(model.layer_bytes(start, end) for start, end in chunks)}
    out["optimizer"] = model.optimizer_bytes * slot
    out["snapshots"] = STATE_BYTES * model.peer_copies() * peers
    out["data"] = model.data_bytes if s in (0, depth - 1) else 0.0
    if not mbs:
        out["activations"] = 0.0
    elif len(chunks) == 1:
        start, end = chunks[0]
        # With detours every send lives to the step's end, by the layers the rank holds (a survivor last
        # in its pipeline still sends onto a detour); a host's guests' sends, and those it holds at once.
        own = set(plan.micro_batches[d])
        sends = (mbs * ((start > 0) + (end < plan.num_layers))
                 + 2 * sum(rank in route and mb not in own for mb, route in plan.routes)
                 if getattr(plan, "routes", ()) else model.sends_alive(s, depth, mbs))
        at, whole = layout_stage(plan, rank, s, depth)  # a broken pipeline's survivor runs its whole layout's 1F1B
        guests = guests_in_flight(plan, rank, whole if model.split_backward else whole - at)
        waiting = model.held_for_w(at, mbs)  # (a guest waits for its W beside its place's own: ZB-H1 hosts read 0.91)
        out["activations"] = model.activation_bytes(start, end, model.in_flight(at, whole, mbs) + guests, sends,
                                                    waiting + guests if waiting else 0)
    else:
        out["activations"] = _interleaved_activations(model, chunks, *layout_stage(plan, rank, s, depth), mbs,
                                                      plan.num_layers, getattr(plan, "guest_places", {}).get(rank, ()))
    # After the backward the activations are gone and the reduce packs the sums: one or the other --
    # but a chunk's sum that starts early is packed while the chunks before it still compute.
    out["update"] = model.update_bytes(sum(model.layer_numels[i] for i in held), slot)
    out["overlap"] = max(_overlap_peak(model, chunks, s, depth, mbs) if len(chunks) > 1 else 0.0,
                         _within_peak(model, plan, rank, chunks, s, depth, mbs)) if mbs and model.overlap_grad_reduce else 0.0
    out["gather"] = (_gather_peak(model, chunks, s, depth, mbs, slot)
                     if mbs and model.overlap_param_gather else 0.0)
    phases = ("activations", "update", "overlap", "gather")
    out["total"] = sum(v for k, v in out.items() if k not in phases) + max(out[k] for k in phases)
    return out


def _as_held(model: MemoryModel, plan, rank: int, held) -> MemoryModel:
    """``model`` with each of the ``held`` layers' values less the experts other ranks of
    ``rank``'s expert-parallel groups hold instead (unchanged without the plan's ``expert_holders``)."""
    if not getattr(plan, "expert_holders", ()) or not model.expert_numels:
        return model
    numels, mine = list(model.layer_numels), plan.experts_held(rank)
    for layer in held:  # (by the plan's index: a scan of every expert a rank was 30 s at 2,048 ranks)
        for u in plan.experts_of_layer.get(layer, ()):
            if u not in mine:
                numels[layer] -= model.expert_numels[u - plan.num_layers]
    return replace(model, layer_numels=tuple(numels))


def _one_and_kept(model: MemoryModel, chunks) -> tuple[list[float], list[float]]:
    """Per model chunk: one micro-batch's activation peak, and what each micro-batch keeps alive
    between its forward and its backward."""
    one = [model.activation_bytes(start, end, 1) for start, end in chunks]
    return one, [model.activation_bytes(start, end, 2) - o for (start, end), o in zip(chunks, one)]


def _overlap_peak(model: MemoryModel, chunks, stage: int, depth: int, mbs: int) -> float:
    """Under interleaved 1F1B with overlapped sums: right after chunk ``c``'s last backward its sums
    are packed (a copy of each layer's sum) and started, beside the packed sums of the chunks after
    it and the activations the schedule still keeps then -- the most of that over ``c`` >= 1."""
    kept = _one_and_kept(model, chunks)[1]
    summed = model.sum_bytes or model.param_bytes
    packed = [summed * sum(model.layer_numels[i] for i in range(start, end)) for start, end in chunks]
    after = alive_counts(stage, depth, len(chunks), mbs)[1]
    return max((sum(n * k for n, k in zip(after[c], kept)) + sum(packed[c:]) for c in range(1, len(chunks))),
               default=0.0)


def _within_peak(model: MemoryModel, plan, rank: int, chunks, stage: int, depth: int, mbs: int) -> float:
    """With overlapped sums, a bucket's sum starts within the backward (or ZB-H1's W) that makes it
    whole (zero/watch.py), as it reaches the bucket's lowest layer ``a``: the packed sums of
    chunk ``c``'s layers from ``a`` up (and of the chunks after it, under interleaved 1F1B) beside
    the activations of its layers below ``a`` that the micro-batch still holds, and the micro-batches
    the other chunks keep then -- the most of that over the rank's buckets."""
    summed = model.sum_bytes or model.param_bytes
    packed = [summed * sum(model.layer_numels[i] for i in range(start, end)) for start, end in chunks]
    after = alive_counts(stage, depth, len(chunks), mbs)[1] if len(chunks) > 1 else ((0,),)
    kept = _one_and_kept(model, chunks)[1]
    out, buckets = 0.0, plan.gradient_buckets()
    for b in plan.buckets_of(rank):
        a = plan.layer_of(buckets[b][1][0])  # (its units are in layer order)
        for c, (start, end) in enumerate(chunks):
            if start < a < end:
                out = max(out, sum(n * k for n, k in zip(after[c], kept)) + sum(packed[c + 1:])
                          + summed * sum(model.layer_numels[i] for i in range(a, end))
                          + model.activation_bytes(start, a, 1))
    return out


def _gather_peak(model: MemoryModel, chunks, stage: int, depth: int, mbs: int, slot: float) -> float:
    """With overlapped all-gathers (zero/reduce.Gathering) each bucket's packed parameters in the
    compute dtype, and the shards cast to it, wait for the forward that reads them. Under
    interleaved 1F1B, before chunk ``c``'s first forward the buffers of chunks ``c`` on are alive
    beside the activations the chunks before it keep then (the warm-up's first forwards), and as
    chunk ``c``'s forward goes its buffers give way to its micro-batch's activations -- the most of
    that over ``c`` >= 1. In one chunk (and chunk 0) the buffers go as the first micro-batch's
    forward reaches each layer: at most one micro-batch's activations beside them, which the
    activations and update terms bound (to within the cast shards, 1/holders of the layers)."""
    if len(chunks) == 1:
        return 0.0
    values = [sum(model.layer_numels[i] for i in model.held_layers(start, end)) for start, end in chunks]
    one, kept = _one_and_kept(model, chunks)
    before = alive_counts(stage, depth, len(chunks), mbs)[2]
    return max(model.param_bytes * (sum(values[c + 1:]) + slot) + sum(n * k for n, k in zip(before[c], kept))
               + max(model.param_bytes * values[c], one[c]) for c in range(1, len(chunks)))


def _interleaved_activations(model: MemoryModel, chunks, stage: int, depth: int, mbs: int, num_layers: int,
                             guests: Sequence[tuple[int, int]] = ()) -> float:
    """A rank's activations under interleaved 1F1B, instant by instant through its schedule: the
    most its alive (micro-batch, chunk) pairs keep together -- each chunk keeps its own layers'
    (a head chunk's logits are not an embedding chunk's) -- plus one backward's extra peak and its
    sends not yet freed (:meth:`MemoryModel.sends_alive`); a host's ``guests`` ((place, chunk): the
    chunk each runs) with their sends, as if all alive at once (pipeline/routed.py inserts them apart)."""
    one, kept = _one_and_kept(model, chunks)  # one: a micro-batch's peak
    sent = (model.sends_alive(stage, depth, mbs, len(chunks)) * model.boundary_bytes
            + sum(kept[c] + 2 * model.boundary_bytes for _, c in guests))
    peak = max((sum(n * k for n, k in zip(counts, kept)) for counts in alive_counts(stage, depth, len(chunks), mbs)[0]),
               default=0.0)
    return peak + max(o - k for o, k in zip(one, kept)) + sent


def by_cost(virtual_stages: int, memory: MemoryModel | None) -> bool:
    """Whether the planner partitions by cost alone and checks memory after: under interleaved 1F1B
    (a rank's chunks are not one range the partition's memory terms price), and where the plan
    chooses what to recompute to fit (plan/recompute.py) rather than moving layers."""
    return virtual_stages > 1 or (memory is not None and memory.plan_recomputation)


def _slot_values(model: MemoryModel, plan, rank: int) -> int:
    """Values of ``rank``'s optimizer slots (Plan.slot_chunks; with ``slot_chunk_numel``, each
    bucket's share rounded up to that grain)."""
    if not model.slot_chunk_numel:
        return sum(plan.slot_chunks(rank)) * model.chunk_numel
    buckets, grain, out = plan.gradient_buckets(), model.slot_chunk_numel, 0
    numels = _unit_numels(model, plan)
    for b in plan.buckets_of(rank):
        holders, units = buckets[b]
        chunks = sum(-(-numels[i] // grain) for i in units)  # (a unit's chunks never span two)
        out += -(-chunks // len(holders)) * grain  # a slot is the most any holder of the bucket gets
    return out


def _unit_numels(model: MemoryModel, plan) -> tuple[int, ...]:
    """Each unit's values (model/units.py): a layer's own, then each expert's (every rank of a plan
    asks: once per plan, not 53 s at 2,048 ranks of qwen3-235b-a22b)."""
    return _numels_by_unit(model.layer_numels, model.expert_numels, plan.unit_layers)


@lru_cache(maxsize=8)
def _numels_by_unit(layer_numels: tuple[int, ...], expert_numels: tuple[int, ...],
                    unit_layers: tuple[int, ...]) -> tuple[int, ...]:
    if not unit_layers or not expert_numels:
        return tuple(layer_numels)
    out = list(layer_numels)
    for layer, n in zip(unit_layers, expert_numels):
        out[layer] -= n
    return (*out, *expert_numels)


def stages_memory(memory: MemoryModel | None, num_stages: int, pipelines: int, num_micro_batches: int):
    """:meth:`MemoryModel.stage_memory` for a partition into ``num_stages`` stages, one of
    ``pipelines`` pipelines (None without a model: no limit to fit)."""
    return memory.stage_memory(num_stages, max(1, pipelines), num_micro_batches) if memory is not None else None
