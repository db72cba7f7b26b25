"""ZB-H1's split backward: B, the gradient of a stage's input alone, now; W, its weights', later.

Both halves are autograd's own backward of the micro-batch's graph, cut in two at the nodes where
a weight's branch leaves the input's path (the *boundary*: the matmul of a linear layer, the
product of a norm's weight). B runs autograd towards the input only, keeping the graph and
recording the gradient flowing into each boundary node. W restarts autograd at each boundary node
with that gradient, asking only for the weights on its own branch: autograd then computes only
the node's weight-side outputs (a matmul's dW, not its dX again), and B + W do the work of one
whole backward. Every kernel runs on the same tensors as in one whole backward, and W accumulates
through the weights' own AccumulateGrad nodes (their hooks included), so each weight's gradient
has the bits one backward would give. (torch.distributed.pipelining's ``_backward.py`` splits by
parameter groups the same way.)

Two exceptions. A recomputed layer (activation checkpointing) runs its forward again in every
autograd call that reads it, so its boundary nodes are restarted together in one call (pinned to
B's gradients, so nothing is counted twice): that call also redoes the layer's own input gradient,
as the previous all-in-one W did. And a weight reached from two boundary nodes (a tensor used at
two places of a stage) would take its gradient in two calls, summed in another order than one
backward's: refused. The built-in families never do this on a stage that has a B (their only tie
is the embedding's, and layer 0 runs on the first stage, which has no B).

A stage whose input carries no gradient (the first: token ids) has no B: its W is the whole
backward. A custom autograd Function on a boundary would compute every gradient in each half; one
that declares ``splits_backward`` (the tensor-parallel products of :mod:`elaswave.tensor.ops`,
whose backward holds a collective) is told which half runs (``split_pass`` on its node: "input"
in B, "weight" in W) and computes that half's gradients and collectives only. Every rank of a
tensor-parallel group runs the same B and W in the same order, so their collectives match.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class _Restart:
    """One autograd call of W: boundary nodes with the gradients B saw flow into them, and the
    weights on their branches (in the stage's weight order)."""
    boundary: list[tuple[Node, tuple]]
    weights: list[torch.Tensor]


class WeightPass:
    """What W needs from one B: its autograd calls (or, on a stage without an input gradient, the
    whole backward's root and its gradient)."""

    def __init__(self, restarts: list[_Restart], whole: tuple | None = None):
        self.restarts = restarts
        self.whole = whole

    def held_bytes(self) -> int:
        """Bytes B keeps for W beside the graph: the gradients that flowed into the boundary (or,
        without a B, the one into the stage's output)."""
        grads = [g for r in self.restarts for _, flowing in r.boundary for g in flowing if g is not None]
        if self.whole is not None and self.whole[1] is not None:
            grads.append(self.whole[1])
        return sum(g.numel() * g.element_size() for g in grads)

    def run(self) -> None:
        """Accumulate the weights' gradients into their ``.grad`` as one whole backward would, and
        free the graph. Runs once."""
        if self.whole is not None:
            out, grad = self.whole
            self.whole = None
            if out.requires_grad:  # not on a stage of frozen weights only (LoRA's embedding): no graph
                torch.autograd.backward(out, grad)
            return
        restarts, self.restarts = self.restarts, []  # the graph below the boundary goes with them
        while restarts:
            # The last layers first, as a whole backward runs them: their sums can start while W
            # goes on (zero/watch.py). Each restart gives its own weights alone: any order, same bits.
            r = restarts.pop()
            edges = [(GradientEdge(node, i), g) for node, flowing in r.boundary for i, g in enumerate(flowing)
                     if g is not None]
            if not edges:
                continue
            # Several nodes in one call (a recomputed layer's): the upper ones' input gradients reach
            # the lower ones; pin each to what it received in B, so nothing is counted twice.
            handles = [] if len(r.boundary) == 1 else [
                node.register_prehook(lambda _, flowing=flowing: flowing) for node, flowing in r.boundary]
            try:
                torch.autograd.backward([e for e, _ in edges], [g for _, g in edges], inputs=r.weights)
            finally:
                for h in handles:
                    h.remove()


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor | None,
                   weights: Sequence[torch.Tensor], together: Sequence[Sequence[torch.Tensor]] = ()) -> WeightPass:
    """B of one computation: ``out`` (with ``grad`` flowing into it, or the loss: None) back to
    ``x``, the stage's input, whose ``.grad`` it accumulates into as a whole backward would.
    Returns the W still to run for ``weights``. ``together``: groups of weights W takes in one
    autograd call (each recomputed layer's)."""
    if x is None or not x.requires_grad:
        return WeightPass([], whole=(out, grad))
    parents = _parents(out.grad_fn)
    x_node = get_gradient_edge(x).node
    if x_node not in parents:  # the output does not depend on the input: nothing for B to do
        return WeightPass([], whole=(out, grad))
    on_input_path = _above({x_node}, parents)
    reached = [w for w in weights if w.requires_grad and get_gradient_edge(w).node in parents]
    _refuse_aliases(reached)
    boundary_nodes = _boundary([get_gradient_edge(w).node for w in reached], on_input_path, parents)
    branches = _branches(boundary_nodes, reached, on_input_path)
    flowing: dict[Node, tuple] = {}
    handles = [n.register_prehook(lambda g, n=n: flowing.__setitem__(n, g)) for n in boundary_nodes]
    split = [n for n in boundary_nodes if getattr(getattr(type(n), "_forward_cls", None), "splits_backward", False)]
    for n in split:
        n.split_pass = "input"
    try:
        torch.autograd.backward(out, grad, inputs=[x], retain_graph=True)
    finally:
        for h in handles:
            h.remove()
        for n in split:
            n.split_pass = "weight"
    return WeightPass(_restarts([n for n in boundary_nodes if n in flowing], flowing, branches, reached, together))


