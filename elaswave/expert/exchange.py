"""Expert parallelism's all-to-all: a mixture-of-experts block's tokens go to the rank that owns
their expert and come back, in the forward and again (as gradients) in the backward.

The block hands :func:`run_experts` its rows cut by expert (``xs[e]``: the rows routed to expert e,
in token order) and gets back each expert's output on them; it weighs and adds them itself, in
expert order. Every block computes through the one autograd Function here, whether its experts are
all on this rank (:class:`Local`: the reference, ``parallel.ep=1``) or spread over a group
(:class:`AllToAll`), so the block's graph, and the order autograd adds its input's gradient in, is
the same either way.

An owner runs an expert on each member's rows alone: the rows the reference runs it on for that
micro-batch, so the same products and the same bits. In deterministic mode each member's weight
gradient is then folded into the fixed-point sums alone (``fold``), as the reference folds each
micro-batch's; in fast mode they add up in ``.grad``. Every member of a group must run each block's
forward and backward in the same order, each exchange being one collective of the group
(runtime/experts.py groups only pipelines that run one schedule).
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from elaswave.model.recompute import in_checkpoint
from elaswave.pipeline.zero_bubble import backward_input

Fold = Callable[[int], None]
"""Fold expert e's weight gradient, just computed for one member's rows, into the sums."""


def _kept(t: torch.Tensor) -> torch.Tensor:
    # Detached: a tensor saved as itself would hold its own autograd node (an output an op saves,
    # exp's or sigmoid's), a cycle freed only by that graph's backward.
    return t.detach()


def _unpacked(t: torch.Tensor) -> torch.Tensor:
    return t


class _Experts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, exchange, block, graph, count, *tensors):
        # ``tensors``: the ``count`` rows by expert, then the weights of the experts this rank
        # computes -- inputs only so that autograd sees them behind this node: ZB-H1 then splits
        # it like any product (``splits_backward``), the experts' weight gradients in W.
        xs = tensors[:count]
        # Inside a recomputed (checkpointed) block (model/recompute.checkpointed). Its first forward
        # keeps only the experts' rows, which the checkpoint drops and recomputes with the block (a
        # graph kept there would escape the checkpoint; built under its hooks, each of its
        # backwards -- a graph task of its own -- would redo the block). Its recomputation runs
        # inside the backward's graph task: that one keeps the experts' graph, out of the
        # checkpoint's hooks, and hands it to the first forward's node through a tensor both save
        # (the checkpoint gives that node what its recomputation saved), so the experts' forward
        # runs twice, as every recomputed layer's does, not a third time in their backward.
        hooked = graph and in_checkpoint()
        again = hooked and torch._C._current_graph_task_id() != -1
        defer = hooked and not again
        if again:
            with torch.autograd.graph.saved_tensors_hooks(_kept, _unpacked):
                call = exchange.forward(block, xs, graph, False)
        else:
            call = exchange.forward(block, xs, graph, defer)
        outputs, call.outputs = tuple(call.outputs), None  # (they point back to ctx: no cycle kept)
        if defer:  # nothing reads the experts' outputs again: the backward runs them anew
            call.drop_outputs()
        rows, call.rows = call.rows, None
        if hooked:
            handoff = torch.empty(0)
            if again:
                handoff.call = call
            ctx.save_for_backward(*rows, handoff)
        ctx.call, ctx.defer, ctx.weights = call, defer, None
        ctx.count, ctx.num_weights = count, len(tensors) - count
        return outputs

    splits_backward = True  # ZB-H1: B the rows' gradients (and every exchange), W the experts' weights'

    @staticmethod
    def backward(ctx, *grads):
        half = getattr(ctx, "split_pass", None)  # "input" (ZB-H1's B), "weight" (its W), None: both
        nothing = (None,) * (4 + ctx.count + ctx.num_weights)
        if half == "weight":  # what B left: each expert's weight gradient, member by member
            weights, ctx.weights = ctx.weights, None
            if weights is not None:
                weights.run()
            return nothing
        call, ctx.call = ctx.call, None
        saved = ctx.saved_tensors if ctx.defer else ()
        handoff = saved[-1] if saved else None
        kept = getattr(handoff, "call", None)
        if kept is not None:  # the recomputation's call, its experts' graph kept
            handoff.call = None
            call, rows = kept, None
        else:
            rows = saved[:-1] if ctx.defer else None
        back, ctx.weights = call.backward(grads, rows, half == "input")
        return (None, None, None, None, *back, *(None,) * ctx.num_weights)


def run_experts(block, xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Each expert of ``block`` on its rows ``xs[e]`` (zero rows: zero rows back)."""
    exchange = getattr(block, "exchange", None) or LOCAL
    weights = [p for e in exchange.computes(len(xs)) for p in block.experts[e].parameters() if p.requires_grad]
    return _Experts.apply(exchange, block, torch.is_grad_enabled(), len(xs), *xs, *weights)


