"""Activation and gradient transfer between neighbouring (virtual) stages of one pipeline.

Sends are asynchronous, each kept alive until :meth:`P2P.release` (once the peer must have taken
it: pipeline/release.py) or :meth:`P2P.drain` at the step's end; receives wait with the epoch
group's bounded, interruptible wait. Tags keep activations and gradients of different micro-batches (and
model chunks) apart on gloo; NCCL ignores tags and matches a pair's messages by their order. Without
chunks each pair carries one kind, in the same order on both sides. With chunks two ranks of a
pipeline of two are each other's neighbour both ways, and the interleaved schedule sends a
gradient before an activation that the other rank receives first (p = 2, odd m >= 5): so with
chunks a rank receives each peer's messages in the order the peer sends them (:meth:`P2P.expect`,
from the peer's own schedule), keeping any that arrive before it needs them.

With ``num_chunks`` V > 1 (interleaved 1F1B) the ranks of a pipeline form a ring: chunk ``c`` of
the last rank feeds chunk ``c + 1`` of the first. A pipeline of one rank sends to itself: such a
message stays in this process (no transport carries a message to its own sender).
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Collection, Sequence

import torch

from elaswave.comm.groups import Group
from elaswave.pipeline.schedule import Action, Op


def sends_of(stage: int, num_stages: int, num_chunks: int, actions: Sequence[Action],
             beside: bool = False) -> list[tuple[int, int]]:
    """(destination stage, tag) of each message stage ``stage``'s ``actions`` send, in order (pure:
    what every rank can work out of any other's schedule; the tags :class:`P2P` uses); ``beside``:
    each followed by what travels beside it (:meth:`P2P.send_beside`)."""
    out = []
    for a in actions:
        if a.op is Op.SEND_ACT:
            out.append(((stage + 1) % num_stages, _act_tag(num_chunks, stage == num_stages - 1, a.micro_batch, a.chunk)))
        elif a.op is Op.SEND_GRAD:
            out.append(((stage - 1) % num_stages, _grad_tag(num_chunks, stage == 0, a.micro_batch, a.chunk)))
        else:
            continue
        if beside:
            out.append((out[-1][0], SIDE + out[-1][1]))
    return out


def receives_of(stage: int, num_stages: int, num_chunks: int, actions: Sequence[Action],
                ghosts: Collection[int] = ()) -> dict[tuple[int, int], int]:
    """(source stage, tag) -> the index in ``actions`` of the receive that takes that message (the
    receiving side of :func:`sends_of`; a ghost micro-batch's, which none sends, skipped)."""
    out = {}
    for i, a in enumerate(actions):
        if a.micro_batch in ghosts:
            continue
        if a.op is Op.RECV_ACT:
            out[((stage - 1) % num_stages, _tag(num_chunks, a.micro_batch, a.chunk, False))] = i
        elif a.op is Op.RECV_GRAD:
            out[((stage + 1) % num_stages, _tag(num_chunks, a.micro_batch, a.chunk, True))] = i
    return out


def incoming_of(pipeline: Sequence[int], stage: int, num_chunks: int,
                schedule_of: Callable[[int], Sequence[Action]], beside: bool = False) -> dict[int, list[int]]:
    """Each other rank of ``pipeline``'s messages to stage ``stage``, as tags in the order it sends
    them (``schedule_of``: a stage's actions): what :meth:`P2P.expect` takes."""
    return {pipeline[other]: [tag for dst, tag in sends_of(other, len(pipeline), num_chunks, schedule_of(other), beside)
                              if dst == stage]
            for other in range(len(pipeline)) if other != stage}


SIDE = 1 << 24
"""Added to a message's tag for what travels beside it (P2P.send_beside)."""


def _tag(num_chunks: int, mb: int, chunk: int, grad: bool) -> int:
    """The receiving chunk's message of ``mb`` (one chunk: 2 mb, 2 mb + 1 as before chunks)."""
    return 2 * (mb * num_chunks + chunk) + grad


def _act_tag(num_chunks: int, last: bool, mb: int, chunk: int) -> int:
    """An activation sent by ``chunk``: the last rank's feeds the first rank's next chunk."""
    return _tag(num_chunks, mb, chunk + (num_chunks > 1 and last), False)


def _grad_tag(num_chunks: int, first: bool, mb: int, chunk: int) -> int:
    """A gradient sent by ``chunk``: the first rank's goes to the last rank's chunk before."""
    return _tag(num_chunks, mb, chunk - (num_chunks > 1 and first), True)


class P2P:
    """``prev_rank``/``next_rank``: the neighbours (round the ring with chunks; None at a
    pipeline's ends without); ``first``/``last``: whether this rank is its pipeline's first or last."""

    def __init__(self, group: Group, prev_rank: int | None, next_rank: int | None, shape: tuple[int, ...],
                 device: torch.device, dtype: torch.dtype = torch.float32, num_chunks: int = 1,
                 first: bool = False, last: bool = False):
        self.group = group
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self.shape, self.device, self.dtype = shape, device, dtype
        self.num_chunks, self.first, self.last = num_chunks, first, last
        self.pending: dict[tuple[int, int], tuple] = {}
        """(destination rank, tag) -> the send's work and tensor, until released or drained."""
        self._alive = 0  # sends (not what travels beside them) in ``pending`` and ``_loopback``
        self.most_pending = 0
        """The most sends (not counting what travels beside them) alive at once in the last step."""
        self._loopback: dict[int, torch.Tensor] = {}
        self._incoming: dict[int, list[int]] = {}
        self._expected: dict[int, deque] = {}
        self._early: dict[tuple[int, int], torch.Tensor] = {}
        self.rows_of: Callable[[int], int | None] = lambda mb: None
        """Micro-batch -> its sequences (a reshaped one's; None: the configured size): the executor's."""
        self.beside_shape: Callable[[int, bool], tuple[int, ...]] | None = None
        """(micro-batch, a gradient's?) -> the shape of what travels beside it: the executor's."""

    def expect(self, incoming: dict[int, list[int]]) -> None:
        """Each peer's messages to this rank in a step, as tags in the order it sends them: received
        in that order (see :meth:`arm`)."""
        self._incoming = dict(incoming)

    def arm(self, training: bool) -> None:
        """Before a step's schedule (``training``) or an evaluation's forwards, which send activations
        only: one kind, in the same order on both sides of every pair."""
        self._expected = {peer: deque(tags) for peer, tags in self._incoming.items()} if training else {}
        if training:
            self.most_pending = 0
        self._early.clear()

    def _tag(self, mb: int, chunk: int, grad: bool) -> int:
        return _tag(self.num_chunks, mb, chunk, grad)

    def _send(self, t: torch.Tensor, dst: int, tag: int, dtype: torch.dtype | None = None) -> None:
        # In the compute dtype whatever a layer returned (e.g. float32 from a user's float32 buffer):
        # the receiver's buffer has that dtype, and gloo moves bytes.
        t = t.detach().to(device=self.device, dtype=dtype or self.dtype).contiguous()
        if dst == self.group.me:
            self._loopback[tag] = t.clone()
        else:
            self.pending[(dst, tag)] = (self.group.isend(t, dst, tag), t)
        if tag < SIDE:
            self._alive += 1
            self.most_pending = max(self.most_pending, self._alive)

    def release(self, dst: int, tag: int) -> None:
        """Free the send of ``tag`` to rank ``dst`` and what travelled beside it: the peer has taken
        them (pipeline/release.py), so the wait returns at once."""
        for key in ((dst, tag), (dst, SIDE + tag)):
            done = self.pending.pop(key, None)
            if done is not None:
                self.group.wait(done[0], "pipeline send")
                self._alive -= key[1] < SIDE

    def _recv(self, src: int, tag: int, what: str, rows: int | None = None) -> torch.Tensor:
        if src == self.group.me:
            self._alive -= tag < SIDE
            return self._loopback.pop(tag)
        order = self._expected.get(src)
        if order is None or ((src, tag) not in self._early and tag not in order):
            return self._recv_now(src, tag, what, rows)
        while (src, tag) not in self._early:  # what the peer sent before it, received first
            early = order.popleft()
            self._early[(src, early)] = self._recv_now(src, early, what if early == tag else
                                                       f"an earlier message (tag {early}) before the {what}",
                                                       rows if early == tag else self.rows_of(self._mb_of(early)))
        return self._early.pop((src, tag))

    def _mb_of(self, tag: int) -> int:
        return tag % SIDE // 2 // self.num_chunks

    def _recv_now(self, src: int, tag: int, what: str, rows: int | None = None) -> torch.Tensor:
        if tag >= SIDE:  # what travels beside a message: float32 statistics
            buf = torch.empty(self.beside_shape(self._mb_of(tag), bool(tag % 2)), dtype=torch.float32, device=self.device)
        else:
            shape = self.shape if rows is None else (rows, *self.shape[1:])
            buf = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.group.wait(self.group.irecv(buf, src, tag), f"{what} from rank {src}")
        return buf

    # ``peer``: a rank other than the pipeline neighbour, for a micro-batch on a detour.
    # ``chunk``: the sending chunk for a send, the receiving chunk for a receive.
    def send_act(self, t: torch.Tensor, mb: int, peer: int | None = None, chunk: int = 0) -> None:
        self._send(t, self.next_rank if peer is None else peer, _act_tag(self.num_chunks, self.last, mb, chunk))

    def send_grad(self, t: torch.Tensor, mb: int, peer: int | None = None, chunk: int = 0) -> None:
        self._send(t, self.prev_rank if peer is None else peer, _grad_tag(self.num_chunks, self.first, mb, chunk))

    # ``rows``: a reshaped micro-batch's sequences (default: the configured micro-batch size).
    def recv_act(self, mb: int, peer: int | None = None, rows: int | None = None, chunk: int = 0) -> torch.Tensor:
        return self._recv(self.prev_rank if peer is None else peer, self._tag(mb, chunk, False),
                          f"activation of micro-batch {mb}" + (f", chunk {chunk}" if chunk else ""), rows)

    def recv_grad(self, mb: int, peer: int | None = None, rows: int | None = None, chunk: int = 0) -> torch.Tensor:
        return self._recv(self.next_rank if peer is None else peer, self._tag(mb, chunk, True),
                          f"gradient of micro-batch {mb}" + (f", chunk {chunk}" if chunk else ""), rows)

    # Beside an activation or a gradient, a small float32 tensor (a mixture of experts' routing
    # statistics, pipeline/balance.py; shaped by ``beside_shape``): sent right after it, received
    # right after it, and in a peer's send order where the messages are (``expect``: ``sends_of``
    # with ``beside``), so both sides of a pair keep one order (NCCL matches by order).
    def send_beside(self, t: torch.Tensor, mb: int, grad: bool, peer: int | None = None, chunk: int = 0) -> None:
        dst = (self.prev_rank if grad else self.next_rank) if peer is None else peer
        tag = SIDE + (_grad_tag(self.num_chunks, self.first, mb, chunk) if grad
                      else _act_tag(self.num_chunks, self.last, mb, chunk))
        self._send(t, dst, tag, torch.float32)

    def recv_beside(self, mb: int, grad: bool, peer: int | None = None, chunk: int = 0) -> torch.Tensor:
        src = (self.next_rank if grad else self.prev_rank) if peer is None else peer
        return self._recv(src, SIDE + self._tag(mb, chunk, grad),
                          f"routing statistics beside the {'gradient' if grad else 'activation'} of micro-batch {mb}"
                          + (f", chunk {chunk}" if chunk else ""))

    def drain(self) -> None:
        for work, _ in self.pending.values():
            self.group.wait(work, "pipeline send")
        self.pending.clear()
        self._loopback.clear()
        self._alive = 0
        self._early.clear()
