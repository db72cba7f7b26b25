"""Where an export may be written (no torch: the config's edge checks it before anything runs).

A target that exists and is not empty is refused unless ``overwrite``; one that is, or holds, a
folder the job reads or keeps (``model.init_from``, ``checkpoint.dir``, the corpora) is refused
always: replacing the target would delete it.
"""
from __future__ import annotations

import os
from typing import Mapping

from elaswave.errors import ConfigError

EXPORT_DTYPES = ("auto", "bf16", "fp32", "fp16")
EXPORT_LORA = ("adapter", "merged")
"""What an export of a LoRA run writes: the adapters as peft saves them, or a whole merged model."""


class ExportError(ConfigError):
    """An export cannot be written where asked; one line naming the path or shard."""


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def check_target(out: str, overwrite: bool, key: str = "checkpoint.export_hf",
                 keep: Mapping[str, str | list[str]] = {}) -> None:
    """Before anything is trained or read: ``out`` may be written. ``keep``: setting -> the path (or
    paths) the export must never replace."""
    for setting, paths in keep.items():
        for path in [paths] if isinstance(paths, str) else paths:
            if path and _inside(path, out):
                raise ExportError(f"{key}={out!r} is invalid: it is or holds {setting}={path!r}, which an export "
                                  "must never replace; export to another folder")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ExportError(f"{key}={out!r} is invalid: it exists and is not a folder")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise ExportError(f"{key}={out!r} is invalid: it exists and is not empty; export to a new folder, or "
                          "replace it with checkpoint.overwrite=true (elaswave export --overwrite)")
