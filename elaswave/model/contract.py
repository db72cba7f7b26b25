"""The model contract: everything outside ``elaswave/model/`` sees a model only through this.

A model is an ordered list of layers. Layer ``i`` can be built alone (a stage builds only its own),
and initialises itself from its own keyed stream ``(seed, INIT, i)`` -- or reads its own tensors
from a checkpoint -- so any placement holds the same weights. Each layer's ``forward(x, gen)`` takes
the previous layer's output (layer 0: token ids) and a dropout generator keyed by
``(seed, DROPOUT, step, micro-batch, layer)`` (``None`` in evaluation). The last layer returns
logits, and :meth:`Model.loss_sum` turns them into the micro-batch's summed token loss.

Costs per layer (forward multiply-adds per token, parameter count) are what the planner balances
stages by, what ``parallel.stage_memory_mb`` is checked against, and what the simulator prices.

A *tie* declares that a parameter of one layer (the user) is the same logical tensor as a parameter
of another (the owner), e.g. a tied input embedding and output head. The owner's flat vector holds
it; it has one gradient sum (both uses), one optimizer state and one set of ZeRO chunks. A rank
holding the user holds the owner's layer too (not run, only to keep the tensor), and the owner's
holder group includes it, so the gradient of every use is reduced into the one sum.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from elaswave.errors import ConfigError


@dataclass(frozen=True)
class LayerCost:
    flops_per_token: float
    """Forward multiply-adds per token (a backward costs about twice)."""
    num_params: int
    """Parameters this layer's flat vector holds (a tied tensor counts with its owner only)."""
    core_flops_per_token: float = 0.0
    """Of ``flops_per_token``, the attention core's (scores and the weighted sum of values): what
    selective recomputation runs again in the backward."""


@dataclass(frozen=True)
class Tie:
    owner: int
    owner_param: str
    """Parameter name inside the owner layer's module (``named_parameters`` order)."""
    user: int
    user_param: str
    """Parameter name inside the user layer's module; the user's own copy is discarded."""


@runtime_checkable
class Model(Protocol):
    num_layers: int
    seq_len: int
    hidden_size: int
    """Width of the activation one stage sends the next: ``[batch, seq_len, hidden_size]``."""
    vocab_size: int
    ties: tuple[Tie, ...]

    def build_layer(self, index: int, seed: int, init: bool = True) -> nn.Module:
        """Layer ``index``, initialised (``init=False``: shapes only, e.g. on the meta device)."""

    def layer_costs(self) -> Sequence[LayerCost]:
        """One per layer, in layer order."""

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The micro-batch's token losses, summed (callers divide by the global count of loss
        tokens). A target of -100 (``elaswave.data.sampler.IGNORE``: masked by the corpus) is not a
        loss token: ``torch.nn.functional.cross_entropy``'s default ``ignore_index`` skips it."""

    def identity(self) -> dict:
        """What a checkpoint must match to load into this model (JSON-ready)."""


REQUIRED = ("num_layers", "seq_len", "hidden_size", "vocab_size", "ties", "build_layer", "layer_costs",
            "loss_sum", "identity")


class ModelContractError(ConfigError):
    """A model (e.g. from ``model.factory``) does not follow the contract; the message says how."""


def check(model: object, where: str) -> "Model":
    """``model`` if it has every part of the contract, else one error naming what is missing."""
    missing = [name for name in REQUIRED if not hasattr(model, name)]
    if missing:
        raise ModelContractError(f"{where} returned a {type(model).__name__} that lacks {', '.join(missing)} "
                                 f"of the model contract (see docs/models.md)")
    if model.num_layers < 2:
        raise ModelContractError(f"{where}: num_layers={model.num_layers} must be >= 2 (first layer takes token ids, "
                                 "last returns logits)")
    costs = list(model.layer_costs())
    if len(costs) != model.num_layers:
        raise ModelContractError(f"{where}: layer_costs() gave {len(costs)} entries for {model.num_layers} layers")
    for tie in model.ties:
        if not (0 <= tie.owner < model.num_layers and 0 <= tie.user < model.num_layers) or tie.owner == tie.user:
            raise ModelContractError(f"{where}: tie {tie} must join two different layers in 0..{model.num_layers - 1}")
    counted = counted_numels(model)
    declared = [c.num_params for c in costs]
    if counted != declared:
        raise ModelContractError(f"{where}: layer_costs() declares {declared} parameters per layer, the built layers "
                                 f"hold {counted} (ties counted with their owner)")
    return model


