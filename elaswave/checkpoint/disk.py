"""Disk checkpoints through torch.distributed.checkpoint (DCP), written in the background.

A checkpoint of generation ``g`` (the state at the start of step ``g``) is every ZeRO chunk's
``[3, chunk_numel]`` state -- parameter slice, exp_avg, exp_avg_sq -- which is the whole training
state: data order and dropout are keyed to the step and micro-batch. Each rank saves the chunks it
owns with DCP into its own directory; the job's lowest rank adds a manifest naming the owner of
every chunk. No collective is involved, so a save never waits on a peer and a dead peer cannot
stall it. Chunks are named by ``(layer, chunk)``, not by rank or slot, so a checkpoint loads into
any dp x pp layout with the same ``parallel.chunk_numel``.

    DIR/step_00000010/manifest.json
    DIR/step_00000010/rank_2/.metadata, *.distcp      (DCP, no_dist)

A checkpoint is complete when its manifest and every owner's ``.metadata`` (DCP writes it last)
exist; a save cut short by a death is simply never complete, and loading takes the newest complete one.
"""
from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed.checkpoint as dcp

from elaswave.plan.chunks import ChunkKey, Owners

MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used for this job; the message says why."""


@contextlib.contextmanager
def _single_process():
    # DCP warns that it "assumes" a single process even when told so with no_dist=True.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def _rank_dir(root: str | Path, step: int, rank: int) -> Path:
    return step_dir(root, step) / f"rank_{rank}"


def _name(key: ChunkKey) -> str:
    return f"chunk.{key[0]}.{key[1]}"


@dataclass(frozen=True)
class Manifest:
    root: str
    step: int
    owners: Owners
    chunk_numel: int
    model: dict

    def owner_of(self, key: ChunkKey) -> int:
        return self.owners[key[0]][key[1]]

    def is_complete(self) -> bool:
        return all((_rank_dir(self.root, self.step, r) / ".metadata").is_file()
                   for r in {r for row in self.owners for r in row})

    def check_fits(self, model: dict, chunk_numel: int, owners: Owners) -> None:
        """A clear error if this checkpoint was written by another model or chunking."""
        changed = [f"model.{k}={self.model.get(k)!r} there, {v!r} here" for k, v in model.items()
                   if self.model.get(k) != v]
        if changed:
            raise CheckpointError(f"checkpoint {step_dir(self.root, self.step)} is from another model: "
                                  + ", ".join(changed))
        if self.chunk_numel != chunk_numel:
            raise CheckpointError(f"checkpoint {step_dir(self.root, self.step)} has "
                                  f"parallel.chunk_numel={self.chunk_numel}; this job has {chunk_numel}")
        if [len(row) for row in self.owners] != [len(row) for row in owners]:
            raise CheckpointError(f"checkpoint {step_dir(self.root, self.step)} has layers of other sizes "
                                  f"({[len(r) for r in self.owners]} chunks per layer, here {[len(r) for r in owners]})")


def read_manifest(path: Path) -> Manifest | None:
    try:
        doc = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return Manifest(str(path.parent), doc["step"], tuple(tuple(row) for row in doc["owners"]),
                    doc["chunk_numel"], doc["model"])


def is_complete(root: str | Path, step: int) -> bool:
    """Whether the checkpoint of ``step`` under ``root`` has its manifest and every owner's part."""
    manifest = read_manifest(step_dir(root, step))
    return manifest is not None and manifest.is_complete()


