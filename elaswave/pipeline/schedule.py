"""The 1F1B pipeline schedule as data: a list of typed actions per stage.

A schedule can be printed, checked for deadlock without any process (:func:`check_deadlock_free`),
run by the executor's dispatch table, and timed by a simulator. Sends are non-blocking and receives
block, which is how the executor runs them, and what the deadlock check assumes.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Sequence


class Op(Enum):
    RECV_ACT = "recv_act"
    FORWARD = "forward"
    SEND_ACT = "send_act"
    RECV_GRAD = "recv_grad"
    BACKWARD = "backward"
    SEND_GRAD = "send_grad"


@dataclass(frozen=True)
class Action:
    op: Op
    micro_batch: int
    peer: int | None = None
    """The rank to send to or receive from; None: the neighbouring stage of this rank's pipeline."""

    def __str__(self) -> str:
        return f"{self.op.value}({self.micro_batch})" + ("" if self.peer is None else f"@{self.peer}")


def _forward(stage: int, num_stages: int, mb: int) -> list[Action]:
    acts = [] if stage == 0 else [Action(Op.RECV_ACT, mb)]
    acts.append(Action(Op.FORWARD, mb))
    if stage < num_stages - 1:
        acts.append(Action(Op.SEND_ACT, mb))
    return acts


def _backward(stage: int, num_stages: int, mb: int) -> list[Action]:
    acts = [] if stage == num_stages - 1 else [Action(Op.RECV_GRAD, mb)]
    acts.append(Action(Op.BACKWARD, mb))
    if stage > 0:
        acts.append(Action(Op.SEND_GRAD, mb))
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


class DeadlockError(RuntimeError):
    pass


def check_deadlock_free(schedules: Sequence[Sequence[Action]]) -> None:
    """Run the stages' schedules of one pipeline symbolically; raise if they can get stuck.

    A RECV waits for the matching SEND of the neighbour (act from stage-1, grad from stage+1);
    sends never wait. Also checks every send is received exactly once.
    """
    sent: set[tuple[str, int, int]] = set()  # (kind, to_stage, micro_batch)
    pos = [0] * len(schedules)
    while True:
        progressed = False
        for s, sched in enumerate(schedules):
            while pos[s] < len(sched):
                a = sched[pos[s]]
                if a.op is Op.RECV_ACT or a.op is Op.RECV_GRAD:
                    key = ("act" if a.op is Op.RECV_ACT else "grad", s, a.micro_batch)
                    if key not in sent:
                        break
                    sent.discard(key)
                elif a.op is Op.SEND_ACT:
                    sent.add(("act", s + 1, a.micro_batch))
                elif a.op is Op.SEND_GRAD:
                    sent.add(("grad", s - 1, a.micro_batch))
                pos[s] += 1
                progressed = True
        if all(p == len(sc) for p, sc in zip(pos, schedules)):
            if sent:
                raise DeadlockError(f"messages sent but never received: {sorted(sent)}")
            return
        if not progressed:
            stuck = {s: str(sc[pos[s]]) for s, sc in enumerate(schedules) if pos[s] < len(sc)}
            raise DeadlockError(f"schedule deadlocks; stages waiting at {stuck}")
