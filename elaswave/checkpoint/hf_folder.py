"""A Hugging Face folder written out as a drop-in for the one that came in.

What it holds: the weights in the export's dtype (``checkpoint.export_dtype``; ``auto`` is the
input's), one ``model.safetensors`` or shards of at most ``checkpoint.max_shard_gb`` with their
index; the input's ``config.json`` written back field for field (only the dtype can change: training
changes no other field), and the input's tokenizer files, ``generation_config.json`` and
``special_tokens_map.json``. A model built from a preset has no input folder: its config is made
from the model's shape, and a prepared corpus's tokenizer is copied with its end-of-document id as
``eos_token_id``.

Writing is atomic and never deletes what a user did not ask to replace: every file goes into a
sibling staging folder; every shard is read back (its header names exactly the tensors posted for
it) before the index is written; the folder is then renamed into a target that does not exist (or
is empty). A non-empty target is refused unless ``overwrite``; the ``init_from`` folder, and a
folder holding it, the checkpoint directory or the corpus, are refused always. Across hosts the
target's parent must be one shared filesystem: each writing rank writes its shards into the
staging folder, and the finishing rank refuses to finish when one is not there.
"""
from __future__ import annotations

import fnmatch
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import torch

from elaswave.checkpoint.target import EXPORT_DTYPES, ExportError
from elaswave.model.config import read_hf_config, to_hf_config
from elaswave.model.hf import INDEX

SINGLE = "model.safetensors"
_TORCH = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
_HF_NAMES = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16", "BF16": "bf16", "F32": "fp32", "F16": "fp16"}
COMPANIONS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
              "added_tokens.json", "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja",
              "chat_template.json")
"""The files beside the weights that make a folder usable as it came (transformers' names)."""


@dataclass
class Source:
    """Where the exported folder's config and companion files come from."""

    config: dict | None = None
    """The input's config.json (None: a model built from a preset)."""
    files: list[Path] = field(default_factory=list)
    dtype: str = "bf16"
    """The input's dtype, one of EXPORT_DTYPES but auto."""
    eos_token_id: int | None = None
    chat_template: str | None = None
    """The template the training data was rendered with, where the companion files lack it (a base
    folder fine-tuned on conversations) or hold another (data.chat_template=corpus): written into
    the export's tokenizer_config.json (and its chat_template.jinja, if it has one)."""


def source_of(init_from: str, data_path: str = "") -> Source:
    """The export's source: the ``init_from`` folder, else a prepared corpus's tokenizer; and the
    chat template the corpus was rendered with, where the folder does not carry that one."""
    from elaswave.data import chat

    rendered = chat.corpus_template(data_path) if data_path else None
    if init_from:
        doc = read_hf_config(init_from)
        files = [Path(init_from) / n for n in COMPANIONS if (Path(init_from) / n).is_file()]
        own = chat.folder_template(init_from)
        carried = rendered[1] if rendered and (own is None or chat.template_sha256(own.text) != rendered[0]) else None
        return Source(doc, files, _input_dtype(init_from, doc), chat_template=carried)
    manifest = Path(data_path) / "manifest.json" if data_path else None
    if manifest is not None and manifest.is_file():
        tok = json.loads(manifest.read_text()).get("tokenizer") or {}
        files = [Path(data_path) / tok["file"]] if tok.get("file") else []
        return Source(None, [f for f in files if f.is_file()], "bf16", tok.get("eod_id"),
                      chat_template=rendered[1] if rendered else None)
    return Source()


