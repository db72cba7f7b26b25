"""A recovery's migration over real gloo ranks: chunks arrive as their source sent them, and
state damaged on the way fails the recovery loudly instead of being trained on."""
import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from elaswave.comm.backend import make_process_group
from elaswave.comm.groups import Group
from elaswave.interrupt import Interrupt
from elaswave.plan.recovery import Restore
from elaswave.runtime.migration import TAG_MIGRATE, MigrationDamaged, restore_chunks

N = 8
KEYS = [(0, 0), (0, 1), (1, 0)]


def _state(key) -> torch.Tensor:
    """Chunk ``key``'s state at the resume step as its source holds it: distinct in every value."""
    return torch.arange(3 * N, dtype=torch.float32).view(3, N) + 100 * key[0] + 10 * key[1]


class _Damaging(Group):
    """Flips one bit of the parameter rows it sends, in a copy, after their checksum was taken."""

    def isend(self, t, dst, tag):
        if tag == TAG_MIGRATE + 1:
            t = t.clone()
            t.view(torch.uint8).view(-1)[5] ^= 0x10
        return super().isend(t, dst, tag)


def _migrate(damage: bool, overlap: bool):
    """Rank 0 sends the three chunks it holds to rank 1, their next owner; rank 1's result."""
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    restore = Restore(7, {k: (0, "own") for k in KEYS}, False)
    new_owners = {0: [1, 1], 1: [1]}
    out, errors = {}, {}

    def rank(r):
        try:
            client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
            pg = make_process_group(client, "m/", r, 2, "gloo", 10.0, torch.device("cpu"))
            world = (_Damaging if damage and r == 0 else Group)(pg, (0, 1), r, 0, 10.0, Interrupt())
            ctx = SimpleNamespace(rank=r, device=torch.device("cpu"), pool=None, cfg=SimpleNamespace(
                parallel=SimpleNamespace(chunk_numel=N), elastic=SimpleNamespace(overlap_migration=overlap)))
            st = SimpleNamespace(optimizer=SimpleNamespace(chunk=lambda key, gen: _state(key)))
            chunks, received, arriving = restore_chunks(ctx, st, world, new_owners, restore)
            for settle, keys, moments in arriving:  # as the optimizer settles them before its update
                settle()
                for k, part in zip(keys, moments):
                    chunks[k][1:] = part
            out[r] = chunks, received
        except Exception as exc:  # surfaced below
            errors[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank of the migration hung"
    return out, errors


@pytest.mark.parametrize("overlap", [False, True], ids=["moments-waited", "moments-overlapped"])
def test_chunks_arrive_as_their_source_holds_them(overlap):
    out, errors = _migrate(damage=False, overlap=overlap)
    assert not errors, errors
    chunks, received = out[1]
    assert sorted(chunks) == KEYS and all(torch.equal(chunks[k], _state(k)) for k in KEYS)
    assert received == 3 * len(KEYS) * N * 4
    assert out[0] == ({}, 0)


def test_parameters_damaged_on_the_way_fail_the_recovery_loudly():
    out, errors = _migrate(damage=True, overlap=True)
    assert isinstance(errors.get(1), MigrationDamaged), errors
    assert "received from rank 0 for step 7 differ from what it sent" in str(errors[1])
    assert 0 in out  # the sender finished: the receiver is the one that can tell