class _Weights:
    """The experts' weight gradients a split backward's B left for W (ZB-H1): each member's rows'
    in turn, each folded alone as the unsplit backward folds them (``fold``)."""

    def __init__(self, fold: Fold | None):
        self.fold, self.passes = fold, []

    def run(self) -> None:
        passes, self.passes = self.passes, []
        for e, weight_pass in passes:
            weight_pass.run()
            if self.fold is not None:
                self.fold(e)


class _Computed:
    """One expert's forward on one member's rows: with its graph kept for the backward (``graph``),
    or, ``defer``, its rows to be handed back to :meth:`backward`, which runs the forward again."""

    def __init__(self, expert, x: torch.Tensor, graph: bool, defer: bool = False):
        self.expert, self.rows = expert, x.shape[0]
        keep = graph and not defer
        self.x = x.detach().requires_grad_(True) if keep else None
        if not x.shape[0]:
            self.y = x.new_zeros(x.shape)
        elif keep:
            with torch.enable_grad():
                self.y = expert(self.x)
        else:
            self.y = expert(x)

    def backward(self, grad: torch.Tensor | None, x: torch.Tensor | None = None,
                 later: _Weights | None = None, e: int = -1) -> torch.Tensor:
        """The rows' input gradient; the expert's weight gradient accumulates into ``.grad`` (with
        ``later``, ZB-H1's B: left to it as expert ``e``'s, for W). ``x``: the rows again, where the
        forward kept no graph."""
        if x is not None:
            self.x = x.detach().requires_grad_(True)
            if self.rows:
                with torch.enable_grad():
                    self.y = self.expert(self.x)
        if self.y is not None and self.y.requires_grad and self.rows:
            grad = grad if grad is not None else torch.zeros_like(self.y)
            if later is None:
                torch.autograd.backward(self.y, grad)
            else:
                weights = [p for p in self.expert.parameters() if p.requires_grad]
                later.passes.append((e, backward_input(self.y, grad, self.x, weights)))
        self.y = None
        grad_x, self.x.grad = self.x.grad, None  # (W keeps the leaf till it runs: not its gradient)
        return grad_x if grad_x is not None else torch.zeros_like(self.x)


class _LocalCall:
    def __init__(self, block, xs, graph, defer: bool, fold: Fold | None):
        self.computed = [_Computed(block.experts[e], x, graph, defer) for e, x in enumerate(xs)]
        self.outputs = [c.y.detach() for c in self.computed]
        self.rows = list(xs)
        self.fold = fold

    def drop_outputs(self) -> None:
        for c in self.computed:
            c.y = None

    def backward(self, grads, rows=None, split: bool = False) -> tuple[list[torch.Tensor], _Weights | None]:
        """The rows' gradients, and (``split``, ZB-H1's B) the weights' left for W."""
        back, later = [], _Weights(self.fold) if split else None
        for e, (c, g) in enumerate(zip(self.computed, grads)):
            back.append(c.backward(g, rows[e] if rows is not None else None, later, e))
            if self.fold is not None and c.rows and not split:
                self.fold(e)
        self.computed = []
        return back, later


class Local:
    """Every expert on this rank. ``fold`` (deterministic mode): each expert's weight gradient is
    folded as soon as it is computed, each micro-batch's (member's) alone -- in W under ZB-H1,
    where the block's norm weights, below the experts, still take theirs after them, so the layer
    is whole (zero/watch.py starts its experts' sums then) only once its experts are."""

    def __init__(self, fold: Fold | None = None):
        self.fold = fold

    def computes(self, num_experts: int) -> range:
        """The experts this rank runs: every one."""
        return range(num_experts)

    def forward(self, block, xs, graph: bool, defer: bool = False) -> _LocalCall:
        return _LocalCall(block, xs, graph, defer, self.fold)


LOCAL = Local()


class AllToAll:
    """A block's experts spread over ``group`` (comm.groups.Group): ``owners[e]`` is the group
    index of the member that computes expert e; ``fold``: see the module's docstring (None in fast
    mode)."""

    def __init__(self, group, owners: Sequence[int], fold: Fold | None = None):
        if max(owners) >= group.size:
            raise ValueError(f"expert owners {list(owners)} name members past the group's {group.size}")
        self.group, self.owners, self.fold = group, tuple(owners), fold
        self.experts_of = [[e for e, o in enumerate(self.owners) if o == m] for m in range(group.size)]
        self.fault: Callable[[str], None] | None = None
        """Called before a training forward's dispatch and combine (fault injection: ``dispatch``,
        ``combine``)."""
        self.clock = None
        """What adds up the time spent in the exchanges (a pipeline Stage's ``waited_s``): not compute."""
        self.sent_bytes = 0
        """Bytes this rank sent other members (tokens and gradients, both ways)."""
        self.rows_seen = torch.zeros(len(self.owners), dtype=torch.float64)
        """Rows routed to each expert by every member since the last :meth:`take_rows`: its load."""

    def take_rows(self) -> list[float]:
        seen, self.rows_seen = self.rows_seen, torch.zeros_like(self.rows_seen)
        return seen.tolist()

    def computes(self, num_experts: int) -> list[int]:
        """The experts this rank runs: those it owns in its group."""
        return self.experts_of[self.group.group_rank]

    def forward(self, block, xs, graph: bool, defer: bool = False) -> "_Call":
        return _Call(self, block, xs, graph, defer)


