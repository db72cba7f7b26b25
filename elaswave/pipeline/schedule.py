"""Pipeline schedules as data: a list of typed actions per stage (1F1B, ZB-H1's split backward, and
Megatron's interleaved 1F1B over virtual stages).

A schedule can be printed, checked for deadlock without any process (:func:`check_deadlock_free`),
run by the executor's dispatch table, and timed by a simulator. Sends are non-blocking and receives
block, which is how the executor runs them, and what the deadlock check assumes.

With ``V`` model chunks a rank (stage ``s`` of ``p``) holds the virtual stages ``v * p + s`` for
``v = 0..V-1`` (Megatron's layout): chunk ``v`` of the last rank feeds chunk ``v + 1`` of rank 0, so
the ranks form a ring that a micro-batch goes round ``V`` times. Plain schedules are ``V = 1``.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from typing import Sequence


BACKWARD_INPUT_SHARE = 0.5
"""The part of a whole backward's time a split backward's B takes (W the rest): the two products
of a linear layer, the input's and the weight's, cost the same (the ZB-H1 paper's setting)."""


class Op(Enum):
    RECV_ACT = "recv_act"
    FORWARD = "forward"
    SEND_ACT = "send_act"
    RECV_GRAD = "recv_grad"
    BACKWARD = "backward"
    SEND_GRAD = "send_grad"
    BACKWARD_INPUT = "backward_input"
    """ZB-H1's B: the gradient of the stage's input only (what the previous stage waits for)."""
    BACKWARD_WEIGHT = "backward_weight"
    """ZB-H1's W: the gradient of the stage's weights, left for later (nobody waits for it)."""


@dataclass(frozen=True)
class Action:
    op: Op
    micro_batch: int
    peer: int | None = None
    """The rank to send to or receive from; None: the neighbouring virtual stage of this rank's
    pipeline (rank ``s - 1`` or ``s + 1``, round the ring between rank ``p - 1`` and rank 0)."""
    chunk: int = 0
    """The model chunk on this rank the action belongs to (virtual stage ``chunk * p + stage``): a
    receive's is the chunk that consumes the message, a send's the chunk that produced it."""

    def __str__(self) -> str:
        return (f"{self.op.value}({self.micro_batch}" + (f",c{self.chunk}" if self.chunk else "") + ")"
                + ("" if self.peer is None else f"@{self.peer}"))


def _forward(stage: int, num_stages: int, mb: int, chunk: int = 0, num_chunks: int = 1) -> list[Action]:
    """The forward of ``mb`` on virtual stage ``chunk * num_stages + stage`` with its messages."""
    virtual = chunk * num_stages + stage
    acts = [] if virtual == 0 else [Action(Op.RECV_ACT, mb, chunk=chunk)]
    acts.append(Action(Op.FORWARD, mb, chunk=chunk))
    if virtual < num_stages * num_chunks - 1:
        acts.append(Action(Op.SEND_ACT, mb, chunk=chunk))
    return acts


def _backward(stage: int, num_stages: int, mb: int, op: Op = Op.BACKWARD, chunk: int = 0,
              num_chunks: int = 1) -> list[Action]:
    """The backward of ``mb`` with its messages; ``op`` BACKWARD_INPUT: ZB-H1's B, the part the
    stage before waits for."""
    virtual = chunk * num_stages + stage
    acts = [] if virtual == num_stages * num_chunks - 1 else [Action(Op.RECV_GRAD, mb, chunk=chunk)]
    acts.append(Action(op, mb, chunk=chunk))
    if virtual > 0:
        acts.append(Action(Op.SEND_GRAD, mb, chunk=chunk))
    return acts


def one_f_one_b(stage: int, num_stages: int, micro_batches: Sequence[int]) -> list[Action]:
    """Warm-up forwards, then alternate one forward / one backward, then drain the backwards.

    At most ``num_stages - stage`` micro-batches' activations are alive on a stage at once.
    """
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} out of range for {num_stages} stages")
    mbs = list(micro_batches)
    warmup = min(num_stages - stage - 1, len(mbs))
    acts: list[Action] = []
    for mb in mbs[:warmup]:
        acts += _forward(stage, num_stages, mb)
    pending = list(mbs[:warmup])
    for mb in mbs[warmup:]:
        acts += _forward(stage, num_stages, mb)
        pending.append(mb)
        acts += _backward(stage, num_stages, pending.pop(0))
    for mb in pending:
        acts += _backward(stage, num_stages, mb)
    return acts


