"""A mixture of experts' load-balancing loss across the stages of a pipeline.

The loss couples every MoE block a forward passes (:mod:`elaswave.model.moe`): its value needs each
block's summed router probabilities and all blocks' assignments, and each block's gradient the
forward's total assignments ``n`` and rows ``R``. So the statistics travel with the forward -- the
assignments so far and each block's summed probabilities, stage to stage beside the activation --
and the total assignments travel back beside the gradient. Each stage's blocks then take, in
their backward, the gradient of the very expression the single-process reference differentiates
(the other stages' blocks as constants): the same products in the same order, so the same bits.

Under interleaved 1F1B a micro-batch passes each rank once per model chunk, so what a rank keeps
of it is kept by (micro-batch, chunk): the chunks are virtual stages like any.

One row of statistics per piece of a micro-batch (a reshaped micro-batch's units are forwards of
their own), float32 whatever the compute dtype (counts are integers that bf16 would round), kept on
the device: no block's statistics wait for the host. A forward's rows over every block, ``R``, are
known without them: every MoE block sees the piece's ``sequences x seq_len`` tokens.
"""
from __future__ import annotations

import torch

from elaswave.model.moe import aux_of, num_moe_blocks, weighted


class BalanceRelay:
    """``step_rows``: sequences in the step's global batch (a forward's weight is its share)."""

    def __init__(self, model, step_rows: int, device: torch.device = torch.device("cpu")):
        m = model.cfg
        self.E, self.L, self.coef, self.step_rows = m.num_experts, num_moe_blocks(m), m.moe_aux_loss_coef, step_rows
        self.seq_len, self.device = m.seq_len, device
        self.forward_width = self.E + self.L * self.E
        """A forward's row: its assignments so far (E), each block's summed probabilities (L x E)."""
        self.backward_width = self.E
        """A backward's row: the forward's assignments over every block."""
        self.reset()

    def reset(self) -> None:
        self._arrived: dict[tuple[int, int], torch.Tensor] = {}
        self._own: dict[tuple[int, int, int], list] = {}
        self._going: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._totals: dict[tuple[int, int], torch.Tensor] = {}

    # -- the forward ---------------------------------------------------------------------------
    # ``chunk``: the model chunk that receives, computes or sends (0 without chunks).
    def arrived(self, mb: int, rows: torch.Tensor, chunk: int = 0) -> None:
        """The (virtual) stage before's rows for ``mb`` (``[pieces, forward_width]``)."""
        self._arrived[(mb, chunk)] = rows

    def forwarded(self, mb: int, piece: int, record: list, chunk: int = 0) -> torch.Tensor:
        """This chunk's blocks (``record``) folded into piece ``piece``'s row; returns the row."""
        E, at = self.E, (mb, chunk)
        row = (self._arrived[at][piece].clone() if at in self._arrived
               else torch.zeros(self.forward_width, dtype=torch.float32, device=self.device))
        for counts, probs, _, ordinal in record:
            row[:E] += counts
            row[E + ordinal * E:E + (ordinal + 1) * E] = probs.detach().float()
        self._own[(mb, chunk, piece)] = record
        self._going.setdefault(at, []).append(row)
        return row

    def outgoing(self, mb: int, chunk: int = 0) -> torch.Tensor:
        """What goes with ``mb``'s activation to the next (virtual) stage."""
        self._arrived.pop((mb, chunk), None)
        return torch.stack(self._going.pop((mb, chunk)))

    def loss_term(self, mb: int, piece: int, rows: int, chunk: int = 0) -> tuple[torch.Tensor | None, float]:
        """On the last stage, once the piece's forward is folded in: its term in the objective (with
        this chunk's blocks' graph) and the load-balancing loss's value; keeps the totals to send back."""
        row = self._going[(mb, chunk)][piece]
        counts, total = row[:self.E], self.L * rows * self.seq_len
        value = float(aux_of(counts, row[self.E:].view(self.L, self.E).sum(0), total, self.E))
        return self._term(mb, chunk, piece, counts, total, rows), value

    def last_forward_done(self, mb: int, chunk: int = 0) -> None:
        """On the last stage, after every piece of ``mb``: its totals wait for the gradient's send."""
        self._arrived.pop((mb, chunk), None)
        self._totals[(mb, chunk)] = torch.stack([row[:self.E] for row in self._going.pop((mb, chunk))])

    # -- the backward --------------------------------------------------------------------------
    def totals_arrived(self, mb: int, rows: torch.Tensor, chunk: int = 0) -> None:
        self._totals[(mb, chunk)] = rows

    def surrogate(self, mb: int, piece: int, rows: int, chunk: int = 0) -> torch.Tensor | None:
        """The term whose gradient this chunk's blocks take in ``mb``'s backward (None: none here)."""
        return self._term(mb, chunk, piece, self._totals[(mb, chunk)][piece], self.L * rows * self.seq_len, rows)

    def returning(self, mb: int, chunk: int = 0) -> torch.Tensor:
        """What goes with ``mb``'s gradient to the (virtual) stage before."""
        return self._totals.pop((mb, chunk))

    def _term(self, mb: int, chunk: int, piece: int, counts: torch.Tensor, total: int,
              rows: int) -> torch.Tensor | None:
        record = self._own.pop((mb, chunk, piece), [])
        if not record or not self.coef:
            return None
        probs = [torch.zeros(self.E, dtype=torch.float32, device=self.device)] * self.L
        for _, p, _, ordinal in record:
            probs[ordinal] = p
        return weighted(self.coef, aux_of(counts, torch.stack(probs).sum(0), total, self.E), rows, self.step_rows)
