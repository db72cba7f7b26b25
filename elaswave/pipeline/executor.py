"""Runs one step's schedule on a stage through a dispatch table, one handler per action."""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from elaswave.data.sampler import Sampler
from elaswave.pipeline.emulate import EmulatedCompute
from elaswave.pipeline.p2p import P2P
from elaswave.pipeline.schedule import Action, Op
from elaswave.pipeline.stage import Stage


class Executor:
    """``on_backward`` is called after each micro-batch's backward (the gradient accumulator);
    ``before`` before every action (fault injection, and giving up early in a broken epoch);
    ``emulated``: modelled compute time added to each forward and backward (``--emulate``)."""

    def __init__(self, stage: Stage, p2p: P2P, sampler: Sampler | None, global_tokens: Callable[[int], int],
                 on_backward: Callable[[], None], before: Callable[[int, Action], None] | None = None,
                 emulated: EmulatedCompute | None = None):
        self.stage, self.p2p, self.sampler = stage, p2p, sampler
        self.global_tokens = global_tokens
        """Step -> the loss tokens of its whole global batch (what every micro-batch's loss is divided by)."""
        self.on_backward = on_backward
        self.before = before
        self.emulated = emulated
        self.first_backward: Callable[[], None] | None = None
        """Run once, before the next backward (or at the end of the run if there is none): a
        recovery's last migration step, left to overlap the first forwards."""
        self.busy_s = 0.0
        """Time in forwards and backwards during the last run (not waiting for neighbours): the
        rank's own speed, which the planner balances by."""
        self.slowdown = 1.0
        """Each forward and backward takes this many times as long (an injected straggler)."""
        self._table = {
            Op.RECV_ACT: self._recv_act, Op.FORWARD: self._forward, Op.SEND_ACT: self._send_act,
            Op.RECV_GRAD: self._recv_grad, Op.BACKWARD: self._backward, Op.SEND_GRAD: self._send_grad,
        }

    def run(self, actions: Sequence[Action], step: int) -> dict[int, tuple[float, int]]:
        """Execute the actions; returns each micro-batch's summed token loss and its count of loss
        tokens (last stage only)."""
        self.step = step
        self.inputs: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.grads: dict[int, torch.Tensor] = {}
        self.losses: dict[int, tuple[float, int]] = {}
        self.busy_s = 0.0
        for action in actions:
            if self.before is not None:
                self.before(step, action)
            self._table[action.op](action)
        self._run_first_backward_hook()
        self.p2p.drain()
        return self.losses

    def evaluate(self, actions: Sequence[Action], sampler: Sampler | None, batch: int,
                 before: Callable[[Action], None] | None = None) -> dict[int, tuple[float, int]]:
        """The forwards of ``actions`` (a step's schedule) on held-out batch ``batch`` read from
        ``sampler``: no dropout, no graph, no gradients. Returns each micro-batch's summed token loss
        and loss-token count (last stage only). Dropping the backwards leaves a schedule that cannot deadlock: it only
        loses waits."""
        received: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        losses: dict[int, tuple[float, int]] = {}
        with torch.no_grad():
            for a in actions:
                if a.op not in (Op.RECV_ACT, Op.FORWARD, Op.SEND_ACT):
                    continue
                if before is not None:
                    before(a)
                mb = a.micro_batch
                if a.op is Op.RECV_ACT:
                    received[mb] = self.p2p.recv_act(mb, a.peer)
                elif a.op is Op.SEND_ACT:
                    self.p2p.send_act(outputs.pop(mb), mb, a.peer)
                else:
                    data = sampler.micro_batch(batch, mb) if sampler is not None else None
                    x = data.inputs.to(self.stage.device) if self.stage.is_first else received.pop(mb)
                    out = self.stage.forward(x, batch, mb, train=False,
                                             documents=data.documents if data is not None else None)
                    if self.stage.is_last:
                        losses[mb] = (float(self.stage.model.loss_sum(out, data.targets.to(self.stage.device))),
                                      data.loss_tokens)
                    else:
                        outputs[mb] = out
        self.p2p.drain()
        return losses

    def _recv_act(self, a: Action) -> None:
        self.inputs[a.micro_batch] = self.p2p.recv_act(a.micro_batch, a.peer).requires_grad_(True)

    def _forward(self, a: Action) -> None:
        mb = a.micro_batch
        began = time.perf_counter()
        batch = self.sampler.micro_batch(self.step, mb) if self.sampler is not None else None
        x = batch.inputs.to(self.stage.device) if self.stage.is_first else self.inputs[mb]
        out = self.stage.forward(x, self.step, mb, documents=batch.documents if batch is not None else None)
        if self.stage.is_last:
            loss_sum = self.stage.model.loss_sum(out, batch.targets.to(self.stage.device))
            self.losses[mb] = (float(loss_sum.detach()), batch.loss_tokens)
            # Scale by the *global* count of loss tokens: the gradient is the mean over the whole
            # batch, whichever pipeline runs this micro-batch and however many pipelines are alive.
            out = loss_sum / max(1, self.global_tokens(self.step))
        self.outputs[mb] = out
        if self.emulated is not None:
            self.emulated.forward(began)
        self._straggle(began)
        self.busy_s += time.perf_counter() - began

    def _send_act(self, a: Action) -> None:
        self.p2p.send_act(self.outputs[a.micro_batch], a.micro_batch, a.peer)

    def _recv_grad(self, a: Action) -> None:
        self.grads[a.micro_batch] = self.p2p.recv_grad(a.micro_batch, a.peer)

    def _run_first_backward_hook(self) -> None:
        hook, self.first_backward = self.first_backward, None
        if hook is not None:
            hook()

    def _backward(self, a: Action) -> None:
        self._run_first_backward_hook()
        mb = a.micro_batch
        began = time.perf_counter()
        out = self.outputs.pop(mb)
        if self.stage.is_last:
            out.backward()
        else:
            torch.autograd.backward(out, self.grads.pop(mb))
        self.on_backward()
        if self.emulated is not None:
            self.emulated.backward(began)
        self._straggle(began)
        self.busy_s += time.perf_counter() - began

    def _straggle(self, began: float) -> None:
        if self.slowdown > 1.0:
            time.sleep((self.slowdown - 1.0) * (time.perf_counter() - began))

    def _send_grad(self, a: Action) -> None:
        self.p2p.send_grad(self.inputs.pop(a.micro_batch).grad, a.micro_batch, a.peer)
