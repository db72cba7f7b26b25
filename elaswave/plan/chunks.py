"""ZeRO-1 chunk ownership (pure).

A layer's parameters are one flat vector cut into fixed-size chunks. The chunks of a holder group's
layers are numbered in layer order and chunk ``c`` is owned by ``holders[c mod n]`` (holders sorted),
so a holder's state is spread over every layer and the loss of one holder leaves a scattered,
evenly sized set of chunks to recover.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


def num_chunks(numel: int, chunk_numel: int) -> int:
    return -(-numel // chunk_numel)


def chunk_range(numel: int, chunk_numel: int, c: int) -> tuple[int, int]:
    start = c * chunk_numel
    return start, min(numel, start + chunk_numel)


def owner(holders: Sequence[int], group_chunk: int) -> int:
    """The holder that owns chunk number ``group_chunk`` of its holder group."""
    return holders[group_chunk % len(holders)]


@dataclass(frozen=True)
class ChunkIndex:
    """Global chunk numbering in canonical layer order: what clipping norms are summed over."""

    offsets: tuple[int, ...]  # offsets[l] = global index of layer l's chunk 0
    total: int

    @staticmethod
    def build(layer_numels: Sequence[int], chunk_numel: int) -> "ChunkIndex":
        offsets, total = [], 0
        for numel in layer_numels:
            offsets.append(total)
            total += num_chunks(numel, chunk_numel)
        return ChunkIndex(tuple(offsets), total)