def _input_dtype(path: str, doc: dict) -> str:
    """config.json's dtype (transformers 5 ``dtype``, 4.x ``torch_dtype``), else the first tensor's."""
    name = doc.get("dtype") or doc.get("torch_dtype")
    if name in _HF_NAMES:
        return _HF_NAMES[name]
    for f in sorted(Path(path).glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        kinds = [v["dtype"] for k, v in header.items() if k != "__metadata__"]
        if kinds and kinds[0] in _HF_NAMES:
            return _HF_NAMES[kinds[0]]
    return "fp32"


def export_dtype(setting: str, source: Source) -> torch.dtype:
    if setting not in EXPORT_DTYPES:
        raise ExportError(f"checkpoint.export_dtype={setting!r} is invalid: must be one of {', '.join(EXPORT_DTYPES)}")
    return _TORCH[source.dtype if setting == "auto" else setting]


def config_doc(m, source: Source, dtype: torch.dtype) -> dict:
    """The exported config.json: the input's, field for field, with the export's dtype; or one made
    from the model's shape (``m``, a ModelConfig) for a model built from a preset."""
    name = str(dtype).removeprefix("torch.")
    if source.config is not None:
        doc = dict(source.config)
        spelled = [k for k in ("dtype", "torch_dtype") if k in doc] or ["torch_dtype"]
        doc.update({k: name for k in spelled})
        return doc
    doc = to_hf_config(m)
    doc["torch_dtype"] = name
    if source.eos_token_id is not None:
        doc["eos_token_id"] = source.eos_token_id
    return doc


# -- where it goes ------------------------------------------------------------------------------------
def staging_dir(out: str | Path) -> Path:
    out = Path(os.path.abspath(out))  # "." has no name of its own; its absolute path does
    return out.parent / f".{out.name}.partial"


def clear_staging(out: str | Path) -> None:
    """What a failed earlier export left must not mix into this one."""
    shutil.rmtree(staging_dir(out), ignore_errors=True)


# -- the weights --------------------------------------------------------------------------------------
def pieces(layers: Iterable[tuple[int, dict[str, torch.Tensor]]],
           max_bytes: int) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """Whole layers ``(index, tensors)``, in order, grouped into pieces of at most ``max_bytes`` (a
    larger layer alone); each piece with its first layer's index."""
    out: list[tuple[int, dict[str, torch.Tensor]]] = []
    size = 0
    for index, tensors in layers:
        n = nbytes(tensors)
        if not out or size + n > max_bytes:
            out.append((index, {}))
            size = 0
        out[-1][1].update(tensors)
        size += n
    return out


def write_part(out: str | Path, tag: str, first_layer: int, tensors: Mapping[str, torch.Tensor]) -> dict:
    """One piece into the staging folder under a provisional name; what the finisher needs of it."""
    return _save(staging_dir(out), f"part-{tag}.safetensors", first_layer, tensors)


def _save(stage: Path, name: str, first_layer: int, tensors: Mapping[str, torch.Tensor]) -> dict:
    from safetensors.torch import save_file
    stage.mkdir(parents=True, exist_ok=True)
    save_file(dict(tensors), str(stage / name), metadata={"format": "pt"})
    return {"file": name, "names": sorted(tensors), "bytes": nbytes(tensors), "first_layer": first_layer}


def nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _checked(stage: Path, part: dict) -> None:
    """A shard is there and its header names exactly the tensors posted for it."""
    from safetensors import safe_open
    path = stage / part["file"]
    if not path.is_file():
        raise ExportError(f"checkpoint.export_hf: shard {part['file']} is not in {stage}: a writing rank wrote it "
                          "elsewhere -- across hosts the export's parent folder must be one filesystem all share")
    try:
        with safe_open(str(path), framework="pt") as fh:
            names = sorted(fh.keys())
    except Exception as exc:  # safetensors raises its own error types for a truncated header
        raise ExportError(f"checkpoint.export_hf: shard {path} cannot be read back ({exc})") from None
    if names != sorted(part["names"]):
        raise ExportError(f"checkpoint.export_hf: shard {path} holds {len(names)} tensors, {len(part['names'])} "
                          "were written to it")


def finish(out: str | Path, parts: list[dict], doc: dict, source: Source, overwrite: bool,
           max_shard_bytes: int, single: str = SINGLE, config_name: str = "config.json") -> Path:
    """Check every posted part, join neighbours into shards of at most ``max_shard_bytes`` (the
    writers cut parts by layer holder, not by size), name them in the order given, write the index,
    ``doc`` as ``config_name`` and the companion files, then move the folder into place. ``single``:
    the name of a lone shard (a peft adapter folder's is adapter_model.safetensors)."""
    out, stage = Path(os.path.abspath(out)), staging_dir(out)
    for part in parts:
        _checked(stage, part)
    posted = {p["file"] for p in parts}
    for leftover in stage.glob("*.safetensors"):  # parts of an attempt that a failure cut short
        if leftover.name not in posted:
            leftover.unlink()
    shards = [_joined(stage, group, k) for k, group in enumerate(_groups(parts, max_shard_bytes))]
    names = [single] if len(shards) == 1 else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
                                               for k in range(len(shards))]
    for shard, name in zip(shards, names):
        os.replace(stage / shard["file"], stage / name)
    if len(shards) > 1:
        weight_map = {t: name for shard, name in zip(shards, names) for t in shard["names"]}
        index = {"metadata": {"total_size": sum(p["bytes"] for p in shards)},
                 "weight_map": dict(sorted(weight_map.items()))}
        (stage / INDEX).write_text(json.dumps(index, indent=2))
    for f in source.files:
        shutil.copyfile(f, stage / f.name)
    if source.chat_template is not None:
        settings = stage / "tokenizer_config.json"
        doc_t = json.loads(settings.read_text()) if settings.is_file() else {}
        settings.write_text(json.dumps({**doc_t, "chat_template": source.chat_template}, indent=2) + "\n")
        if (stage / "chat_template.jinja").is_file():  # transformers reads this one first
            (stage / "chat_template.jinja").write_text(source.chat_template)
    (stage / config_name).write_text(json.dumps(doc, indent=2) + "\n")
    return install(stage, out, overwrite)


