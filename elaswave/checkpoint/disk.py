"""Disk checkpoints through torch.distributed.checkpoint (DCP), written in the background, fenced.

A checkpoint of generation ``g`` (the state at the start of step ``g``) is every ZeRO chunk's
``[3, chunk_numel]`` state -- parameter slice, exp_avg, exp_avg_sq -- which is the whole training
state: data order and dropout are keyed to the step and micro-batch. Each rank saves the chunks it
owns with DCP into its own directory; the job's lowest rank adds a manifest naming the owner of
every chunk. No collective is involved, so a save never waits on a peer and a dead peer cannot
stall it. Chunks are named by ``(layer, chunk)``, not by rank or slot, so a checkpoint loads into
any dp x pp layout with the same ``parallel.chunk_numel``.

    DIR/step_00000010/run0-epoch2/manifest.json
    DIR/step_00000010/run0-epoch2/rank_2/.metadata, *.distcp      (DCP, no_dist)

Every checkpoint is written under its *fence*: the run of this directory that wrote it (each
start in the directory is the next run) and the agreed epoch of the membership its writers were
in. A rank left out of the job (paused, cut off) may come back still believing in an old epoch;
what it writes lands beside the job's, never over it, and loses to anything newer: the newest
checkpoint is the one with the newest fence, then the highest step. A save under an older fence
than one already in the directory is not written at all.

A checkpoint is complete when its manifest and every owner's ``.metadata`` (DCP writes it last)
exist; a save cut short by a death is simply never complete, and loading takes the newest complete one.
(Checkpoints written before fences, ``step_*/manifest.json``, still load, as older than any fenced one.)
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import pickle
import re
import shutil
import threading
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple, Sequence

import torch

from elaswave.model.lora_config import LoraConfig
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


class Fence(NamedTuple):
    """Who wrote a checkpoint: the run of its directory, then the agreed epoch within that run."""
    run: int
    epoch: int

    @property
    def name(self) -> str:
        return f"run{self.run}-epoch{self.epoch}"


UNFENCED = Fence(-1, -1)
"""A checkpoint from before fences (its manifest directly in the step's directory)."""
_FENCE_NAME = re.compile(r"run(\d+)-epoch(\d+)")


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def fence_dir(root: str | Path, step: int, fence: Fence) -> Path:
    return step_dir(root, step) if fence == UNFENCED else step_dir(root, step) / fence.name


def _parse_fence(name: str) -> Fence | None:
    m = _FENCE_NAME.fullmatch(name)
    return Fence(int(m.group(1)), int(m.group(2))) if m else None


def _parse_step(name: str) -> int | None:
    try:
        return int(name[len("step_"):]) if name.startswith("step_") else None
    except ValueError:
        return None


def _name(key: ChunkKey) -> str:
    return f"chunk.{key[0]}.{key[1]}"


@dataclass(frozen=True)
class Manifest:
    root: str
    step: int
    owners: Owners
    chunk_numel: int
    model: dict
    fence: Fence = UNFENCED
    source: dict = field(default_factory=dict)
    """Where the job's model and data came from (``init_from``, ``data``: absolute paths), for an
    offline export to carry the input folder's config and tokenizer."""
    data: dict = field(default_factory=dict)
    """What the job read and how (corpus and tokenizer hashes, the sampler's settings): a resume
    must read the same samples in the same order (empty in checkpoints written before it)."""
    records: tuple = ()
    """The metrics records of the steps before this one not yet written when it was saved (a
    step's record waits for the next step's exchange): a run that resumes here writes them."""

    @property
    def path(self) -> Path:
        return fence_dir(self.root, self.step, self.fence)

    def part(self, rank: int) -> Path:
        return self.path / f"rank_{rank}"

    def owner_of(self, key: ChunkKey) -> int:
        return self.owners[key[0]][key[1]]

    def is_complete(self) -> bool:
        return all((self.part(r) / ".metadata").is_file() for r in {r for row in self.owners for r in row})

    def check_data(self, data: dict) -> None:
        """A clear error if resuming here would read other samples than the run that saved it."""
        changed = [f"{k} {self.data.get(k)!r} there, {v!r} here" for k, v in data.items()
                   if self.data and self.data.get(k) != v]
        if changed:
            raise CheckpointError(f"checkpoint {self.path} was trained on other data or batches, so resuming "
                                  f"would re-read or skip samples: {', '.join(changed)}; restore them, or start "
                                  "afresh in another checkpoint.dir")

    def check_fits(self, model: dict, chunk_numel: int, owners: Owners) -> None:
        """A clear error if this checkpoint was written by another model or chunking."""
        # A checkpoint from before model.lora existed was of a model without adapters.
        written = {"lora": json.loads(json.dumps(asdict(LoraConfig()))), **self.model}
        changed = [f"model.{k}={written.get(k)!r} there, {v!r} here" for k, v in model.items() if written.get(k) != v]
        if changed:
            raise CheckpointError(f"checkpoint {self.path} is from another model: " + ", ".join(changed))
        if self.chunk_numel != chunk_numel:
            raise CheckpointError(f"checkpoint {self.path} has "
                                  f"parallel.chunk_numel={self.chunk_numel}; this job has {chunk_numel}")
        if [len(row) for row in self.owners] != [len(row) for row in owners]:
            raise CheckpointError(f"checkpoint {self.path} has layers of other sizes "
                                  f"({[len(r) for r in self.owners]} chunks per layer, here {[len(r) for r in owners]})")


def read_manifest(path: Path) -> Manifest | None:
    """The manifest in ``path`` (a fence's directory, or an unfenced step's), or None."""
    path = Path(path)
    try:
        doc = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    fence = Fence(*doc["fence"]) if "fence" in doc else UNFENCED
    root = path.parent if fence == UNFENCED else path.parent.parent
    return Manifest(str(root), doc["step"], tuple(tuple(row) for row in doc["owners"]),
                    doc["chunk_numel"], doc["model"], fence, doc.get("source", {}), doc.get("data", {}),
                    tuple(doc.get("records", ())))


def _writes(root: str | Path):
    """(fence, step, directory) of every save begun under ``root``, complete or not."""
    root = Path(root)
    if not root.is_dir():
        return
    for sd in root.glob("step_*"):
        step = _parse_step(sd.name)
        if step is None or not sd.is_dir():
            continue
        if (sd / MANIFEST).is_file():
            yield UNFENCED, step, sd
        try:
            inside = list(sd.iterdir())
        except OSError:  # another rank's prune removed it meanwhile
            continue
        for fd in inside:
            fence = _parse_fence(fd.name)
            if fence is not None and fd.is_dir():
                yield fence, step, fd


def _complete_in(dirs) -> list[Manifest]:
    found = (read_manifest(d) for d in dirs)
    return sorted((m for m in found if m is not None and m.is_complete()), key=lambda m: (m.fence, m.step))


def complete_steps(root: str | Path) -> list[Manifest]:
    """Every complete checkpoint under ``root``, oldest first: by fence, then step."""
    return _complete_in(d for _, _, d in _writes(root))


def latest(root: str | Path) -> Manifest | None:
    done = complete_steps(root)
    return done[-1] if done else None


def at_step(root: str | Path, step: int) -> Manifest | None:
    """The newest complete checkpoint of ``step`` (the newest fence that completed it), or None."""
    done = _complete_in(d for _, s, d in _writes(root) if s == step)
    return done[-1] if done else None


def is_complete(root: str | Path, step: int) -> bool:
    """Whether some complete checkpoint of ``step`` is under ``root``."""
    return at_step(root, step) is not None


def newest_fence(root: str | Path) -> Fence | None:
    """The newest fence any save under ``root`` was begun with (complete or not), or None."""
    return max((f for f, _, _ in _writes(root)), default=None)


def next_run(root: str | Path) -> int:
    """The run number of a job starting in ``root``: one past every run that wrote there."""
    newest = newest_fence(root)
    return 0 if newest is None else newest.run + 1


def named(path: str | Path) -> Manifest | None:
    """The complete checkpoint ``path`` names: a fence's directory, a step's (its newest fence),
    or a checkpoint directory (its newest)."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        m = read_manifest(path)
        return m if m is not None and m.is_complete() else None
    step = _parse_step(path.name)
    if step is not None:
        return at_step(path.parent, step)
    return latest(path)


def load_chunks(manifest: Manifest, keys: Sequence[ChunkKey]) -> dict[ChunkKey, torch.Tensor]:
    """The saved state of ``keys``, each read from the directory of the rank that owned it."""
    by_owner: dict[int, list[ChunkKey]] = {}
    for key in keys:
        by_owner.setdefault(manifest.owner_of(key), []).append(key)
    out: dict[ChunkKey, torch.Tensor] = {}
    for owner, mine in sorted(by_owner.items()):
        state = {_name(k): torch.empty(3, manifest.chunk_numel) for k in mine}
        reader = _safe_reader()(manifest.part(owner))
        reader.read_metadata()  # its refusal as our own error (inside dcp.load it is wrapped and retried)
        with _single_process():
            _dcp().load(state, storage_reader=reader, no_dist=True)
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


def _dcp():
    """torch.distributed.checkpoint, imported on first use: it pulls in DTensor's operators and
    sympy, about 1 s of a rank's start-up (measured), which a job without checkpoint.dir never needs."""
    import torch.distributed.checkpoint as dcp
    return dcp


@functools.cache
def _safe_reader() -> type:
    """DCP's file-system reader, reading its metadata with :class:`_MetadataUnpickler`."""
    class SafeReader(_dcp().FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with open(Path(self.path) / ".metadata", "rb") as fh:
                metadata = _MetadataUnpickler(fh).load()
            if hasattr(metadata, "storage_meta"):  # as the base class does (torch >= 2.4)
                from torch.distributed.checkpoint.metadata import StorageMeta

                metadata.storage_meta = metadata.storage_meta or StorageMeta()
                metadata.storage_meta.load_id = getattr(self, "load_id", None)
            return metadata
    return SafeReader


class Checkpointer:
    """This rank's side: saves its owned chunks every ``every`` steps on a background thread, each
    under the fence of the run (``run``, set once the job knows it) and the epoch it was made in."""

    def __init__(self, root: str, rank: int, every: int, keep: int, model: dict, chunk_numel: int, run: int = 0,
                 source: dict | None = None, data: dict | None = None):
        self.root, self.rank, self.every, self.keep = root, rank, every, keep
        self.model, self.chunk_numel, self.run, self.source = model, chunk_numel, run, source or {}
        self.data = data or {}
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.fenced_off: list[tuple[int, Fence, Fence]] = []
        """(generation, its fence, the newer one found) of each save not written."""
        # Imported now, at start-up: on the first save's thread it would take a second of the step.
        _dcp()

    def due(self, gen: int) -> bool:
        return self.every > 0 and gen > 0 and gen % self.every == 0

    def save(self, gen: int, owners: Owners, keys: Sequence[ChunkKey], payload: torch.Tensor,
             is_writer: bool, epoch: int, records: Sequence[dict] = ()) -> None:
        """Start saving generation ``gen`` as agreed in ``epoch``; ``payload`` is ``[len(keys), 3, chunk_numel]``;
        ``records``: the metrics records of earlier steps not written yet (:attr:`Manifest.records`)."""
        self.wait()
        # Copies made now: training goes on updating the live state while the thread writes.
        state = {_name(k): payload[i].detach().to("cpu", copy=True) for i, k in enumerate(keys)}
        fence = Fence(self.run, epoch)
        manifest = {"step": gen, "fence": list(fence), "owners": [list(row) for row in owners],
                    "chunk_numel": self.chunk_numel, "model": self.model, "source": self.source, "data": self.data,
                    "tokens_consumed": gen * self.data.get("tokens_per_step", 0),
                    "records": [r for r in records if r["step"] < gen]}
        self._thread = threading.Thread(target=self._write, args=(gen, fence, state, manifest, is_writer),
                                        name="elaswave-checkpoint", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise CheckpointError(f"saving a checkpoint under {self.root} failed: {error}") from error

    def _newer_than(self, fence: Fence) -> Fence | None:
        newest = newest_fence(self.root)
        return newest if newest is not None and newest > fence else None

    def _write(self, gen: int, fence: Fence, state: dict, manifest: dict, is_writer: bool) -> None:
        try:
            # Checked before the part and again before the manifest: a writer of an older epoch
            # adds nothing once a newer one has begun writing (what it wrote before that, under
            # its own fence, loses to the newer anyway).
            folder = fence_dir(self.root, gen, fence)
            newer = self._newer_than(fence)
            if newer is None:
                part = folder / f"rank_{self.rank}"
                part.mkdir(parents=True, exist_ok=True)
                with _single_process():
                    _dcp().save(state, checkpoint_id=str(part), no_dist=True)
                newer = self._newer_than(fence)
            if newer is not None:
                self.fenced_off.append((gen, fence, newer))
                return
            if is_writer:
                (folder / (MANIFEST + ".tmp")).write_text(json.dumps(manifest))
                os.replace(folder / (MANIFEST + ".tmp"), folder / MANIFEST)
            # Every rank prunes after its part: whichever finishes last sees the new one complete.
            self._prune()
        except BaseException as exc:  # surfaced on the training thread by the next wait()
            try:
                newer = self._newer_than(fence)
            except OSError:
                newer = None
            if newer is not None:  # a newer fence's prune took its folder: the same as not written
                self.fenced_off.append((gen, fence, newer))
                return
            self.error = exc

    def _prune(self) -> None:
        """Delete every save older (by fence, then step) than the ``keep`` newest complete checkpoints."""
        done = complete_steps(self.root)
        if len(done) < self.keep:
            return
        oldest_kept = (done[-self.keep].fence, done[-self.keep].step)
        for fence, step, path in list(_writes(self.root)):
            if (fence, step) < oldest_kept:
                if fence == UNFENCED:  # its parts are beside the fences' folders: remove those alone
                    (path / MANIFEST).unlink(missing_ok=True)
                    for part in path.glob("rank_*"):
                        shutil.rmtree(part, ignore_errors=True)
                else:
                    shutil.rmtree(path, ignore_errors=True)
                with contextlib.suppress(OSError):
                    path.parent.rmdir() if fence != UNFENCED else path.rmdir()  # once empty