def zb_h1(stage: int, num_stages: int, micro_batches: Sequence[int]) -> list[Action]:
    """Zero-bubble ZB-H1 (Qi et al., 2023): 1F1B's order with each backward split into B (the
    input's gradient, which the stage before waits for) and W (the weights', which nobody waits
    for). Stage ``s`` runs a micro-batch's W only once ``s`` more are waiting for theirs, so the
    W passes it holds back fill the drain, where 1F1B idles; a stage holds at most
    ``num_stages`` micro-batches' activations (1F1B's stage 0 does), until their W."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} out of range for {num_stages} stages")
    mbs = list(micro_batches)
    warmup = min(num_stages - stage - 1, len(mbs))
    acts: list[Action] = []
    for mb in mbs[:warmup]:
        acts += _forward(stage, num_stages, mb)
    pending, waiting_w = list(mbs[:warmup]), []
    for mb in mbs[warmup:]:
        acts += _forward(stage, num_stages, mb)
        pending.append(mb)
        done = pending.pop(0)
        acts += _backward(stage, num_stages, done, Op.BACKWARD_INPUT)
        waiting_w.append(done)
        if len(waiting_w) > stage:
            acts.append(Action(Op.BACKWARD_WEIGHT, waiting_w.pop(0)))
    for mb in pending:  # the drain: a W held back after each B, where the stage would wait
        acts += _backward(stage, num_stages, mb, Op.BACKWARD_INPUT)
        waiting_w.append(mb)
        acts.append(Action(Op.BACKWARD_WEIGHT, waiting_w.pop(0)))
    acts += [Action(Op.BACKWARD_WEIGHT, mb) for mb in waiting_w]
    return acts


def interleaved_1f1b(stage: int, num_stages: int, num_chunks: int, micro_batches: Sequence[int]) -> list[Action]:
    """Megatron-LM's interleaved 1F1B (Narayanan et al., 2021): rank ``stage`` runs its
    ``num_chunks`` chunks (virtual stages ``v * num_stages + stage``) on micro-batches taken in
    groups: the forwards go chunk 0 on a group's micro-batches, chunk 1 on them, ..., then the next
    group; the backwards the same groups from the last chunk down. The rank first runs
    ``(p - stage - 1) * 2 + (V - 1) * g`` forwards (g: the first group's size; at most all ``V * m``),
    then pairs one forward with one backward, then drains the backwards. Its bubble is ``1 / V`` of
    1F1B's; rank 0 holds up to ``V * p + p - 1`` micro-batch-chunks' activations (1F1B's stage 0:
    p whole ones).

    With ``m`` a multiple of ``p`` the groups are of ``p``, Megatron's schedule exactly. Otherwise
    (a re-planned pipeline gets whatever count the deal gives it) there are ``max(1, m // p)``
    groups as even as possible, each of at least ``p`` (all ``m`` when fewer): a short group of
    fewer than ``p`` behind full ones deadlocks, the test suite's sweep shows. ``num_chunks`` 1 is
    :func:`one_f_one_b` (Megatron runs its plain schedule there too)."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} out of range for {num_stages} stages")
    if num_chunks < 1:
        raise ValueError(f"num_chunks {num_chunks}: a rank holds at least 1 model chunk")
    if num_chunks == 1:
        return one_f_one_b(stage, num_stages, micro_batches)
    mbs = list(micro_batches)
    rounds = max(1, len(mbs) // num_stages)
    sizes = [len(mbs) // rounds + (1 if i < len(mbs) % rounds else 0) for i in range(rounds)]
    groups = [mbs[sum(sizes[:i]):sum(sizes[:i + 1])] for i in range(rounds)]
    forwards = [(mb, c) for g in groups for c in range(num_chunks) for mb in g]
    backwards = [(mb, num_chunks - 1 - c) for g in groups for c in range(num_chunks) for mb in g]

    def fwd(k: int) -> list[Action]:
        return _forward(stage, num_stages, *forwards[k], num_chunks)

    def bwd(k: int) -> list[Action]:
        mb, chunk = backwards[k]
        return _backward(stage, num_stages, mb, Op.BACKWARD, chunk, num_chunks)

    total = len(forwards)
    warmup = min((num_stages - stage - 1) * 2 + (num_chunks - 1) * sizes[0], total)
    acts = [a for k in range(warmup) for a in fwd(k)]
    for k in range(total - warmup):  # steady: forward k + warmup, then backward k
        acts += fwd(k + warmup) + bwd(k)
    for k in range(total - warmup, total):
        acts += bwd(k)
    return acts


def peak_in_flight(actions: Sequence[Action]) -> int:
    """The most (micro-batch, chunk) pairs whose activations a rank holds at once: from the forward
    to the end of their backward (to their W, when the backward is split). With ``V`` even chunks
    each pair is ``1 / V`` of a whole stage's activations; with one chunk it counts micro-batches."""
    alive, peak = set(), 0
    for a in actions:
        if a.op is Op.FORWARD:
            alive.add((a.micro_batch, a.chunk))
            peak = max(peak, len(alive))
        elif a.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT):
            alive.discard((a.micro_batch, a.chunk))
    return peak


def _num_chunks(schedules: Sequence[Sequence[Action]]) -> int:
    return 1 + max((a.chunk for sched in schedules for a in sched), default=0)


class DeadlockError(RuntimeError):
    pass


def check_deadlock_free(schedules: Sequence[Sequence[Action]]) -> None:
    """Run the stages' schedules of one pipeline symbolically; raise if they can get stuck.

    A RECV waits for the matching SEND of the neighbouring virtual stage: the same micro-batch, an
    activation from virtual stage ``k - 1``, a gradient from ``k + 1``, where an action of rank
    ``s`` on chunk ``v`` is at ``k = v * p + s`` (so with chunks, rank p-1's chunk v sends to rank
    0's chunk v+1). Sends never wait. Also checks every send is received exactly once.
    """
    num_stages = len(schedules)
    sent: set[tuple[str, int, int]] = set()  # (kind, to_virtual_stage, micro_batch)
    pos = [0] * num_stages
    while True:
        progressed = False
        for s, sched in enumerate(schedules):
            while pos[s] < len(sched):
                a = sched[pos[s]]
                virtual = a.chunk * num_stages + s
                if a.op is Op.RECV_ACT or a.op is Op.RECV_GRAD:
                    key = ("act" if a.op is Op.RECV_ACT else "grad", virtual, a.micro_batch)
                    if key not in sent:
                        break
                    sent.discard(key)
                elif a.op is Op.SEND_ACT:
                    sent.add(("act", virtual + 1, a.micro_batch))
                elif a.op is Op.SEND_GRAD:
                    sent.add(("grad", virtual - 1, a.micro_batch))
                pos[s] += 1
                progressed = True
        if all(p == len(sc) for p, sc in zip(pos, schedules)):
            if sent:
                raise DeadlockError(f"messages sent but never received: {sorted(sent)}")
            return
        if not progressed:
            stuck = {s: str(sc[pos[s]]) for s, sc in enumerate(schedules) if pos[s] < len(sc)}
            raise DeadlockError(f"schedule deadlocks; stages waiting at {stuck}")


def one_f_one_b_makespan(stage_s: Sequence[float], num_micro_batches: int, backward_factor: float = 2.0,
                         sizes: Sequence[float] | None = None) -> float:
    """The time :func:`one_f_one_b` takes on stages of the given forward + backward time per
    micro-batch (split ``1 : backward_factor``): every stage runs its own schedule's forwards and
    backwards in order, each as soon as its stage is free and its input has arrived. ``sizes``:
    each micro-batch's work as a share of a whole one's (reshaped micro-batches; default all 1).

    Exact for that order, unlike the bottleneck price ``(m + S - 1) x max`` (an upper bound, equal
    when every stage takes as long): a lighter stage shortens fill and drain by what it saves."""
    num_stages = len(stage_s)
    if sizes is not None and len(sizes) != num_micro_batches:
        raise ValueError(f"{len(sizes)} sizes for {num_micro_batches} micro-batches")
    scale = list(sizes) if sizes is not None else [1.0] * num_micro_batches
    forward = [t / (1 + backward_factor) for t in stage_s]
    backward = [t - f for t, f in zip(stage_s, forward)]
    order = [[(a.op is Op.BACKWARD, a.micro_batch) for a in one_f_one_b(s, num_stages, range(num_micro_batches))
              if a.op in (Op.FORWARD, Op.BACKWARD)] for s in range(num_stages)]
    f_end = [[-1.0] * num_micro_batches for _ in range(num_stages)]
    b_end = [[-1.0] * num_micro_batches for _ in range(num_stages)]
    free, pos = [0.0] * num_stages, [0] * num_stages
    left = 2 * num_stages * num_micro_batches
    while left:
        progressed = False
        for s in range(num_stages):
            ops = order[s]
            while pos[s] < len(ops):
                is_backward, mb = ops[pos[s]]
                if is_backward:
                    ready = f_end[s][mb] if s == num_stages - 1 else b_end[s + 1][mb]
                    if ready < 0:
                        break
                    free[s] = b_end[s][mb] = max(free[s], ready) + backward[s] * scale[mb]
                else:
                    ready = 0.0 if s == 0 else f_end[s - 1][mb]
                    if ready < 0:
                        break
                    free[s] = f_end[s][mb] = max(free[s], ready) + forward[s] * scale[mb]
                pos[s] += 1
                left -= 1
                progressed = True
        if not progressed:  # one_f_one_b is deadlock-free: this would be a bug in it
            raise DeadlockError(f"1F1B timing stuck at stages {pos}")
    return max(free, default=0.0)


def makespan(schedules: Sequence[Sequence[Action]], stage_s: Sequence[float], backward_factor: float = 2.0,
             input_share: float = BACKWARD_INPUT_SHARE, sizes: Sequence[float] | None = None,
             released: Sequence[float] | None = None) -> float:
    """See :func:`timeline`: when the last stage is done."""
    return max(timeline(schedules, stage_s, backward_factor, input_share, sizes, released)[1], default=0.0)


def gradients_whole(schedules: Sequence[Sequence[Action]], stage_s: Sequence[float], backward_factor: float = 2.0,
                    sizes: Sequence[float] | None = None,
                    released: Sequence[float] | None = None) -> tuple[tuple[float, float], ...]:
    """When each virtual stage's (``chunk * p + stage``) weight gradients are whole, timed as
    :func:`makespan` times the schedules: (its last backward's (or W's) end, that computation's
    duration, which makes them whole layer by layer, the last layer first), (0, 0) if it runs
    none. A rank's gradient sums start then (zero/reduce.Reduction, zero/watch.py)."""
    done, _ = timeline(schedules, stage_s, backward_factor, sizes=sizes, released=released)
    out = [(0.0, 0.0)] * len(stage_s)
    backward = [t * backward_factor / (1 + backward_factor) for t in stage_s]
    for (op, k, mb), end in done.items():
        if op in (Op.BACKWARD, Op.BACKWARD_WEIGHT) and end > out[k][0]:
            share = 1.0 if op is Op.BACKWARD else 1.0 - BACKWARD_INPUT_SHARE
            out[k] = (end, backward[k] * share * (1.0 if sizes is None else sizes[mb]))
    return tuple(out)


def timeline(schedules: Sequence[Sequence[Action]], stage_s: Sequence[float], backward_factor: float = 2.0,
             input_share: float = BACKWARD_INPUT_SHARE, sizes: Sequence[float] | None = None,
             released: Sequence[float] | None = None) -> tuple[dict[tuple[Op, int, int], float], list[float]]:
    """The time a pipeline's stage schedules take, each stage running its computations in its own
    order, each as soon as its stage is free and its input is there: a forward once the stage
    before sent its activations, a backward (or B) once the stage after sent the gradient, a W
    once its own B is done. ``stage_s``: each *virtual* stage's forward + whole backward per
    micro-batch (split ``1 : backward_factor``), indexed ``chunk * p + stage`` -- one per stage
    without chunks; a rank's chunks may differ, as the planner's p x V partition will make them.
    A split backward's B takes ``input_share`` of it, W the rest. ``sizes``: each micro-batch's
    work as a share of a whole one's (default all 1). ``released``: by virtual stage, when its
    forwards may start at the earliest (its parameters' all-gather; default 0). Messages take no
    time. Returns each computation's end by (op, virtual stage, micro-batch), and each stage's last end."""
    num_stages, num_virtual = len(schedules), len(schedules) * _num_chunks(schedules)
    if len(stage_s) != num_virtual:
        raise ValueError(f"stage_s has {len(stage_s)} times for {num_stages} stages x "
                         f"{num_virtual // max(num_stages, 1)} chunks: one per virtual stage, {num_virtual}")
    forward = [t / (1 + backward_factor) for t in stage_s]
    backward = [t - f for t, f in zip(stage_s, forward)]
    cost = {Op.FORWARD: forward, Op.BACKWARD: backward,
            Op.BACKWARD_INPUT: [b * input_share for b in backward],
            Op.BACKWARD_WEIGHT: [b * (1 - input_share) for b in backward]}
    order = [[a for a in sched if a.op in cost] for sched in schedules]
    scale = (lambda mb: 1.0) if sizes is None else (lambda mb: sizes[mb])
    done: dict[tuple[Op, int, int], float] = {}  # (op, virtual stage, micro-batch) -> end
    free, pos = [0.0] * num_stages, [0] * num_stages
    left = sum(len(o) for o in order)
    while left:
        progressed = False
        for s in range(num_stages):
            while pos[s] < len(order[s]):
                a = order[s][pos[s]]
                mb, k = a.micro_batch, a.chunk * num_stages + s
                if a.op is Op.FORWARD:
                    ready = 0.0 if k == 0 else done.get((Op.FORWARD, k - 1, mb))
                    if ready is not None and released is not None:
                        ready = max(ready, released[k])
                elif a.op is Op.BACKWARD_WEIGHT:
                    ready = done.get((Op.BACKWARD_INPUT, k, mb))
                elif k == num_virtual - 1:
                    ready = done.get((Op.FORWARD, k, mb))
                else:  # the gradient from the virtual stage after: its backward, or its B
                    ready = done.get((Op.BACKWARD_INPUT, k + 1, mb), done.get((Op.BACKWARD, k + 1, mb)))
                if ready is None:
                    break
                free[s] = done[(a.op, k, mb)] = max(free[s], ready) + cost[a.op][k] * scale(mb)
                pos[s] += 1
                left -= 1
                progressed = True
        if not progressed:
            raise DeadlockError(f"the schedules' timing is stuck at stages {pos}")
    return done, free


GENERATORS = {"1f1b": one_f_one_b, "zb-h1": zb_h1, "interleaved": interleaved_1f1b}
"""``parallel.schedule`` -> the generator of a stage's actions, as the runtime runs them
(:func:`stage_schedule` calls it)."""


def stage_schedule(name: str, stage: int, num_stages: int, micro_batches: Sequence[int],
                   num_chunks: int = 1) -> list[Action]:
    """Stage ``stage``'s actions under schedule ``name`` with ``num_chunks`` model chunks a rank
    (``parallel.virtual_stages``; only ``interleaved`` takes more than 1)."""
    if num_chunks != 1 and name != "interleaved":
        raise ValueError(f"schedule {name!r} runs one model chunk a rank, not {num_chunks}: "
                         "virtual stages take the interleaved schedule")
    return list(_stage_schedule(name, stage, num_stages, tuple(micro_batches), num_chunks))


@lru_cache(maxsize=4096)
def _stage_schedule(name: str, stage: int, num_stages: int, micro_batches: tuple[int, ...],
                    num_chunks: int) -> tuple[Action, ...]:
    """(The planner and the simulator ask for the same stages' orders thousands of times.)"""
    if name == "interleaved":
        return tuple(interleaved_1f1b(stage, num_stages, num_chunks, micro_batches))
    return tuple(GENERATORS[name](stage, num_stages, micro_batches))


def schedule_makespan(name: str, stage_s: Sequence[float], num_micro_batches: int, backward_factor: float = 2.0,
                      sizes: Sequence[float] | None = None, num_chunks: int = 1) -> float:
    """One pipeline's time under schedule ``name`` (a :data:`GENERATORS` key): every stage's action
    list timed by :func:`makespan` (1F1B by its exact closed timing, the same figure, faster).
    ``stage_s``: each rank's time per micro-batch, its ``num_chunks`` chunks' together (each chunk
    taken as an even share of it, which the planner's p x V minimax partition comes close to)."""
    if name == "1f1b" and num_chunks == 1:
        return one_f_one_b_makespan(stage_s, num_micro_batches, backward_factor, sizes)
    num_stages = len(stage_s)
    virtual = [stage_s[k % num_stages] / num_chunks for k in range(num_stages * num_chunks)]
    return makespan([stage_schedule(name, s, num_stages, range(num_micro_batches), num_chunks)
                     for s in range(num_stages)], virtual, backward_factor, sizes=sizes)


@lru_cache(maxsize=4096)
def alive_counts(stage: int, depth: int, num_chunks: int, mbs: int) -> tuple[frozenset, tuple, tuple]:
    """Stage ``stage``'s interleaved 1F1B schedule, walked once per shape (a plan of 10^4 ranks has a
    few; plan/memory.py counts its activations by it):
    each chunk's count of micro-batches alive after every forward (the distinct ones: a peak is at
    one of them), right after each chunk's last backward, and right before its first forward, by chunk."""
    actions = interleaved_1f1b(stage, depth, num_chunks, range(mbs))
    last = {a.chunk: i for i, a in enumerate(actions) if a.op is Op.BACKWARD}
    counts, forwards, after, first = [0] * num_chunks, set(), {}, {}
    for i, a in enumerate(actions):
        if a.op is Op.FORWARD:
            first.setdefault(a.chunk, tuple(counts))
            counts[a.chunk] += 1
            forwards.add(tuple(counts))
        elif a.op is Op.BACKWARD:
            counts[a.chunk] -= 1
            if last[a.chunk] == i:
                after[a.chunk] = tuple(counts)
    return (frozenset(forwards), tuple(after.get(c, (0,) * num_chunks) for c in range(num_chunks)),
            tuple(first.get(c, (0,) * num_chunks) for c in range(num_chunks)))
