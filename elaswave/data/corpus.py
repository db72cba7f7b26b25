"""Token corpora: the standard library's own source (default, no download), text files, a flat
uint16 token file (nanoGPT-style ``.bin``) -- each read whole into one 1-D int64 tensor -- or a
corpus made by ``elaswave prepare``, memory-mapped (:mod:`elaswave.data.shards`)."""
from __future__ import annotations

import os
import sysconfig
from typing import Iterable, Iterator

import numpy as np
import torch

from elaswave.errors import ConfigError
from elaswave.data.config import DataConfig
from elaswave.data.shards import PreparedTokens, read_manifest
from elaswave.data.tokenizer import Encoder


def _text_files(root: str) -> Iterator[str]:
    """Files under ``root`` in a fixed (sorted) order, so every rank reads the same corpus; walked
    lazily, as the reader stops at its byte limit (the stdlib with its site-packages is thousands of
    folders: most of a second at every rank's start when walked whole)."""
    if os.path.isfile(root):
        yield root
        return
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        yield from (os.path.join(folder, f) for f in sorted(files))


def _read_bytes(files: Iterable[str], limit: int, suffix: str | None) -> bytes:
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


def _text_source(cfg: DataConfig) -> tuple[str, str | None]:
    """Where a bytes corpus is read from, and the file suffix it keeps (the stdlib's .py files)."""
    return (stdlib_root(), ".py") if cfg.kind == "stdlib" else (cfg.path, None)


def corpus_bytes(cfg: DataConfig) -> int:
    """Bytes of the tensor :func:`load_corpus` returns (int64 tokens), from file sizes alone: what
    every rank can know without reading the corpus (the memory model of a stage that reads batches).
    A prepared corpus is memory-mapped: its pages are the page cache's, not the rank's."""
    kind = cfg.kind
    if kind == "tokens":
        return 0
    if kind == "bin":
        return 8 * (os.path.getsize(cfg.path) // 2)
    root, suffix = _text_source(cfg)
    total = 0
    for path in _text_files(root):
        if (suffix and not path.endswith(suffix)) or not os.path.isfile(path) or not os.access(path, os.R_OK):
            continue
        total += os.path.getsize(path)
        if total >= cfg.max_corpus_bytes:
            return 8 * cfg.max_corpus_bytes
    return 8 * total


def corpus_tokens(cfg: DataConfig) -> int:
    """Tokens of the corpus's training stream, from the manifest or file sizes alone (no reading)."""
    if cfg.kind == "tokens":
        return int(read_manifest(cfg.path)["splits"]["train"]["tokens"])
    return corpus_bytes(cfg) // 8


def load_corpus(cfg: DataConfig, vocab_size: int, min_tokens: int, init_from: str = "") -> torch.Tensor:
    """All tokens of an in-memory corpus (stdlib, text, bin); raises ConfigError if it is unusable."""
    if cfg.kind == "bin":
        size = os.path.getsize(cfg.path)
        if size % 2:
            raise ConfigError(f"data.path={cfg.path!r} is invalid: a uint16 token file has an even size, got {size} bytes")
        with open(cfg.path, "rb") as fh:
            raw = bytearray(fh.read())
        tokens = torch.frombuffer(raw, dtype=torch.int16).to(torch.int64) & 0xFFFF
    else:
        root, suffix = _text_source(cfg)
        data = _read_bytes(_text_files(root), cfg.max_corpus_bytes, suffix)
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64) if data else torch.empty(0, dtype=torch.int64)
    where = cfg.path or stdlib_root()
    if tokens.numel() < min_tokens:
        raise ConfigError(f"data.path={where!r} is invalid: {tokens.numel()} tokens, need at least {min_tokens} (model.seq_len + 1)")
    top = int(tokens.max())
    if top >= vocab_size and init_from:  # the folder fixes the vocabulary: the data must change, not the model
        raise ConfigError(f"data.path={where!r} is invalid for model.init_from={init_from!r}: it holds token id {top}, "
                          f"the model's vocabulary has {vocab_size}; prepare the text with the model's own tokenizer "
                          f"(elaswave prepare TEXT --tokenizer {init_from} --out DIR) and set data.path=DIR")
    if top >= vocab_size:
        raise ConfigError(f"model.vocab_size={vocab_size} is invalid: the corpus at {where!r} has token id {top}; use >= {top + 1}")
    return tokens


class InMemoryTokens:
    """An in-memory corpus as a token stream, read as :class:`PreparedTokens` is."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens
        """Kept alive: the memory model counts the corpus as a live tensor of the rank."""
        self.array = tokens.numpy()

    def __len__(self) -> int:
        return self.tokens.numel()

    def read(self, start: int, length: int) -> np.ndarray:
        return self.array[start:start + length]

    def locate(self, position: int) -> tuple[str, int, int]:
        return "corpus", 0, position

    def encoder(self) -> Encoder:
        return Encoder(None)  # the in-memory corpora are bytes


def open_tokens(cfg: DataConfig, vocab_size: int, min_tokens: int, split: str = "train", init_from: str = ""):
    """The configured corpus as a token stream (``len``, ``read(start, length)``, ``locate``).
    ``init_from``: the model folder whose vocabulary ``vocab_size`` is (the advice then is the data's)."""
    if cfg.kind != "tokens":
        return InMemoryTokens(load_corpus(cfg, vocab_size, min_tokens, init_from))
    tokens = PreparedTokens(cfg.path, split)
    if tokens.vocab_size > vocab_size and init_from:
        raise ConfigError(f"data.path={cfg.path!r} is invalid for model.init_from={init_from!r}: it was prepared with "
                          f"tokenizer {tokens.manifest['tokenizer']['name']} ({tokens.vocab_size} ids), the model's "
                          f"vocabulary has {vocab_size}; prepare it again with the model's own tokenizer "
                          f"(elaswave prepare ... --tokenizer {init_from})")
    if tokens.vocab_size > vocab_size:
        raise ConfigError(f"model.vocab_size={vocab_size} is invalid: the prepared corpus at {cfg.path!r} has a "
                          f"vocabulary of {tokens.vocab_size} (tokenizer {tokens.manifest['tokenizer']['name']}); "
                          f"use >= {tokens.vocab_size}")
    packed = (tokens.manifest.get("packing") or {}).get("window")
    if packed and packed != min_tokens - 1:  # (min_tokens: a window's model.seq_len + 1)
        raise ConfigError(f"model.seq_len={min_tokens - 1} is invalid for data.path={cfg.path!r}: its conversations "
                          f"are packed whole into windows of {packed} tokens (prepare --pack-to {packed}), which "
                          f"windows of another length would cut; use model.seq_len={packed}, or prepare it again "
                          f"with --pack-to {min_tokens - 1}")
    if len(tokens) < min_tokens:
        hint = "; prepare it with --eval-fraction > 0 to hold documents out" if split == "eval" else ""
        raise ConfigError(f"data.path={cfg.path!r} is invalid: its {split} split has {len(tokens)} tokens, need at "
                          f"least {min_tokens} (model.seq_len + 1){hint}")
    return tokens
