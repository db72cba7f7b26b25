"""Whole conversations packed into training windows (``prepare --format chat --pack-to L``).

The sampler cuts a corpus into windows of ``L`` tokens at a stride of ``L`` (elaswave.data.sampler);
packed without regard to them, a conversation straddles two windows, and what the assistant says
in the second is trained without the prompt that asked for it. Packed here, each window holds whole
conversations (each followed by its end-of-document id) and padding, so none is cut: best-fit
decreasing -- each conversation, longest first, into the window it leaves least room in, a new one
when none has room -- which wastes little (the padding is reported) and depends on the lengths
alone. A conversation longer than a window follows ``--overlong``: truncate (its first ``L - 1``
tokens), split (into pieces of ``L - 1``, each a window's document) or drop.

Nothing crosses from one conversation to the next as a loss target: the first token of each
(predicted from the previous one's end, or from a window's last token) is never trained, whatever
``--train-on`` says -- transformers' flattening collator masks the same targets -- and padding is
its own document, never trained.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

OVERLONG = ("truncate", "split", "drop")


@dataclass
class Packer:
    window: int
    eod_id: int
    overlong: str = "truncate"
    items: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: {"conversations": 0, "overlong": 0, "dropped": 0,
                                                             "pieces": 0})

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
        """A conversation's ids and their loss mask (1: trained)."""
        self.counts["conversations"] += 1
        if ids.size + (not self._ends(ids)) <= self.window:
            self.items.append(self._ended(ids, mask))
            return
        self.counts["overlong"] += 1
        room = self.window - 1  # its end-of-document id takes one
        if self.overlong == "drop":
            self.counts["dropped"] += 1
        elif self.overlong == "truncate":
            self.items.append(self._ended(ids[:room], mask[:room]))
        else:
            for at in range(0, ids.size, room):
                self.items.append(self._ended(ids[at:at + room], mask[at:at + room]))
                self.counts["pieces"] += 1

    def _ends(self, ids: np.ndarray) -> bool:
        return bool(ids.size) and int(ids[-1]) == self.eod_id

    def _ended(self, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """With its end-of-document id (never trained: what follows a conversation is not its to say)."""
        mask = mask.astype(np.uint8, copy=True)
        if mask.size:
            mask[0] = 0  # predicted from what came before it: another conversation's end
        if self._ends(ids):
            mask[-1] = 0
            return ids, mask
        return np.append(ids.astype(np.int64, copy=False), self.eod_id), np.append(mask, np.uint8(0))

    def bins(self) -> list[list[int]]:
        """Item indices per window, best-fit decreasing (ties: the earlier item, the earlier window)."""
        order = sorted(range(len(self.items)), key=lambda i: (-self.items[i][0].size, i))
        free: list[tuple[int, int]] = []  # (room left, window), sorted
        out: list[list[int]] = []
        for i in order:
            need = self.items[i][0].size
            at = bisect.bisect_left(free, (need, -1))
            if at == len(free):
                out.append([i])
                bisect.insort(free, (self.window - need, len(out) - 1))
            else:
                room, w = free.pop(at)
                out[w].append(i)
                bisect.insort(free, (room - need, w))
        return out

    def write(self, writer) -> dict:
        """Every window to ``writer`` (a ShardWriter of a masked corpus): its conversations, then
        padding (end-of-document ids, never trained) to ``window`` tokens; one id more at the end, so
        the last window has the token its last target reads. Returns what packing cost."""
        bins = self.bins()
        padding = 0
        for members in bins:
            used = 0
            for i in members:
                ids, mask = self.items[i]
                writer.add(ids, mask)  # (it ends with the end-of-document id: nothing appended)
                used += ids.size
            if used < self.window:
                fill = self.window - used
                writer.add(np.full(fill, self.eod_id, dtype=np.int64), np.zeros(fill, np.uint8))
                padding += fill
        if bins:
            writer.add(np.full(1, self.eod_id, dtype=np.int64), np.zeros(1, np.uint8))
        tokens = len(bins) * self.window
        return {**self.counts, "windows": len(bins), "padding_tokens": padding,
                "padding_share": padding / tokens if tokens else 0.0}