def complete_steps(root: str | Path) -> list[Manifest]:
    """Every complete checkpoint under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = (read_manifest(p) for p in sorted(root.glob("step_*")) if p.is_dir())
    return [m for m in found if m is not None and m.is_complete()]


def latest(root: str | Path) -> Manifest | None:
    done = complete_steps(root)
    return done[-1] if done else None


def load_chunks(manifest: Manifest, keys: Sequence[ChunkKey]) -> dict[ChunkKey, torch.Tensor]:
    """The saved state of ``keys``, each read from the directory of the rank that owned it."""
    by_owner: dict[int, list[ChunkKey]] = {}
    for key in keys:
        by_owner.setdefault(manifest.owner_of(key), []).append(key)
    out: dict[ChunkKey, torch.Tensor] = {}
    for owner, mine in sorted(by_owner.items()):
        state = {_name(k): torch.empty(3, manifest.chunk_numel) for k in mine}
        reader = _SafeReader(_rank_dir(manifest.root, manifest.step, owner))
        reader.read_metadata()  # its refusal as our own error (inside dcp.load it is wrapped and retried)
        with _single_process():
            dcp.load(state, storage_reader=reader, no_dist=True)
        out.update({k: state[_name(k)] for k in mine})
    return out


class _MetadataUnpickler(pickle.Unpickler):
    """DCP reads tensors with ``torch.load(weights_only=True)`` but its ``.metadata`` with plain
    pickle, which can run any code a checkpoint folder carries. This one builds only what DCP's
    metadata is made of, and refuses anything else."""

    def find_class(self, module: str, name: str):
        obj = getattr(torch, name, None) if module == "torch" else None
        if (module.startswith("torch.distributed.checkpoint.") or (module, name) in _METADATA_NAMES
                or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)) or obj is torch.Size):
            return super().find_class(module, name)
        raise CheckpointError(f"a checkpoint's metadata asks to load {module}.{name}, which a checkpoint "
                              "does not contain; refusing to read it")


_METADATA_NAMES = {("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                   ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")}


class _SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        with open(Path(self.path) / ".metadata", "rb") as fh:
            metadata = _MetadataUnpickler(fh).load()
        if hasattr(metadata, "storage_meta"):  # as the base class does (torch >= 2.4)
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = metadata.storage_meta or StorageMeta()
            metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


class Checkpointer:
    """This rank's side: saves its owned chunks every ``every`` steps on a background thread."""

    def __init__(self, root: str, rank: int, every: int, keep: int, model: dict, chunk_numel: int):
        self.root, self.rank, self.every, self.keep = root, rank, every, keep
        self.model, self.chunk_numel = model, chunk_numel
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def due(self, gen: int) -> bool:
        return self.every > 0 and gen > 0 and gen % self.every == 0

    def save(self, gen: int, owners: Owners, keys: Sequence[ChunkKey], payload: torch.Tensor,
             is_writer: bool) -> None:
        """Start saving generation ``gen``; ``payload`` is ``[len(keys), 3, chunk_numel]``."""
        self.wait()
        # Copies made now: training goes on updating the live state while the thread writes.
        state = {_name(k): payload[i].detach().to("cpu", copy=True) for i, k in enumerate(keys)}
        manifest = {"step": gen, "owners": [list(row) for row in owners], "chunk_numel": self.chunk_numel,
                    "model": self.model}
        self._thread = threading.Thread(target=self._write, args=(gen, state, manifest, is_writer),
                                        name="elaswave-checkpoint", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise CheckpointError(f"saving a checkpoint under {self.root} failed: {error}") from error

    def _write(self, gen: int, state: dict, manifest: dict, is_writer: bool) -> None:
        try:
            target = _rank_dir(self.root, gen, self.rank)
            target.mkdir(parents=True, exist_ok=True)
            with _single_process():
                dcp.save(state, checkpoint_id=str(target), no_dist=True)
            if is_writer:
                tmp = step_dir(self.root, gen) / (MANIFEST + ".tmp")
                tmp.write_text(json.dumps(manifest))
                os.replace(tmp, step_dir(self.root, gen) / MANIFEST)
            # Every rank prunes after its part: whichever finishes last sees the new one complete.
            self._prune()
        except BaseException as exc:  # surfaced on the training thread by the next wait()
            self.error = exc

    def _prune(self) -> None:
        """Delete what is older than the ``keep`` newest complete checkpoints."""
        done = complete_steps(self.root)
        if len(done) < self.keep:
            return
        oldest_kept = done[-self.keep].step
        for path in Path(self.root).glob("step_*"):
            try:
                step = int(path.name.split("_")[1])
            except (IndexError, ValueError):
                continue
            if step < oldest_kept:
                shutil.rmtree(path, ignore_errors=True)
