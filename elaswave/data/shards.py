"""A prepared corpus on disk and its memory-mapped reader.

``DIR/manifest.json`` names the tokenizer (its sha256, vocabulary size, end-of-document id), the id
dtype and, per split (``train``, ``eval``), its shards: ``NAME.bin`` holds the packed token ids
(flat little-endian, nanoGPT-style) and ``NAME.idx`` each document's start offset in it (int64,
one more entry than documents). A corpus of conversations trained on what the assistant says
(``elaswave-tokens/2``, ``prepare --format chat``) has ``NAME.mask`` beside them: one byte per token,
1 where that token is a loss target. The manifest is written last, so a directory with one is whole.

A split reads as one stream of tokens, the shards one after the other; nothing is read until a
window is asked for, and then only its pages (``numpy.memmap``). Each read then unmaps the pages
around the window (``MADV_DONTNEED``: for a read-only file mapping the data stays in the page
cache, only this process's mapping goes): kernels that map file pages in large folios map up to
2 MiB per fault, and a rank sampling windows at random would otherwise count most of a corpus in
its RSS (measured: +750 MB after 320 micro-batches of an 800 MB corpus). With it a rank's memory
does not grow with the corpus.
"""
from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass

import numpy as np

from elaswave.errors import ConfigError
from elaswave.data.tokenizer import Encoder

MANIFEST = "manifest.json"
FORMAT = "elaswave-tokens/1"
FORMAT_MASKED = "elaswave-tokens/2"
"""With a loss mask: an elaswave that cannot honour one refuses the corpus rather than train every token."""
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
RELEASE_ALIGN = 2 << 20
"""Unmap whole 2 MiB-aligned regions around a window: the largest folio a fault maps in."""


def is_prepared(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def read_manifest(path: str) -> dict:
    where = os.path.join(path, MANIFEST)
    try:
        with open(where, encoding="utf-8") as fh:
            manifest = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"data.path={path!r} is invalid: {where} cannot be read as a prepared corpus "
                          f"manifest ({exc}); make one with `elaswave prepare`") from None
    if manifest.get("format") not in (FORMAT, FORMAT_MASKED):
        raise ConfigError(f"data.path={path!r} is invalid: its manifest's format is {manifest.get('format')!r}, "
                          f"this elaswave reads {FORMAT!r} and {FORMAT_MASKED!r}")
    return manifest


def corpus_identity(path: str) -> tuple[str, str]:
    """(the tokenizer's sha256, the corpus's): what names a prepared corpus and how it was
    tokenized. The corpus's hash is its manifest's without what does not change the tokens (the
    time prepare took, its workers, where the inputs were), so preparing the same text again
    names the same corpus."""
    import hashlib

    manifest = read_manifest(path)
    kept = {k: v for k, v in manifest.items() if k not in ("prepare_s", "workers", "inputs")}
    return manifest["tokenizer"]["sha256"], hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


@dataclass
class Shard:
    name: str
    tokens: np.ndarray  # memmap of ids
    starts: np.ndarray  # memmap of int64 document starts, documents + 1 entries
    mask: np.ndarray | None = None  # memmap of uint8 loss-target flags, one per token


