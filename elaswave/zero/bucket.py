"""The owner-major, chunk-padded layout of one holder group's layers (no communication).

For a holder group of ``n`` ranks holding layers ``L``, each chunk has an owner among the holders
(the plan's ``chunk_owners``; at the start chunk number ``k`` of the group goes to holder
``k mod n``, see :mod:`elaswave.plan.chunks`). The bucket places every holder's chunks in its own *slot*, in (layer, chunk) order, each chunk padded to
``chunk_numel`` so that a reduce-scatter hands each holder exactly its chunks and an all-gather puts
them back. Padding also gives every chunk the same memory alignment in every layout, which keeps
element-wise optimizer kernels bit-identical between a 1-holder reference and an n-holder run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from elaswave.plan.chunks import chunk_range, num_chunks, owner


def _valid(numel: int, chunk_numel: int, c: int) -> int:
    start, end = chunk_range(numel, chunk_numel, c)
    return end - start


@dataclass(frozen=True)
class OwnedChunk:
    layer: int
    chunk: int
    slot_offset: int  # where the chunk starts in the owner's slot
    numel: int  # valid elements (the rest of chunk_numel is padding)


class Bucket:
    def __init__(self, holders: Sequence[int], layers: Sequence[int], layer_numels: Sequence[int],
                 chunk_numel: int, me: int, device: torch.device | str = "cpu",
                 owners: Sequence[Sequence[int]] | None = None):
        """``owners[i][c]``: the rank owning chunk c of ``layers[i]``; None = the initial round robin."""
        if me not in holders:
            raise ValueError(f"rank {me} is not a holder of layers {list(layers)} (holders {list(holders)})")
        self.holders = tuple(holders)
        self.layers = tuple(layers)
        self.layer_numels = tuple(layer_numels)
        self.chunk_numel = chunk_numel
        self.my_slot = self.holders.index(me)
        n = len(self.holders)
        per_owner: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        group_chunk = 0
        for i, (layer, numel) in enumerate(zip(self.layers, self.layer_numels)):
            for c in range(num_chunks(numel, chunk_numel)):
                rank = owner(self.holders, group_chunk) if owners is None else owners[i][c]
                if rank not in self.holders:
                    raise ValueError(f"chunk {c} of layer {layer} is owned by rank {rank}, "
                                     f"which does not hold it (holders {list(self.holders)})")
                per_owner[self.holders.index(rank)].append((layer, c))
                group_chunk += 1
        self.slot_chunks = max(len(items) for items in per_owner)
        self.slot_numel = self.slot_chunks * chunk_numel
        position = {item: k * self.slot_numel + i * chunk_numel
                    for k, items in enumerate(per_owner) for i, item in enumerate(items)}
        index = []
        for layer, numel in zip(self.layers, self.layer_numels):
            for c in range(num_chunks(numel, chunk_numel)):
                start, end = chunk_range(numel, chunk_numel, c)
                index.append(torch.arange(end - start) + position[(layer, c)])
        self.pack_index = torch.cat(index).to(device)
        numel_of = dict(zip(self.layers, self.layer_numels))
        self._owned_by = tuple(
            tuple(OwnedChunk(layer, c, i * chunk_numel, _valid(numel_of[layer], chunk_numel, c))
                  for i, (layer, c) in enumerate(items))
            for items in per_owner)
        self.owned = self._owned_by[self.my_slot]
        self.device = device

    def owned_by(self, slot: int) -> tuple[OwnedChunk, ...]:
        """The chunks held in ``slot`` (holder ``holders[slot]``), in slot order."""
        return self._owned_by[slot]

    @property
    def num_holders(self) -> int:
        return len(self.holders)

    def pack(self, flats: Sequence[torch.Tensor], fill=0) -> torch.Tensor:
        """Per-layer flat vectors -> the whole bucket (all slots), owner-major and padded."""
        flats = list(flats)
        out = torch.full((self.num_holders * self.slot_numel,), fill, dtype=flats[0].dtype, device=self.device)
        out[self.pack_index] = torch.cat(flats)
        return out

    def unpack(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """The whole bucket -> per-layer flat vectors (inverse of :meth:`pack`)."""
        return list(packed[self.pack_index].split(list(self.layer_numels)))

    def my_part(self, packed: torch.Tensor) -> torch.Tensor:
        return packed[self.my_slot * self.slot_numel:(self.my_slot + 1) * self.slot_numel]
