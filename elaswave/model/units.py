"""A model's *units*: the pieces of its trainable values each kept as one flat vector, summed over
its holders, cut into ZeRO chunks, snapshotted and moved whole or by chunk.

Unit ``l`` below ``num_layers`` is layer ``l`` without its experts -- the whole layer for a dense
one, so a dense model's units are its layers and nothing about it changes. Each expert of a
mixture-of-experts block is a unit of its own, numbered after the layers in (layer, expert) order:
an expert can then be held by the ranks that compute it (its owners, plan/experts.py) rather than
by every holder of its layer. ``params_sha256`` is over the units in this order.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Collection

from torch import nn

from elaswave.model.contract import on_meta, untie
from elaswave.model.moe import SparseMoE
from elaswave.zero.flat import FlatLayer


@dataclass(frozen=True)
class Units:
    num_layers: int
    experts: tuple[tuple[int, int], ...]
    """(layer, expert) of unit ``num_layers + k``, in layer order."""
    numels: tuple[int, ...]
    """Trainable values of each unit (ties left with their owner)."""

    @property
    def count(self) -> int:
        return self.num_layers + len(self.experts)

    @property
    def expert_layers(self) -> tuple[int, ...]:
        """The layer of each expert unit (:attr:`~elaswave.plan.plan.Plan.unit_layers`)."""
        return tuple(layer for layer, _ in self.experts)

    def layer_of(self, unit: int) -> int:
        return unit if unit < self.num_layers else self.experts[unit - self.num_layers][0]

    @cached_property
    def _experts_of(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for k, (layer, _) in enumerate(self.experts):
            out.setdefault(layer, []).append(self.num_layers + k)
        return out

    def of_layer(self, layer: int) -> list[int]:
        """Layer ``layer``'s units: itself, then its experts'."""
        return [layer, *self._experts_of.get(layer, ())]

    @property
    def layer_numels(self) -> tuple[int, ...]:
        """Each layer's values, its experts' included (what a stage holding all of them holds)."""
        out = list(self.numels[:self.num_layers])
        for (layer, _), n in zip(self.experts, self.numels[self.num_layers:]):
            out[layer] += n
        return tuple(out)


def units_of(model, seed: int = 0) -> Units:
    """The model's units, counted from its layers built on the meta device (once per model)."""
    cached = model.__dict__.get("_elaswave_units")
    if cached is not None:
        return cached
    dense, experts, expert_numels = [], [], []
    with on_meta():
        for i in range(model.num_layers):
            layer = model.build_layer(i, seed, init=False)
            untie(model, layer, i)
            inside = experts_in(layer)
            skip = {id(p) for e in inside for p in e.parameters()}
            dense.append(sum(p.numel() for p in layer.parameters() if p.requires_grad and id(p) not in skip))
            for e, expert in enumerate(inside):
                experts.append((i, e))
                expert_numels.append(sum(p.numel() for p in expert.parameters() if p.requires_grad))
    out = Units(model.num_layers, tuple(experts), tuple(dense + expert_numels))
    model.__dict__["_elaswave_units"] = out
    return out


def experts_in(module: nn.Module) -> list[nn.Module]:
    """The experts of every MoE block inside ``module``, in order."""
    return [e for block in module.modules() if isinstance(block, SparseMoE) for e in block.experts]


def flat_units(module: nn.Module, layer: int, units: Units, held: Collection[int] | None = None) -> list[FlatLayer]:
    """Layer ``layer`` (built as ``module``) as its units' flat vectors: itself without its
    experts, then each expert -- of those in ``held`` only (None: all; the others' values the
    caller has dropped: :func:`drop_experts`)."""
    inside = experts_in(module)
    if not inside:
        return [FlatLayer(module, layer)]
    ids = units.of_layer(layer)
    if len(ids) != len(inside) + 1:
        raise AssertionError(f"layer {layer} has {len(inside)} experts, its units say {len(ids) - 1}")
    skip = {id(p) for e in inside for p in e.parameters()}
    experts = []
    for e, (u, expert) in enumerate(zip(ids[1:], inside)):
        if held is None or u in held:
            experts.append(FlatLayer(expert, u))
            experts[-1].label = f"layer {layer} expert {e}"
    return [FlatLayer(module, layer, skip), *experts]


def drop_experts(module: nn.Module, layer: int, units: Units, held: Collection[int] | None) -> None:
    """Free the values of the experts of ``module`` (layer ``layer``) whose units are not in
    ``held`` (another rank of the expert-parallel group owns them and computes them: its exchange
    never runs them here). Their tensors stay, empty, so the module keeps its names."""
    if held is None:
        return
    for u, expert in zip(units.of_layer(layer)[1:], experts_in(module)):
        if u not in held:
            for p in expert.parameters():
                p.data = p.data.new_empty(0)


def layer_units(model, layer: int, seed: int, init: bool = True) -> list[FlatLayer]:
    """Layer ``layer`` built afresh (keyed init, or its folder's weights), as its units."""
    module = model.build_layer(layer, seed, init=init)
    untie(model, module, layer)  # a tied tensor's values are its owner layer's
    return flat_units(module, layer, units_of(model, seed))
