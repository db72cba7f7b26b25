"""The snapshot pool: after every step each rank copies its ZeRO chunks into a peer's memory.

Placement is a ring over the epoch's ranks (:meth:`Plan.snapshot_holder`): rank ``r`` sends to the
next rank and keeps the previous one's. A snapshot travels as a small header (generation, CRC-32,
chunk keys) and one payload tensor, both asynchronous, so the copy overlaps the next step's
compute. The holder verifies it before the next step's update may start (the step's loss exchange
carries a "verified" flag from every holder), which is what lets every rank drop the generation
before: a recovery then always finds one generation that every chunk has somewhere.
"""
from __future__ import annotations

import zlib

import torch

from elaswave.comm.groups import Group
from elaswave.plan.chunks import ChunkKey
from elaswave.plan.plan import Plan

TAG_HEADER, TAG_PAYLOAD = 1_000_001, 1_000_002


class SnapshotError(RuntimeError):
    """A snapshot failed its checksum or arrived for the wrong step."""


def crc32(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().cpu().contiguous().numpy())


class SnapshotPool:
    def __init__(self, rank: int, chunk_numel: int):
        self.rank, self.chunk_numel = rank, chunk_numel
        self.held: dict[tuple[int, int], tuple[tuple[ChunkKey, ...], torch.Tensor]] = {}
        """(owner, generation) -> (chunk keys, [k, 3, chunk_numel] payload in CPU memory)."""
        self._sends: list = []
        self._incoming = None
        self.owner: int | None = None

    # -- the owner's side ---------------------------------------------------------------------
    def send(self, group: Group, plan: Plan, gen: int, keys: list[ChunkKey], payload: torch.Tensor) -> None:
        holder = plan.snapshot_holder(self.rank)
        if holder is None:
            return
        header = torch.tensor([gen, crc32(payload), len(keys)] + [x for k in keys for x in k], dtype=torch.int64)
        header = header.to(payload.device)
        payload = payload.contiguous()
        self._sends.append((group.isend(header, holder, TAG_HEADER), header))
        self._sends.append((group.isend(payload, holder, TAG_PAYLOAD), payload))

    def wait_sends(self, group: Group) -> None:
        for work, _ in self._sends:
            group.wait(work, "snapshot send")
        self._sends.clear()

    # -- the holder's side --------------------------------------------------------------------
    def expect(self, group: Group, plan: Plan, device: torch.device) -> None:
        """Post the receive of the owner's next snapshot."""
        self.owner = plan.snapshot_owner(self.rank)
        if self.owner is None:
            self._incoming = None
            return
        k = len(plan.chunks_of(self.owner))
        header = torch.empty(3 + 2 * k, dtype=torch.int64, device=device)
        payload = torch.empty(k, 3, self.chunk_numel, dtype=torch.float32, device=device)
        self._incoming = (group.irecv(header, self.owner, TAG_HEADER), header,
                          group.irecv(payload, self.owner, TAG_PAYLOAD), payload)

    def verify(self, group: Group, gen: int) -> bool:
        """Wait for the expected snapshot of generation ``gen``; keep it if its checksum is right."""
        if self._incoming is None:
            return True
        hwork, header, pwork, payload = self._incoming
        self._incoming = None
        group.wait(hwork, f"snapshot header from rank {self.owner}")
        group.wait(pwork, f"snapshot from rank {self.owner}")
        h = header.cpu().tolist()
        payload = payload.cpu()
        if h[0] != gen or h[1] != crc32(payload):
            return False
        keys = tuple((h[3 + 2 * i], h[4 + 2 * i]) for i in range(h[2]))
        self.held[(self.owner, gen)] = (keys, payload)
        for old in [k for k in self.held if k[1] < gen - 1]:
            del self.held[old]
        return True

    def holding(self) -> dict[int, list[ChunkKey]]:
        out: dict[int, list[ChunkKey]] = {}
        for (_, g), (keys, _) in self.held.items():
            out.setdefault(g, []).extend(keys)
        return out

    def chunk(self, key: ChunkKey, gen: int) -> torch.Tensor:
        for (_, g), (keys, payload) in self.held.items():
            if g == gen and key in keys:
                return payload[keys.index(key)].clone()
        raise KeyError(f"no snapshot of chunk {key} at step {gen} here")

    def bytes_held(self) -> int:
        return sum(p.numel() * p.element_size() for _, p in self.held.values())

    def reset(self) -> None:
        """A new epoch re-pairs owners and holders; what is held stays a recovery source until the
        next verified snapshot replaces it."""
        self._incoming = None
        self._sends.clear()
