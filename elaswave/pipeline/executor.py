"""Runs one step's schedule on a stage through a dispatch table, one handler per action.

What a micro-batch leaves between actions (its input, outputs, incoming gradient) is kept by
(micro-batch, chunk): under interleaved 1F1B a rank runs each micro-batch once per model chunk.

A *ghost* micro-batch (plan.Plan.ghosts) has no rows: its stages run its forward and backward on
an empty batch, so that they join their expert-parallel group's exchanges as the members dealt
more micro-batches do (computing their experts on those members' rows), and nothing else: no
message down the pipeline (both ends know it is a ghost), no loss, no modelled compute."""
from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Callable, Sequence

import torch

from elaswave.data.sampler import Sampler
from elaswave.pipeline.emulate import EmulatedCompute
from elaswave.pipeline.p2p import P2P
from elaswave.pipeline.schedule import BACKWARD_INPUT_SHARE, Action, Op
from elaswave.pipeline.stage import Stage
from elaswave.model import moe
from elaswave.pipeline.balance import BalanceRelay
from elaswave.pipeline.zero_bubble import WeightPass, backward_input

STRETCH_MAX = 10
"""An injected straggler (``slow``) sleeps in proportion to its compute's wall time, taken as at
most this many times the process's CPU time over it: more is a pause, not compute."""


Piece = tuple[int, "tuple[int, int] | None"]
"""(key, rows): one computation of a micro-batch -- ``key`` names its dropout stream and its loss
entry, ``rows`` its (first, count) sequences of the step's global batch (None: the configured
micro-batch ``key`` itself)."""