class PreparedTokens:
    """One split of a prepared corpus as a token stream: ``len()``, :meth:`read`, :meth:`locate`."""

    def __init__(self, path: str, split: str = "train"):
        self.path = path
        self.manifest = read_manifest(path)
        self.vocab_size = int(self.manifest["vocab_size"])
        self.eod_id = int(self.manifest["tokenizer"]["eod_id"])
        dtype = DTYPES[self.manifest["dtype"]]
        self.masked = self.manifest["format"] == FORMAT_MASKED
        if split not in self.manifest["splits"]:
            raise ConfigError(f"data.path={path!r} has no {split!r} split; it has {sorted(self.manifest['splits'])}")
        self.shards = [self._open(s, dtype) for s in self.manifest["splits"][split]["shards"]]
        sizes = [len(s.tokens) for s in self.shards]
        self.offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        """Where each shard starts in the split's stream (one more entry than shards)."""

    def _open(self, entry: dict, dtype: np.dtype) -> Shard:
        """A shard whose files disagree with the manifest is one line now, not a crash mid-run."""
        name, tokens, documents = entry["name"], int(entry["tokens"]), int(entry["documents"])
        files = {os.path.join(self.path, name + ".bin"): tokens * dtype.itemsize,
                 os.path.join(self.path, name + ".idx"): (documents + 1) * 8}
        if self.masked:
            files[os.path.join(self.path, name + ".mask")] = tokens
        for file, size in files.items():
            found = os.path.getsize(file) if os.path.isfile(file) else None
            if found != size:
                raise ConfigError(f"data.path={self.path!r} is invalid: {file} has "
                                  f"{'no file' if found is None else f'{found} bytes'}, its manifest says {size} "
                                  f"bytes; prepare the corpus again")
        bin_file, idx_file, *mask_file = files
        mask = None
        if mask_file:
            mask = np.memmap(mask_file[0], dtype=np.uint8, mode="r", shape=(tokens,)) if tokens else np.empty(0, np.uint8)
        return Shard(name, np.memmap(bin_file, dtype=dtype, mode="r", shape=(tokens,)) if tokens else np.empty(0, dtype),
                     np.memmap(idx_file, dtype="<i8", mode="r", shape=(documents + 1,)), mask)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``start .. start+length-1`` of the stream as int64 (a window may span shards)."""
        return self._read(start, length, lambda s: s.tokens, np.int64)

    def read_mask(self, start: int, length: int) -> np.ndarray | None:
        """Loss-target flags of the same tokens (bool), or None when every token is one."""
        return self._read(start, length, lambda s: s.mask, np.bool_) if self.masked else None

    def documents(self, start: int, length: int) -> np.ndarray:
        """Which document each of the same tokens is in (int64; equal ids, same document; a
        document's end-of-document id is its own last token)."""
        out, end = [], start + length
        i = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while start < end:
            lo = start - int(self.offsets[i])
            take = min(end - start, len(self.shards[i].tokens) - lo)
            local = np.searchsorted(self.shards[i].starts, np.arange(lo, lo + take), side="right") - 1
            out.append((i << 40) + local.astype(np.int64))  # shards end at document ends: ids stay apart
            start += take
            i += 1
        return np.concatenate(out) if len(out) > 1 else out[0]

    def _read(self, start: int, length: int, field, dtype) -> np.ndarray:
        parts, end = [], start + length
        i = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while start < end:
            lo = start - int(self.offsets[i])
            values = field(self.shards[i])
            take = min(end - start, len(values) - lo)
            parts.append(np.array(values[lo:lo + take], dtype=dtype))
            _release(values, lo, take)
            start += take
            i += 1
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def encoder(self) -> Encoder:
        """The tokenizer the corpus was made with (to decode its windows)."""
        file = self.manifest["tokenizer"]["file"]
        if file is None:
            return Encoder(None)
        with open(os.path.join(self.path, file), encoding="utf-8") as fh:
            return Encoder(fh.read())

    def locate(self, position: int) -> tuple[str, int, int]:
        """Where the token at ``position`` of the stream is: (shard name, document, offset in it)."""
        i = int(np.searchsorted(self.offsets, position, side="right")) - 1
        local = position - int(self.offsets[i])
        starts = self.shards[i].starts
        doc = int(np.searchsorted(starts, local, side="right")) - 1
        return self.shards[i].name, doc, local - int(starts[doc])


def _release(tokens: np.ndarray, first: int, count: int) -> None:
    """Drop this process's mapping of the pages holding ``tokens[first:first+count]`` and their
    neighbours in the same 2 MiB region (numpy.memmap keeps its mmap object as ``_mmap``)."""
    mapped = getattr(tokens, "_mmap", None)
    if mapped is None or not hasattr(mapped, "madvise"):
        return
    size = tokens.itemsize
    lo = first * size // RELEASE_ALIGN * RELEASE_ALIGN
    hi = min(-(-(first + count) * size // RELEASE_ALIGN) * RELEASE_ALIGN, len(mapped))
    mapped.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
