"""Mixture-of-experts blocks of the Llama family, as transformers computes them: Mixtral, Qwen2-MoE
(with its gated shared expert) and Qwen3-MoE.

A router (``gate``, no bias) scores every expert; the softmax (in float32) picks the top k, whose
probabilities are renormalised to sum to one where the family says so (Mixtral always;
``norm_topk_prob`` for Qwen). Dropless: every expert runs on every token routed to it, none is
dropped for capacity, so nothing depends on where experts are placed. Experts are kept as Hugging
Face's checkpoints name them (``experts.{e}.w1/w2/w3`` for Mixtral under ``block_sparse_moe``,
``experts.{e}.gate_proj/up_proj/down_proj`` for Qwen under ``mlp``), so folders map onto them by
name, as the dense layers do.

The load-balancing loss (Switch Transformer's, transformers' ``load_balancing_loss_func``) couples
every MoE layer a micro-batch passes: ``E * sum_e (n_e / R) (P_e / R)`` with ``n_e`` the top-k
assignments to expert e over all those layers' tokens, ``P_e`` their router probabilities summed
and ``R`` their rows. Each MoE block records its ``n`` and ``P`` (with its graph) in the routing
record of the forward it runs in (:func:`recording`); the stage that computes the loss reads it.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from elaswave.expert.exchange import run_experts

_RECORD: list | None = None
"""The routing record of the forward under way (None: none is kept, e.g. a recomputation)."""


@contextlib.contextmanager
def recording():
    """Collect the routing statistics of the MoE blocks that run inside: ``(counts, probs, rows,
    ordinal)`` per block (``ordinal``: its place among the model's MoE blocks), ``probs`` with its
    graph (the load-balancing loss's gradient flows through it)."""
    global _RECORD
    outer, _RECORD = _RECORD, []
    try:
        yield _RECORD
    finally:
        _RECORD = outer


def aux_loss(record: list, num_experts: int) -> torch.Tensor | None:
    """transformers' load-balancing loss over the blocks of one forward (None: no MoE block ran)."""
    if not record:
        return None
    return aux_of(torch.stack([c for c, *_ in record]).sum(0), torch.stack([p for _, p, *_ in record]).sum(0),
                  sum(r for _, _, r, _ in record), num_experts)


def aux_of(counts: torch.Tensor, probs: torch.Tensor, rows: int, num_experts: int) -> torch.Tensor:
    """``E * sum_e (n_e / R) (P_e / R)``: assignments and summed probabilities over all blocks."""
    return torch.sum((counts / rows) * (probs / rows)) * num_experts


def num_moe_blocks(m) -> int:
    return m.moe_blocks_before(m.num_blocks)


class Expert(nn.Module):
    """A SwiGLU MLP under the family's names: (gate, up, down)."""

    def __init__(self, d: int, f: int, names: tuple[str, str, str], bias: bool = False):
        super().__init__()
        self.names = names
        for name, (i, o) in zip(names, ((d, f), (d, f), (f, d))):
            setattr(self, name, nn.Linear(i, o, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(F.silu(gate(x)) * up(x))


NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen": ("gate_proj", "up_proj", "down_proj")}
"""An expert's (gate, up, down) projections as each family's checkpoints name them."""


class SparseMoE(nn.Module):
    def __init__(self, m, ordinal: int = 0):
        super().__init__()
        self.num_experts, self.top_k, self.normalize = m.num_experts, m.experts_per_token, m.moe_norm_topk
        self.ordinal = ordinal
        self.exchange = None
        """Where its experts compute (expert/exchange.py; None: all here)."""
        self.routed = torch.zeros(m.num_experts, dtype=torch.float64)
        """Assignments of this rank's training tokens to each expert since :meth:`take_counts`."""
        self.gate = nn.Linear(m.d_model, m.num_experts, bias=False)
        names = NAMES[m.moe_names]
        self.experts = nn.ModuleList(Expert(m.d_model, m.expert_ffn_width, names) for _ in range(m.num_experts))
        if m.shared_expert_ffn_dim:
            self.shared_expert = Expert(m.d_model, m.shared_expert_ffn_dim, NAMES["qwen"])
            self.shared_expert_gate = nn.Linear(m.d_model, 1, bias=False)

    def forward(self, x: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        logits = self.gate(h)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        top = top.to(h.dtype)
        out = torch.zeros_like(h)
        if h.is_meta:
            # On the meta device (the memory model: shapes only) no routing can be read: each expert
            # runs on its even share of the assignments, what a balanced router gives it.
            share = -(-h.shape[0] * self.top_k // self.num_experts)
            token, slot = torch.arange(share, device=h.device), torch.zeros(share, dtype=torch.long, device=h.device)
            for expert in self.experts:
                out.index_add_(0, token, expert(h[token]) * top[token, slot, None])
        else:
            routed = [torch.where(chosen == e) for e in range(self.num_experts)]
            # Each expert on its tokens only (dropless), wherever it is placed (expert/exchange.py);
            # weighed and added here, in expert order.
            ys = run_experts(self, [h[token] for token, _ in routed])
            for (token, slot), y in zip(routed, ys):
                if token.numel():
                    out.index_add_(0, token, y * top[token, slot, None])
            if not h.shape[0]:  # a ghost micro-batch (no rows): the exchanges' backward must still run
                out = out + sum(y.sum() for y in ys)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        if _RECORD is not None:
            counts = (torch.zeros(self.num_experts, device=h.device) if h.is_meta else
                      torch.bincount(chosen.reshape(-1), minlength=self.num_experts).to(torch.float32))
            _RECORD.append((counts, probs.sum(dim=0), h.shape[0], self.ordinal))
            if not h.is_meta:  # a training forward's, not its recomputation's (which keeps no record)
                self.routed += counts.double().cpu()
        return out.reshape(shape)


def take_counts(block: SparseMoE) -> torch.Tensor:
    counts, block.routed = block.routed, torch.zeros_like(block.routed)
    return counts


def balance_term(record: list, model, rows: int, step_rows: int) -> tuple[torch.Tensor | None, float | None]:
    """What one forward's MoE blocks (``record``) add to the step's objective, and the value of
    their load-balancing loss (None, None: no MoE block ran). The step's objective is the mean token
    loss of the global batch plus ``moe_aux_loss_coef`` times the mean of the forwards' losses,
    each forward weighted by its ``rows`` of the step's ``step_rows`` sequences: the same sum
    however the sequences are dealt to pipelines or cut into units."""
    m = getattr(model, "cfg", None)
    aux = aux_loss(record, m.num_experts) if getattr(m, "num_experts", 0) else None
    if aux is None:
        return None, None
    return weighted(m.moe_aux_loss_coef, aux, rows, step_rows), float(aux.detach())


def weighted(coef: float, aux: torch.Tensor, rows: int, step_rows: int) -> torch.Tensor | None:
    """A forward's load-balancing loss as its share of the step's objective (None: coefficient 0).
    One expression for the reference and every pipeline stage: the same float operations, so the
    same gradient bits."""
    return coef * aux * (rows / step_rows) if coef else None
