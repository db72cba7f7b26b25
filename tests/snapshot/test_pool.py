"""The snapshot pool over two real gloo ranks in threads: ring transfer, checksum, generations."""
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from elaswave.comm.backend import make_process_group
from elaswave.comm.groups import Group
from elaswave.interrupt import Interrupt
from elaswave.plan.plan import initial_plan
from elaswave.snapshot.pool import SnapshotChanged, SnapshotPool

CHUNK = 4


def _run_pair(body):
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    plan = initial_plan(2, 2, 1, [1.0, 1.0], 2, [8, 5], CHUNK)
    out, errors = {}, []

    def rank(r):
        try:
            client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
            pg = make_process_group(client, "t/", r, 2, "gloo", 10.0, torch.device("cpu"))
            out[r] = body(r, Group(pg, (0, 1), r, 0, 10.0, Interrupt()), plan)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return out


def _slots(plan, r, value):
    """Rank ``r``'s optimizer slots as the plan lays them out, every value ``value``."""
    owned = [[k for k in plan.chunks_of(r) if k[0] in layers] for h, layers in plan.holder_groups().items() if r in h]
    return [(keys, torch.full((3, n * CHUNK), float(value))) for keys, n in zip(owned, plan.slot_chunks(r))]


def test_snapshot_travels_round_the_ring_and_keeps_one_generation_once_committed():
    def body(r, group, plan):
        pool = SnapshotPool(r, CHUNK)
        kept = []
        for gen in (1, 2, 3):
            pool.expect(group, plan, torch.device("cpu"))
            pool.send(group, plan, gen, _slots(plan, r, 10 * r + gen), torch.device("cpu"))
            assert pool.verify(group, gen)
            pool.wait_sends(group)
            kept.append(sorted(pool.holding()))
            pool.commit(gen)
            kept.append(sorted(pool.holding()))
        peer = plan.snapshot_owners(r)[0]
        return kept, pool.chunk(plan.chunks_of(peer)[0], 3)[0, 0].item(), peer

    out = _run_pair(body)
    for r, (kept, value, peer) in out.items():
        assert kept == [[1], [1], [1, 2], [2], [2, 3], [3]]
        assert value == 10 * peer + 3


def test_a_snapshot_for_the_wrong_step_is_refused():
    def body(r, group, plan):
        pool = SnapshotPool(r, CHUNK)
        pool.expect(group, plan, torch.device("cpu"))
        pool.send(group, plan, 5, _slots(plan, r, 0), torch.device("cpu"))
        ok = pool.verify(group, 6)
        pool.wait_sends(group)
        return ok, pool.holding()

    assert all(res == (False, {}) for res in _run_pair(body).values())


def test_a_damaged_snapshot_is_refused_and_not_kept():
    def body(r, group, plan):
        pool = SnapshotPool(r, CHUNK)
        pool.expect(group, plan, torch.device("cpu"))
        slots = _slots(plan, r, 1.5)
        pool.send(group, plan, 5, slots, torch.device("cpu"), corrupt=r == 0)
        ok = pool.verify(group, 5)
        pool.wait_sends(group)
        assert all((state == 1.5).all() for _, state in slots)  # the damage was done to a copy
        return ok, sorted(pool.holding())

    out = _run_pair(body)
    assert out[1] == (False, [])  # rank 1 holds rank 0's snapshot, damaged after its checksum
    assert out[0] == (True, [5])


def test_a_held_snapshot_written_after_it_verified_is_not_sent_on():
    def body(r, group, plan):
        pool = SnapshotPool(r, CHUNK)
        pool.expect(group, plan, torch.device("cpu"))
        pool.send(group, plan, 5, _slots(plan, r, 2.5), torch.device("cpu"))
        assert pool.verify(group, 5)
        pool.wait_sends(group)
        pool.commit(5)
        owner = plan.snapshot_owners(r)[0]
        first, second = plan.chunks_of(owner)[:2]
        if r == 1:  # as a buffer reused while held would be
            pool.held[(owner, 5)][1][-1] ^= 0x01
        try:
            return pool.chunk(first, 5)[0, 0].item(), pool.chunk(second, 5)[0, 0].item()
        except SnapshotChanged as exc:
            return str(exc)

    out = _run_pair(body)
    assert out[0] == (2.5, 2.5)
    assert "the snapshot of rank 0 for step 5 changed after it was verified" in out[1], out[1]


def test_the_holders_layout_is_the_one_the_optimizers_buckets_send():
    """What a holder expects (the plan's slot sizes and chunks) against what an owner's buckets hold,
    built as a rank builds them: tied layers, uneven ownership after a loss, a slot whose holder
    owns nothing in it."""
    from elaswave.plan.replan import replan
    from elaswave.zero.bucket import Bucket

    numels = [300, 64, 700, 64, 300]
    first = initial_plan(6, 3, 2, [1.0] * 5, 6, numels, 64, ties=((0, 4),))
    seen = set()
    for plan in (first, replan(first, [0, 1, 2, 3, 5], 1, 6)):
        for rank in plan.ranks:
            buckets = [Bucket(h, layers, [numels[i] for i in layers], 64, rank,
                              owners=[plan.chunk_owners[i] for i in layers])
                       for h, layers in plan.holder_groups().items() if rank in h]
            assert [b.slot_chunks for b in buckets] == list(plan.slot_chunks(rank)), (plan.epoch, rank)
            sent = [(oc.layer, oc.chunk) for b in buckets for oc in b.owned]
            assert sorted(sent) == sorted(plan.chunks_of(rank)), (plan.epoch, rank)
            # The cases the test is for: a non-empty slot its holder owns nothing in, uneven slots.
            seen.update((b.slot_chunks, len(b.owned)) for b in buckets)
    assert any(size > 0 and not owned for size, owned in seen) and any(0 < owned < size for size, owned in seen)