def tie_pairs(model: "Model") -> tuple[tuple[int, int], ...]:
    """(owner, user) layer pairs: what the planner needs to know of ties."""
    return tuple(sorted({(t.owner, t.user) for t in model.ties}))


class _Unfilled(torch.overrides.TorchFunctionMode):
    """``torch.nn.init``'s fills skipped. A meta tensor holds no values, and on the meta device each
    fill runs through a Python reference that imports torch._dynamo: 2.6 s of every rank's start-up
    (measured), for a layer built only to be counted."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta():
    """Build modules on the meta device (shapes only), their initialisers skipped."""
    with torch.device("meta"), _Unfilled():
        yield


def counted_numels(model: "Model", seed: int = 0) -> list[int]:
    """Parameters of each layer counted from its built module (meta device), ties left with their owner."""
    out = []
    with on_meta():
        for i in range(model.num_layers):
            layer = model.build_layer(i, seed, init=False)
            untie(model, layer, i)
            out.append(sum(p.numel() for p in layer.parameters() if p.requires_grad))
    return out


def untie(model: "Model", layer: nn.Module, index: int) -> list[tuple[Tie, nn.Module, str, torch.Size]]:
    """Remove from ``layer`` (layer ``index``) the parameters a tie says are another layer's, so
    that only its own are left; returns (tie, parent module, name, shape) for each to re-attach."""
    slots = []
    for t in model.ties:
        if t.user != index:
            continue
        path, _, name = t.user_param.rpartition(".")
        try:
            parent = layer.get_submodule(path)
            shape = parent._parameters[name].shape
        except (AttributeError, KeyError):
            raise ModelContractError(f"tie {t}: layer {index} ({type(layer).__name__}) has no parameter "
                                     f"{t.user_param!r}") from None
        del parent._parameters[name]
        slots.append((t, parent, name, shape))
    return slots


class _FusedAttention(torch.autograd.Function):
    """Shapes only: what a flash / memory-efficient attention kernel keeps for its backward (q, k,
    v, the output and a float32 log-sum-exp per head and query), which no meta-device kernel has."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        ctx.save_for_backward(q, k, v, out, torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device))
        return out


class _PricedAsFused(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention:
            return _FusedAttention.apply(*args[:3])
        return func(*args, **(kwargs or {}))


def saved_activation_bytes(model: "Model", micro_batch_size: int, dtype: torch.dtype,
                           fused_kernel: bool = False, selective: bool = False) -> list[int]:
    """Bytes autograd keeps from one micro-batch's forward of each layer until its backward (the
    last layer's loss included), parameters not counted: measured, not declared, by running each
    layer once on the meta device under saved-tensor hooks -- any model that follows the contract
    gets its figures this way, at no cost in memory or time (a 70B layer runs as shapes only).
    ``fused_kernel``: price ``scaled_dot_product_attention`` as the fused GPU kernel keeps it
    (otherwise as the meta device runs it: the math path, with the whole attention matrix).
    ``selective``: each attention keeps only its core's inputs (:mod:`elaswave.model.recompute`)."""
    from elaswave.model import recompute

    out = []
    for i in range(model.num_layers):
        with on_meta():
            layer = model.build_layer(i, 0, init=False)
        for _, parent, name, shape in untie(model, layer, i):  # a tied tensor: the owner's, not an activation
            setattr(parent, name, nn.Parameter(torch.empty(shape, device="meta")))
        layer.to(dtype)
        recompute.select(layer, selective)
        params = {id(p) for p in layer.parameters()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            base = t._base if t._base is not None else t
            if id(t) not in params and id(base) not in params:
                seen[id(base)] = base.untyped_storage().nbytes()
            return t

        b, T = micro_batch_size, model.seq_len
        x = (torch.zeros(b, T, dtype=torch.long, device="meta") if i == 0 else
             torch.zeros(b, T, model.hidden_size, dtype=dtype, device="meta", requires_grad=True))
        gen = torch.Generator()  # dropout draws on the meta device cost nothing; the masks' shapes count
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                    (_PricedAsFused() if fused_kernel else contextlib.nullcontext()):
                y = layer(x, gen)
                if i == model.num_layers - 1:
                    model.loss_sum(y, torch.zeros(b, T, dtype=torch.long, device="meta"))
        except Exception as exc:  # the user's layer: its failure in one line
            raise ModelContractError(f"layer {i} ({type(layer).__name__}) cannot run on the meta device, which "
                                     f"measures its activation memory ({type(exc).__name__}: {exc}); "
                                     "set parallel.stage_memory_mb=off to plan without it") from None
        out.append(sum(seen.values()))
    return out