class _Call:
    """One forward of a block over the group, kept for its backward."""

    def __init__(self, ex: AllToAll, block, xs, graph: bool, defer: bool):
        g, n, E = ex.group, ex.group.size, len(xs)
        self.ex, self.width = ex, xs[0].shape[1]
        self.dtype, self.device = xs[0].dtype, xs[0].device
        mine = ex.experts_of[g.group_rank]
        rows = torch.tensor([x.shape[0] for x in xs], dtype=torch.int64, device=self.device)  # (NCCL: on the GPU)
        counts = torch.empty(n * E, dtype=torch.int64, device=self.device)
        began = time.perf_counter()
        g.all_to_all(counts, rows.repeat(n), [E] * n, [E] * n, "expert counts")
        self._waited(began)
        counts = counts.cpu()
        self.routed = counts.view(n, E).tolist()  # routed[m][e]: member m's rows for expert e
        ex.rows_seen += counts.view(n, E).sum(0).double()
        # What this rank sends member m (its experts' rows, in expert order), and takes from m.
        self.send = [sum(x.shape[0] for e, x in enumerate(xs) if ex.owners[e] == m) for m in range(n)]
        self.take = [sum(self.routed[m][e] for e in mine) for m in range(n)]
        if graph and ex.fault is not None:
            ex.fault("dispatch")
        got = self._exchange([xs[e] for m in range(n) for e in ex.experts_of[m]], self.take, self.send, "dispatch")
        self.computed, at = [], 0
        for m in range(n):  # each member's rows alone: the products the reference computes
            for e in mine:
                count = self.routed[m][e]
                self.computed.append((e, _Computed(block.experts[e], got[at:at + count], graph, defer)))
                at += count
        self.rows = [got]
        if graph and ex.fault is not None:
            ex.fault("combine")
        back = self._exchange([c.y.detach() for _, c in self.computed], self.send, self.take, "combine")
        self.outputs = self._by_expert(back, E)

    def _exchange(self, parts: list[torch.Tensor], out_splits: list[int], in_splits: list[int], what: str):
        inp = (torch.cat(parts) if parts else torch.zeros(0, self.width, dtype=self.dtype, device=self.device))
        out = torch.empty(sum(out_splits), self.width, dtype=self.dtype, device=self.device)
        me = self.ex.group.group_rank
        self.ex.sent_bytes += (sum(in_splits) - in_splits[me]) * self.width * inp.element_size()
        began = time.perf_counter()
        self.ex.group.all_to_all(out, inp.contiguous(), out_splits, in_splits, f"expert {what}")
        self._waited(began)
        return out

    def _waited(self, began: float) -> None:
        if self.ex.clock is not None:
            self.ex.clock.waited_s += time.perf_counter() - began

    def _by_expert(self, came: torch.Tensor, E: int) -> list[torch.Tensor]:
        """What came back from the owners (member order, each member's experts in order) -> by expert."""
        out: list[torch.Tensor | None] = [None] * E
        at, me = 0, self.ex.group.group_rank
        for m in range(self.ex.group.size):
            for e in self.ex.experts_of[m]:
                count = self.routed[me][e]
                out[e] = came[at:at + count]
                at += count
        return out

    def drop_outputs(self) -> None:
        for _, c in self.computed:
            c.y = None

    def backward(self, grads, rows=None, split: bool = False) -> tuple[list[torch.Tensor], _Weights | None]:
        """The rows' gradients, back from their owners, and (``split``, ZB-H1's B) the weight
        gradients of this rank's experts left for W, which exchanges nothing."""
        ex, n, me = self.ex, self.ex.group.size, self.ex.group.group_rank
        E = len(grads)
        grads = [g if g is not None else torch.zeros(self.routed[me][e], self.width, dtype=self.dtype,
                                                     device=self.device) for e, g in enumerate(grads)]
        got = self._exchange([grads[e] for m in range(n) for e in ex.experts_of[m]], self.take, self.send,
                             "gradient dispatch")
        at, back, later = 0, [], _Weights(ex.fold) if split else None
        for e, c in self.computed:  # member by member, expert by expert, as the forward
            count = c.rows
            back.append(c.backward(got[at:at + count], rows[0][at:at + count] if rows is not None else None, later, e))
            at += count
            if ex.fold is not None and count and not split:
                ex.fold(e)
        self.computed = []
        return self._by_expert(self._exchange(back, self.send, self.take, "gradient combine"), E), later
