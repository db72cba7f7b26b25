"""Token corpora: the standard library's own source (default, no download), text files, or a
flat uint16 token file (nanoGPT-style ``.bin``). A corpus is one 1-D int64 tensor of token ids."""
from __future__ import annotations

import os
import sysconfig

import torch

from elaswave.config import ConfigError, DataConfig


def _text_files(root: str) -> list[str]:
    """Files under ``root`` in a fixed (sorted) order, so every rank reads the same corpus."""
    if os.path.isfile(root):
        return [root]
    found = []
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        found.extend(os.path.join(folder, f) for f in sorted(files))
    return found


def _read_bytes(files: list[str], limit: int, suffix: str | None) -> bytes:
    parts, total = [], 0
    for path in files:
        if suffix and not path.endswith(suffix):
            continue
        try:
            with open(path, "rb") as fh:
                data = fh.read(limit - total)
        except OSError:
            continue  # unreadable files (permissions, broken links) are simply not part of it
        parts.append(data)
        total += len(data)
        if total >= limit:
            break
    return b"".join(parts)


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def corpus_bytes(cfg: DataConfig) -> int:
    """Bytes of the tensor :func:`load_corpus` returns (int64 tokens), from file sizes alone: what
    every rank can know without reading the corpus (the memory model of a stage that reads batches)."""
    if cfg.source == "bin":
        return 8 * (os.path.getsize(cfg.path) // 2)
    root = stdlib_root() if cfg.source == "stdlib" else cfg.path
    suffix = ".py" if cfg.source == "stdlib" else None
    total = 0
    for path in _text_files(root):
        if (suffix and not path.endswith(suffix)) or not os.path.isfile(path) or not os.access(path, os.R_OK):
            continue
        total += os.path.getsize(path)
        if total >= cfg.max_corpus_bytes:
            return 8 * cfg.max_corpus_bytes
    return 8 * total


def load_corpus(cfg: DataConfig, vocab_size: int, min_tokens: int) -> torch.Tensor:
    """All tokens of the configured corpus; raises ConfigError if it is unusable."""
    if cfg.source == "bin":
        size = os.path.getsize(cfg.path)
        if size % 2:
            raise ConfigError(f"data.path={cfg.path!r} is invalid: a uint16 token file has an even size, got {size} bytes")
        with open(cfg.path, "rb") as fh:
            raw = bytearray(fh.read())
        tokens = torch.frombuffer(raw, dtype=torch.int16).to(torch.int64) & 0xFFFF
    else:
        root = stdlib_root() if cfg.source == "stdlib" else cfg.path
        data = _read_bytes(_text_files(root), cfg.max_corpus_bytes, ".py" if cfg.source == "stdlib" else None)
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64) if data else torch.empty(0, dtype=torch.int64)
    where = cfg.path or stdlib_root()
    if tokens.numel() < min_tokens:
        raise ConfigError(f"data.path={where!r} is invalid: {tokens.numel()} tokens, need at least {min_tokens} (model.seq_len + 1)")
    top = int(tokens.max())
    if top >= vocab_size:
        raise ConfigError(f"model.vocab_size={vocab_size} is invalid: the corpus at {where!r} has token id {top}; use >= {top + 1}")
    return tokens