class Executor:
    """``on_backward`` is called once each piece's weight gradients are whole (the gradient
    accumulator): after its backward, or after its W when the backward is split (ZB-H1);
    ``before`` before every action (fault injection, and giving up early in a broken epoch);
    ``emulated``: modelled compute time added to each forward and backward (``--emulate``).
    ``pieces``: micro-batch id -> its computations (default: the micro-batch itself). A reshaped
    micro-batch is one piece of its sequences in fast mode, one piece per unit in deterministic
    mode: each unit's forward, backward and fixed-point gradient alone, as the reference computes
    it, so the bits do not depend on how units were packed into micro-batches. ``after``: called with
    each training action's index once it has run (the gradient sums start as they become whole)."""

    def __init__(self, stage: Stage, p2p: P2P, sampler: Sampler | None, global_tokens: Callable[[int], int],
                 on_backward: Callable[[], None], before: Callable[[int, Action], None] | None = None,
                 emulated: EmulatedCompute | None = None, pieces: Callable[[int], list[Piece]] | None = None,
                 after: Callable[[int], None] | None = None):
        self.stage, self.p2p, self.sampler = stage, p2p, sampler
        p2p.rows_of = self._rows  # a message received early is sized by its micro-batch
        self.pieces = pieces or (lambda mb: [(mb, None)])
        self.global_tokens = global_tokens
        """Step -> the loss tokens of its whole global batch (what every micro-batch's loss is divided by)."""
        self.on_backward = on_backward
        self.before, self.after = before, after
        self.emulated = emulated
        self.first_backward: Callable[[], None] | None = None
        """Run once, before the next backward (or at the end of the run if there is none): a
        recovery's last migration step, left to overlap the first forwards."""
        self.busy_s = 0.0
        """Time in forwards and backwards during the last run (not waiting for neighbours): the
        rank's own speed, which the planner balances by."""
        self.slowdown = 1.0
        """Each forward and backward takes this many times as long (an injected straggler)."""
        self.watch = None
        """Its layers' gradients made whole within a backward (zero/watch.LayerWatch): their sums start then."""
        self._relay: BalanceRelay | None = None
        self.ghosts: frozenset[int] = frozenset()
        """The ghost micro-batches in the schedules this runs (see the module's docstring)."""
        self.releases: dict[int, list[tuple[int, int]]] = {}
        """Index of an action in a step's schedule -> the sends (destination rank, tag) it frees once
        done (pipeline/release.py); the others at the step's end."""
        self._table = {
            Op.RECV_ACT: self._recv_act, Op.FORWARD: self._forward, Op.SEND_ACT: self._send_act,
            Op.RECV_GRAD: self._recv_grad, Op.BACKWARD: self._backward, Op.SEND_GRAD: self._send_grad,
            Op.BACKWARD_INPUT: self._backward_input, Op.BACKWARD_WEIGHT: self._backward_weight,
        }
        # A ghost's messages are none (both ends know), its forward is on no rows; its backwards are
        # a real micro-batch's, less the loss's relay and the modelled compute (see _end_compute).
        self._ghost_table = {**self._table, Op.RECV_ACT: self._ghost_recv_act, Op.FORWARD: self._ghost_forward,
                             Op.SEND_ACT: lambda a: None, Op.RECV_GRAD: self._ghost_recv_grad,
                             Op.SEND_GRAD: self._ghost_send_grad}
        self._weights = [t for layer in stage.layers for t in (*layer.params, *(alias for alias, _ in layer.uses))]
        """Every tensor whose gradient a backward accumulates: the layers' parameters and tied uses."""
        self._recomputed_weights = [[*layer.params, *(p for u in stage.followers.get(layer.index, ()) for p in u.params)]
                                    for layer in stage.running if layer.index in stage.recomputed]
        """A split backward's W takes each recomputed layer's weights in one autograd call: every
        call that reads the layer runs its forward again."""

    @property
    def relay(self) -> BalanceRelay | None:
        """A mixture of experts' load-balancing loss across this pipeline's stages (pipeline/balance.py)."""
        return self._relay

    @relay.setter
    def relay(self, relay: BalanceRelay | None) -> None:
        self._relay = relay
        self.p2p.beside_shape = None if relay is None else (
            lambda mb, grad: (len(self.pieces(mb)), relay.backward_width if grad else relay.forward_width))

    def run(self, actions: Sequence[Action], step: int) -> dict[int, tuple[float, int]]:
        """Execute the actions; returns each piece's (micro-batch's, unless reshaped) summed token
        loss and its count of loss tokens, by its key (last stage only)."""
        self.step = step
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.grads: dict[tuple[int, int], torch.Tensor] = {}
        self.weight_passes: dict[int, list[WeightPass]] = {}
        """A split backward's W still to run, by micro-batch: one per piece, each holding its graph."""
        self.losses: dict[int, tuple[float, int, float | None]] = {}
        if self.relay is not None:
            self.relay.reset()
        self.busy_s = 0.0
        self.p2p.arm(training=True)
        for i, action in enumerate(actions):
            if self.before is not None:
                self.before(step, action)
            self.index = i
            (self._ghost_table if action.micro_batch in self.ghosts else self._table)[action.op](action)
            for dst, tag in self.releases.get(i, ()):
                self.p2p.release(dst, tag)
            if self.after is not None:
                self.after(i)
        self._run_first_backward_hook()
        self.p2p.drain()
        return self.losses

    def evaluate(self, actions: Sequence[Action], sampler: Sampler | None, batch: int,
                 before: Callable[[Action], None] | None = None) -> dict[int, tuple[float, int]]:
        """The forwards of ``actions`` (a step's schedule) on held-out batch ``batch`` read from
        ``sampler``: no dropout, no graph, no gradients. Returns each piece's summed token loss
        and loss-token count, by its key (last stage only). Dropping the backwards leaves a schedule that cannot deadlock: it only
        loses waits."""
        received: dict[tuple[int, int], torch.Tensor] = {}
        outputs: dict[tuple[int, int], list[torch.Tensor]] = {}
        losses: dict[int, tuple[float, int]] = {}
        self.p2p.arm(training=False)
        with torch.no_grad():
            for a in actions:
                if a.op not in (Op.RECV_ACT, Op.FORWARD, Op.SEND_ACT):
                    continue
                if before is not None:
                    before(a)
                mb, at = a.micro_batch, (a.micro_batch, a.chunk)
                if mb in self.ghosts:
                    if a.op is Op.FORWARD:
                        self.stage.forward(self._nothing(a.chunk), batch, mb, train=False, chunk=a.chunk)
                elif a.op is Op.RECV_ACT:
                    received[at] = self.p2p.recv_act(mb, a.peer, self._rows(mb), a.chunk)
                elif a.op is Op.SEND_ACT:
                    self.p2p.send_act(_joined(outputs.pop(at)), mb, a.peer, a.chunk)
                else:
                    outs, last = [], self.stage.chunk_is_last(a.chunk)
                    for key, x, data in self._inputs(mb, batch, sampler, received.pop(at, None), a.chunk):
                        out = self.stage.forward(x, batch, key, train=False,
                                                 documents=data.documents if data is not None else None, chunk=a.chunk)
                        if last:
                            losses[key] = (float(self.stage.model.loss_sum(out, data.targets.to(self.stage.device))),
                                           data.loss_tokens)
                        outs.append(out)
                    if not last:
                        outputs[at] = outs
        self.p2p.drain()
        return losses

    def _nothing(self, chunk: int) -> torch.Tensor:
        """A ghost's input to ``chunk``: no tokens (the first stage's), or no rows of activations."""
        if self.stage.chunk_is_first(chunk):
            return torch.zeros((0, self.stage.model.seq_len), dtype=torch.long, device=self.stage.device)
        return torch.zeros((0, *self.p2p.shape[1:]), dtype=self.p2p.dtype, device=self.stage.device)

    def _ghost_forward(self, a: Action) -> None:
        """A ghost's forward: the chunk's layers on no rows. On the last chunk the output's sum (zero)
        roots the backward, which runs every exchange of the graph again."""
        at = (a.micro_batch, a.chunk)
        x = self.inputs[at] if at in self.inputs else self._nothing(a.chunk)
        with moe.recording():  # (a record of no rows: no load-balancing loss)
            out = self.stage.forward(x, self.step, a.micro_batch, chunk=a.chunk)
        self.outputs[at] = [out.float().sum() if self.stage.chunk_is_last(a.chunk) else out]

    def _ghost_recv_act(self, a: Action) -> None:
        self.inputs[(a.micro_batch, a.chunk)] = self._nothing(a.chunk).requires_grad_(True)

    def _ghost_recv_grad(self, a: Action) -> None:
        self.grads[(a.micro_batch, a.chunk)] = torch.zeros_like(self.outputs[(a.micro_batch, a.chunk)][0])

    def _ghost_send_grad(self, a: Action) -> None:
        self.inputs.pop((a.micro_batch, a.chunk), None)

    def _rows(self, mb: int) -> int | None:
        """Sequences of micro-batch ``mb`` (None: the configured size)."""
        pieces = self.pieces(mb)
        if all(rows is None for _, rows in pieces):
            return None
        return sum(rows[1] for _, rows in pieces)

    def _inputs(self, mb: int, step: int, sampler: Sampler | None, received: torch.Tensor | None, chunk: int = 0):
        """(key, input, data) of each piece of ``mb`` on ``chunk``: data read for it (if this stage
        reads), the input its rows of what the previous stage sent (or its tokens on the first stage)."""
        pieces, at = self.pieces(mb), 0
        for key, rows in pieces:
            data = sampler.micro_batch(step, key, rows) if sampler is not None else None
            if self.stage.chunk_is_first(chunk):
                x = data.inputs.to(self.stage.device)
            elif len(pieces) == 1:
                x = received
            else:
                x, at = received[at:at + rows[1]], at + rows[1]
            yield key, x, data

    def _recv_act(self, a: Action) -> None:
        self.inputs[(a.micro_batch, a.chunk)] = self.p2p.recv_act(a.micro_batch, a.peer, self._rows(a.micro_batch),
                                                                  a.chunk).requires_grad_(True)
        if self.relay is not None:
            self.relay.arrived(a.micro_batch, self.p2p.recv_beside(a.micro_batch, False, a.peer, a.chunk), a.chunk)

    def _forward(self, a: Action) -> None:
        mb, at = a.micro_batch, (a.micro_batch, a.chunk)
        began, cpu, waited = time.perf_counter(), time.process_time(), self.stage.waited_s
        outs, last = [], self.stage.chunk_is_last(a.chunk)
        for piece, (key, x, batch) in enumerate(self._inputs(mb, self.step, self.sampler, self.inputs.get(at), a.chunk)):
            with moe.recording() as record:
                out = self.stage.forward(x, self.step, key, documents=batch.documents if batch is not None else None,
                                         chunk=a.chunk)
            if self.relay is not None:
                self.relay.forwarded(mb, piece, record, a.chunk)
            if last:
                loss_sum = self.stage.model.loss_sum(out, batch.targets.to(self.stage.device))
                term, aux = (self.relay.loss_term(mb, piece, batch.targets.shape[0], a.chunk) if self.relay is not None else
                             (None, self._aux_alone(record)))
                self.losses[key] = (float(loss_sum.detach()), batch.loss_tokens, aux)
                # Scale by the *global* count of loss tokens: the gradient is the mean over the whole
                # batch, whichever pipeline runs this micro-batch and however many pipelines are alive.
                out = loss_sum / max(1, self.global_tokens(self.step))
                if term is not None:
                    out = out + term
            outs.append(out)
        if last and self.relay is not None:
            self.relay.last_forward_done(mb, a.chunk)
        self.outputs[at] = outs
        self._end_compute(began, cpu, waited, chunk=a.chunk)

    def _aux_alone(self, record: list) -> float | None:
        """Without a relay (no experts; a schedule that carries no statistics, where the loss is
        off): the load-balancing loss's value where this rank runs every block in one chunk, else
        None (it would be a part's)."""
        if not record or self.stage.chunks != ((0, self.stage.model.num_layers),):
            return None
        return float(moe.aux_loss(record, self.stage.model.cfg.num_experts).detach())

    def _send_act(self, a: Action) -> None:
        self.p2p.send_act(_joined(self.outputs[(a.micro_batch, a.chunk)]), a.micro_batch, a.peer, a.chunk)
        if self.relay is not None:
            self.p2p.send_beside(self.relay.outgoing(a.micro_batch, a.chunk), a.micro_batch, False, a.peer, a.chunk)

    def _recv_grad(self, a: Action) -> None:
        self.grads[(a.micro_batch, a.chunk)] = self.p2p.recv_grad(a.micro_batch, a.peer, self._rows(a.micro_batch),
                                                                  a.chunk)
        if self.relay is not None:
            self.relay.totals_arrived(a.micro_batch, self.p2p.recv_beside(a.micro_batch, True, a.peer, a.chunk), a.chunk)

    def _run_first_backward_hook(self) -> None:
        hook, self.first_backward = self.first_backward, None
        if hook is not None:
            hook()

    def _output_grads(self, mb: int, chunk: int = 0) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Each piece's output of ``mb`` on ``chunk`` with the gradient flowing into it (None: the loss)."""
        outs = self.outputs.pop((mb, chunk))
        grad = None if self.stage.chunk_is_last(chunk) else self.grads.pop((mb, chunk))
        at, out_grads = 0, []
        for out in outs:
            if grad is None or len(outs) == 1:
                out_grads.append((out, grad))
            else:
                out_grads.append((out, grad[at:at + out.shape[0]]))
                at += out.shape[0]
        return out_grads

    def _backward(self, a: Action) -> None:
        began, cpu, waited = self._begin_backward()
        out_grads = self._output_grads(a.micro_batch, a.chunk)
        ghost = a.micro_batch in self.ghosts
        for piece, (out, grad) in enumerate(out_grads):  # each folded alone
            # Before the last stage, this stage's MoE blocks take the load-balancing loss's gradient too.
            term = (self.relay.surrogate(a.micro_batch, piece, out.shape[0], a.chunk)
                    if self.relay is not None and grad is not None and not ghost else None)
            with self._watching(piece == len(out_grads) - 1, a.chunk, began, waited):
                if term is not None:
                    torch.autograd.backward([out, term], [grad, torch.ones_like(term)])
                elif out.requires_grad:  # a chunk of frozen weights only, fed tokens (LoRA's embedding), has no graph
                    torch.autograd.backward(out, grad)
            self.on_backward()
        self._end_compute(began, cpu, waited, 1.0, a.chunk, ghost)

    def _backward_input(self, a: Action) -> None:
        """ZB-H1's B: the input's gradient now (the stage before waits for it), the weights' at W."""
        began, cpu, waited = self._begin_backward()
        mb, ghost = a.micro_batch, a.micro_batch in self.ghosts
        passes = []
        for piece, (out, grad) in enumerate(self._output_grads(mb)):
            term = (self.relay.surrogate(mb, piece, out.shape[0])
                    if self.relay is not None and grad is not None and not ghost else None)
            if term is not None:  # one root: the gradient reaching ``out`` is ``grad`` exactly (1 x grad)
                out, grad = (out * grad).sum() + term, None
            passes.append(backward_input(out, grad, self.inputs.get((mb, 0)), self._weights, self._recomputed_weights))
        self.weight_passes[mb] = passes
        self._end_compute(began, cpu, waited, BACKWARD_INPUT_SHARE, ghost=ghost)

    def _backward_weight(self, a: Action) -> None:
        began, cpu, waited = self._begin_backward()
        passes = self.weight_passes.pop(a.micro_batch)
        for piece, weight_pass in enumerate(passes):
            with self._watching(piece == len(passes) - 1, a.chunk, began, waited, 1.0 - BACKWARD_INPUT_SHARE):
                weight_pass.run()  # (the last layers first, as a whole backward)
            self.on_backward()  # the piece's gradient is whole only now, into zeroed buffers as in _backward
        self._end_compute(began, cpu, waited, 1.0 - BACKWARD_INPUT_SHARE, ghost=a.micro_batch in self.ghosts)

    def _watching(self, last: bool, chunk: int, began: float, waited: float, share: float = 1.0):
        """Around a piece's backward (or W): the last piece makes the micro-batch's gradients whole,
        layer by layer as it runs, and their sums start then (zero/watch.py)."""
        if self.watch is None or not last:
            return nullcontext()
        return self.watch.watching(self.index, chunk, lambda: began + self.stage.waited_s - waited, share)

    def _begin_backward(self) -> tuple[float, float, float]:
        """(wall, CPU time, ``stage.waited_s``) as a backward starts (see :meth:`_end_compute`)."""
        self._run_first_backward_hook()
        return time.perf_counter(), time.process_time(), self.stage.waited_s

    def _end_compute(self, began: float, cpu: float, waited: float, backward_share: float | None = None,
                     chunk: int = 0, ghost: bool = False) -> None:
        """``waited``: ``stage.waited_s`` when it began -- what it waited for since (parameter
        all-gathers, a mixture of experts' exchanges) is not compute: neither the rank's speed nor
        emulated time, which then runs after the waits, as if they had all come first;
        ``backward_share``: the share of a whole backward's modelled time this computation takes
        (None: a forward); ``chunk``: the model chunk it ran; ``ghost``: a ghost's, which models no
        compute and is not the rank's speed (its rows are none; its experts' work on its group mates'
        rows is, as a real micro-batch's is not either)."""
        if ghost:
            return
        began += self.stage.waited_s - waited
        if self.emulated is not None:
            if backward_share is None:
                self.emulated.forward(began, chunk)
            else:
                self.emulated.backward(began, backward_share, chunk)
        self._straggle(began, cpu)
        self.busy_s += time.perf_counter() - began

    def _straggle(self, began: float, cpu: float) -> None:
        # The wall time a loaded machine stretches, but not a pause of the whole process (SIGSTOP, a
        # frozen VM): at most STRETCH_MAX times its CPU time. A 12 s pause had slept 48 s more at
        # factor 5, and the rank, deaf meanwhile, missed that the job had gone on without it.
        # (Emulated compute is a sleep: its wall time is the compute.)
        if self.slowdown > 1.0:
            spent = time.perf_counter() - began
            if self.emulated is None:
                spent = min(spent, STRETCH_MAX * (time.process_time() - cpu) + 0.01)
            time.sleep((self.slowdown - 1.0) * spent)

    def _send_grad(self, a: Action) -> None:
        self.p2p.send_grad(self.inputs.pop((a.micro_batch, a.chunk)).grad, a.micro_batch, a.peer, a.chunk)
        if self.relay is not None:
            self.p2p.send_beside(self.relay.returning(a.micro_batch, a.chunk), a.micro_batch, True, a.peer, a.chunk)


def _joined(outs: list[torch.Tensor]) -> torch.Tensor:
    return outs[0] if len(outs) == 1 else torch.cat([o.detach() for o in outs])
