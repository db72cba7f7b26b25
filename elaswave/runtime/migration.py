"""A recovery's state migration: every chunk's state at the resume step reaches its next owner.

A chunk is kept where its new owner already has it, sent by the one rank the restore plan names
as its source (its old owner, or the holder of its snapshot) over disjoint rank-to-rank
transfers, read from the disk checkpoint, or rebuilt from the seed.

Each (source, destination) pair exchanges three messages: the checksums of the other two, the
parameter rows, waited for at once (the all-gather that rebuilds whole layers needs them before
the first forward), and the Adam moments, which only the update needs: with
``elastic.overlap_migration`` they are left arriving while the next step computes. Each payload is
checked against its checksum when it is in -- the snapshot that was its source was checked when it
arrived, and is checked again before it is sent -- so state damaged on its way fails the recovery
loudly (:class:`MigrationDamaged`) instead of training on, no longer the run it should equal.
"""
from __future__ import annotations

import torch

from elaswave.checkpoint import disk
from elaswave.model.units import layer_units, units_of
from elaswave.plan.chunks import ChunkKey, chunk_range
from elaswave.plan.recovery import Restore
from elaswave.snapshot.staging import checksum_of

TAG_MIGRATE = 2_000_000


class MigrationDamaged(RuntimeError):
    """A chunk's state arrived from its source other than it was sent."""


def local_chunk(ctx, st, restore: Restore, key: ChunkKey) -> torch.Tensor:
    """A chunk's state at the resume step from this rank's memory: its own, or a snapshot it holds."""
    _, kind = restore.sources[key]
    gen = restore.resume_step
    return st.optimizer.chunk(key, gen) if kind == "own" else ctx.pool.chunk(key, gen)


def _sums(*parts: torch.Tensor) -> torch.Tensor:
    """One checksum per part (its bytes), as int64 on the parts' device."""
    return torch.cat([checksum_of([p.reshape(-1).view(torch.uint8)], p.device) for p in parts])


def _check(got: torch.Tensor, sums: torch.Tensor, i: int, what: str, src: int, me: int, gen: int,
           keys: list[ChunkKey]) -> None:
    want, have = int(sums[i].item()), int(_sums(got)[0].item())
    if want != have:
        raise MigrationDamaged(
            f"rank {me}: the {what} of {len(keys)} chunks (first {keys[0]}) received from rank {src} for step "
            f"{gen} differ from what it sent (checksum {have:#x}, sent {want:#x}): training on them would not "
            "be the run it resumes")


def restore_chunks(ctx, st, world, new_owners, restore: Restore):
    """The state at the resume step of every chunk this rank owns next. Returns the chunks, the
    bytes received and the moments still arriving (``(wait, keys, buffer)`` each)."""
    gen, me = restore.resume_step, ctx.rank
    n = ctx.cfg.parallel.chunk_numel

    def local(key: ChunkKey) -> torch.Tensor:  # a kept snapshot is in host memory on a GPU
        return local_chunk(ctx, st, restore, key).to(ctx.device)

    works, params_in, moments_in = [], {}, []
    for (src, dst), keys in restore.transfers(new_owners).items():
        if src == me:
            payload = torch.stack([local(k) for k in keys])
            params, moments = payload[:, 0].contiguous(), payload[:, 1:].contiguous()
            for i, part in enumerate((_sums(params, moments), params, moments)):
                works.append((world.isend(part, dst, TAG_MIGRATE + i), part, f"chunks to rank {dst}"))
        elif dst == me:
            sums = torch.empty(2, dtype=torch.int64, device=ctx.device)
            params = torch.empty(len(keys), n, device=ctx.device)
            moments = torch.empty(len(keys), 2, n, device=ctx.device)
            works.append((world.irecv(sums, src, TAG_MIGRATE), sums, f"chunk checksums from rank {src}"))
            works.append((world.irecv(params, src, TAG_MIGRATE + 1), params, f"chunk parameters from rank {src}"))
            moments_in.append((world.irecv(moments, src, TAG_MIGRATE + 2), src, keys, sums, moments))
            params_in[src] = (keys, params, sums)
    for work, _, what in works:
        world.wait(work, f"restore: {what}")
    chunks: dict[ChunkKey, torch.Tensor] = {}
    received = 0
    for src, (keys, params, sums) in params_in.items():
        _check(params, sums, 0, "parameters", src, me, gen, keys)
        received += 3 * params.numel() * params.element_size()
        for k, row in zip(keys, params):
            chunks[k] = torch.cat([row.unsqueeze(0), torch.zeros(2, n, device=ctx.device)])
    arriving = []
    for work, src, keys, sums, moments in moments_in:
        def settle(work=work, src=src, keys=keys, sums=sums, moments=moments) -> None:
            world.wait(work, f"restore: chunk moments from rank {src}")
            _check(moments, sums, 1, "Adam moments", src, me, gen, keys)

        if ctx.cfg.elastic.overlap_migration:
            arriving.append((settle, keys, moments))
        else:
            settle()
            for k, part in zip(keys, moments):
                chunks[k][1:] = part
    fresh: dict = {}  # unit -> FlatLayer, built once
    from_disk = []
    for key, (src, kind) in restore.sources.items():
        if new_owners[key[0]][key[1]] != me or key in chunks:
            continue
        if src == me:
            chunks[key] = local(key)
        elif kind == "disk":
            from_disk.append(key)
        elif src is None:
            chunks[key] = initial_chunk(ctx, key, fresh)
    if from_disk:
        manifest = disk.at_step(ctx.checkpoint_root, gen)
        chunks.update({k: v.to(ctx.device) for k, v in disk.load_chunks(manifest, from_disk).items()})
    return chunks, received, arriving


def initial_chunk(ctx, key: ChunkKey, cache: dict) -> torch.Tensor:
    """A chunk's state at step 0: the initial weights (keyed, or the checkpoint's) and zero moments."""
    cfg, device = ctx.cfg, ctx.device
    unit, c = key
    if unit not in cache:
        cache.update({u.index: u for u in layer_units(ctx.model, units_of(ctx.model).layer_of(unit), cfg.train.seed)})
    flat = cache[unit].flat
    start, end = chunk_range(flat.numel(), cfg.parallel.chunk_numel, c)
    out = torch.zeros(3, cfg.parallel.chunk_numel, device=device)
    out[0, :end - start] = flat[start:end]
    return out
