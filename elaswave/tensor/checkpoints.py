"""Disk checkpoints of a tensor-parallel job: one dp x pp checkpoint per slice.

Each slice is a dp x pp job of shards, so it saves and loads exactly as one does
(:mod:`elaswave.checkpoint.disk`), under ``checkpoint.dir/shard-T-of-N``; a resume (or a
recovery that falls back to disk) takes the newest step that every slice completed. A checkpoint
is resumed at the degree that wrote it: re-cutting shards to another degree is not built, and a
directory written at another degree is one line, not a fresh start beside it.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from elaswave.checkpoint import disk
from elaswave.errors import ConfigError

_SHARD = re.compile(r"shard-(\d+)-of-(\d+)")


def shard_root(root: str, shard: int, tp: int) -> str:
    """Where slice ``shard`` of a degree-``tp`` job keeps its checkpoints (``root`` itself at tp 1)."""
    return root if tp == 1 else os.path.join(root, f"shard-{shard}-of-{tp}")


def shard_roots(root: str, tp: int) -> list[str]:
    return [shard_root(root, t, tp) for t in range(tp)]


def check_degree(root: str, tp: int) -> None:
    """One line if ``root`` holds checkpoints written at another tensor-parallel degree."""
    path = Path(root)
    if not path.is_dir():
        return
    degrees = {int(m.group(2)) for d in path.iterdir() if (m := _SHARD.fullmatch(d.name)) and d.is_dir()}
    if any(path.glob("step_*")):
        degrees.add(1)
    other = sorted(degrees - {tp})
    if other:
        raise ConfigError(f"checkpoint.dir={root!r} is invalid with parallel.tp={tp}: it holds checkpoints written at "
                          f"parallel.tp={other[0]}; resume at that degree (re-cutting shards to another degree is "
                          "not built), or use another checkpoint.dir")


def common_step(root: str, tp: int) -> int | None:
    """The newest step complete in every slice's checkpoints (any step, at tp 1), or None."""
    steps = None
    for r in shard_roots(root, tp):
        done = {m.step for m in disk.complete_steps(r)}
        steps = done if steps is None else steps & done
    return max(steps) if steps else None


def latest(root: str, shard: int, tp: int) -> disk.Manifest | None:
    """This slice's checkpoint of the newest step every slice completed; one line if the slices
    saved steps but none in common (a resume would otherwise start afresh beside them)."""
    step = common_step(root, tp)
    if step is None and tp > 1:
        saved = {t: sorted(m.step for m in disk.complete_steps(r)) for t, r in enumerate(shard_roots(root, tp))}
        if any(saved.values()):
            raise ConfigError(f"checkpoint.dir={root!r} is invalid: its slices completed no step in common (steps by "
                              f"shard: {saved}); resume from a directory whose slices all saved a step")
    return None if step is None else disk.at_step(shard_root(root, shard, tp), step)


def degree_of(path: str) -> int | None:
    """The tensor-parallel degree a checkpoint directory (or one of its slices) was written at, or
    None for a checkpoint without tensor parallelism."""
    p = Path(path).resolve()
    for part in (p, *list(p.parents)[:3]):  # a slice's folder, or a step or fence inside one
        if (m := _SHARD.fullmatch(part.name)) is not None:
            return int(m.group(2))
    found = [int(m.group(2)) for d in (p.iterdir() if p.is_dir() else ()) if (m := _SHARD.fullmatch(d.name))]
    return max(found) if found else None


def next_run(root: str, tp: int) -> int:
    """The run number of a job starting in ``root``: past every slice's runs."""
    return max(disk.next_run(r) for r in shard_roots(root, tp))