def _restarts(nodes: list[Node], flowing: dict[Node, tuple], branches: dict[Node, list[torch.Tensor]],
              reached: list[torch.Tensor], together: Sequence[Sequence[torch.Tensor]]) -> list[_Restart]:
    """One restart per boundary node, in the nodes' order, except that the nodes whose weights are
    in one ``together`` group share one (grouping only saves recomputation: any grouping gives the
    same bits)."""
    group = {id(w): k for k, ws in enumerate(together) for w in ws}
    order = {id(w): i for i, w in enumerate(reached)}
    restarts: dict[object, _Restart] = {}
    for node in nodes:
        ws = branches[node]
        key = min((group[id(w)] for w in ws if id(w) in group), default=node)
        r = restarts.setdefault(key, _Restart([], []))
        r.boundary.append((node, flowing[node]))
        r.weights = sorted(r.weights + ws, key=lambda w: order[id(w)])
    return list(restarts.values())


def _branches(boundary_nodes: list[Node], reached: list[torch.Tensor],
              on_input_path: set[Node]) -> dict[Node, list[torch.Tensor]]:
    """Each boundary node -> the weights on its branch off the input's path (in ``reached``'s
    order). Raises ValueError if a node of one branch is also on another's: a weight used at two
    places of the stage, whose two gradients one backward sums before accumulating once."""
    weight_of = {get_gradient_edge(w).node: w for w in reached}
    order = {id(w): i for i, w in enumerate(reached)}
    owner: dict[Node, Node] = {}
    branches: dict[Node, list[torch.Tensor]] = {}
    for b in boundary_nodes:
        queue = deque(c for c, _ in b.next_functions if c is not None and c not in on_input_path)
        found = []
        while queue:
            node = queue.popleft()
            if node in owner:
                if owner[node] is b:  # met again on this branch
                    continue
                raise ValueError("parallel.schedule=zb-h1: a weight is used at two places of this stage "
                                 f"({owner[node].name()} and {b.name()} both reach {node.name()}), so one "
                                 "backward sums its gradients before accumulating them, which W cannot "
                                 "split bit-exactly; use parallel.schedule=1f1b")
            owner[node] = b
            if node in weight_of:
                found.append(weight_of[node])
            queue.extend(c for c, _ in node.next_functions if c is not None)
        branches[b] = sorted(found, key=lambda w: order[id(w)])
    return branches


def _refuse_aliases(reached: list[torch.Tensor]) -> None:
    """A tie whose owner and user both run on this stage: two leaves over the same values whose
    gradients may be summed into one place (the layer's float32 sum) in W's order, not one
    backward's. The built-in families' ties never run both halves on a stage with a B."""
    seen: set[tuple[int, int]] = set()
    for w in reached:
        at = (w.untyped_storage().data_ptr(), w.storage_offset())
        if w.numel() and at in seen and not w.is_meta:  # (meta tensors share no values: every address is 0)
            raise ValueError("parallel.schedule=zb-h1: a tied tensor's owner and user both run on this stage, "
                             "whose gradients W cannot sum in one backward's order; use parallel.schedule=1f1b")
        seen.add(at)


def _parents(root: Node) -> dict[Node, list[Node]]:
    """Every node of the graph under ``root`` -> the nodes whose gradient flows into it."""
    parents: dict[Node, list[Node]] = defaultdict(list)
    parents[root] = []
    queue = deque([root])
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                queue.append(child)
            parents[child].append(node)
    return dict(parents)


def _above(nodes: set[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """``nodes`` and every node whose gradient flows into one of them."""
    seen, queue = set(nodes), deque(nodes)
    while queue:
        for p in parents[queue.popleft()]:
            if p not in seen:
                seen.add(p)
                queue.append(p)
    return seen


def _boundary(weight_nodes: list[Node], on_input_path: set[Node], parents: dict[Node, list[Node]]) -> list[Node]:
    """The nodes of the input's path through which a gradient reaches a weight, in an order fixed
    by the weights' (W's roots are then the same on every run; a set's order is the nodes' ids)."""
    found: dict[Node, None] = {}
    seen, queue = set(weight_nodes), deque(dict.fromkeys(weight_nodes))
    while queue:
        for p in parents[queue.popleft()]:
            if p in on_input_path:
                found.setdefault(p)
            elif p not in seen:
                seen.add(p)
                queue.append(p)
    return list(found)


def held_for_w_bytes(model, micro_batch_size: int, dtype: torch.dtype) -> list[int]:
    """Per layer, the bytes one micro-batch's B keeps for its W beside the activations (the memory
    model's, plan/memory.py): the gradients flowing into its weights' boundary nodes, measured by
    running each layer's B on the meta device (0 for layer 0, whose stage has no B: its W is the
    whole backward, which keeps only the gradient into the stage's output)."""
    from elaswave.model.contract import on_meta, untie

    out = [0]
    b, t = micro_batch_size, model.seq_len
    for i in range(1, model.num_layers):
        with on_meta():
            layer = model.build_layer(i, 0, init=False)
        for _, parent, name, shape in untie(model, layer, i):
            setattr(parent, name, torch.nn.Parameter(torch.empty(shape, device="meta")))
        layer.to(dtype)
        x = torch.zeros(b, t, model.hidden_size, dtype=dtype, device="meta", requires_grad=True)
        y = layer(x, torch.Generator())
        if i == model.num_layers - 1:
            y, grad = model.loss_sum(y, torch.zeros(b, t, dtype=torch.long, device="meta")), None
        else:
            grad = torch.zeros_like(y)
        weights = [w for w in layer.parameters() if w.requires_grad]
        out.append(backward_input(y, grad, x, weights).held_bytes())
    return out