def _groups(parts: list[dict], max_bytes: int) -> list[list[dict]]:
    out: list[list[dict]] = []
    size = 0
    for part in parts:
        if not out or size + part["bytes"] > max_bytes:
            out.append([])
            size = 0
        out[-1].append(part)
        size += part["bytes"]
    return out


def _joined(stage: Path, group: list[dict], k: int) -> dict:
    """One part as it is; several read back and written as one file (at most one shard in memory)."""
    if len(group) == 1:
        return group[0]
    from safetensors.torch import load_file
    tensors: dict[str, torch.Tensor] = {}
    for part in group:
        tensors.update(load_file(str(stage / part["file"])))
    joined = _save(stage, f"joined-{k:05d}.safetensors", group[0]["first_layer"], tensors)
    for part in group:
        (stage / part["file"]).unlink()
    return joined


EXPORTED = ("*.safetensors", "*.safetensors.index.json", "config.json", "adapter_config.json", *COMPANIONS)
"""What an export writes (of any kind): in a folder it replaces, these go; anything else stays."""


def install(stage: Path, out: Path, overwrite: bool) -> Path:
    """Rename the finished folder into ``out``; an existing one is replaced only with
    ``overwrite``: overwrite replaces a model, not the folder's other files. The earlier export's
    weights, index and configs (no stale shard or adapter config is left to be read with the new
    ones) wait aside until the new files are in; what no export writes (a README, the user's
    notes) never moves, so no failure or kill can leave it in a folder a later export deletes."""
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        os.replace(stage, out)
        return out
    if not overwrite:
        raise ExportError(f"checkpoint.export_hf={str(out)!r}: it appeared during the run and is not empty; the "
                          f"export is complete in {stage} -- move it where you want it")
    old = out.parent / f".{out.name}.replaced"
    shutil.rmtree(old, ignore_errors=True)
    try:
        old.mkdir()
        for entry in out.iterdir():
            if any(fnmatch.fnmatch(entry.name, pattern) for pattern in EXPORTED):
                os.replace(entry, old / entry.name)
        for entry in stage.iterdir():
            os.replace(entry, out / entry.name)
        stage.rmdir()
    except OSError as exc:
        raise ExportError(f"checkpoint.export_hf={str(out)!r}: replacing the model in it failed ({exc}); the new "
                          f"export's files not yet moved are in {stage}, the old model's in {old}") from None
    shutil.rmtree(old, ignore_errors=True)
    return out
