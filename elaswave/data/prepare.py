"""``elaswave prepare``: text in, a prepared corpus out (:mod:`elaswave.data.shards`), tokenized once.

Documents are whole text files, or one field of each line of a ``.jsonl`` file (``--format
text``), or the conversations of a ``.jsonl`` file (``--format chat``: rendered with the model's chat
template, with a loss mask beside the tokens, :mod:`elaswave.data.chat`); folders are read
recursively in sorted order, so the same inputs always make the same corpus. A text document gets
the special tokens its tokenizer adds of its own accord (a Llama's BOS), and each document is
followed by the end-of-document id (unless the tokenizer already ended it with that id). A document goes to the eval split when a hash of its text
falls under ``eval_fraction``: the split does not depend on the order of inputs or the number of
workers, and a document repeated in the input is never on both sides.

Workers (spawned processes) tokenize batches of documents; the parent writes them in input order.
Everything is written into ``OUT.partial`` and renamed to ``OUT`` at the end, so an interrupted
prepare never leaves a manifest that points at half-written shards.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import time
from collections.abc import Iterator

import numpy as np

from elaswave.errors import ConfigError
from elaswave.data import chat, tokenizer as tok
from elaswave.data.shards import DTYPES, FORMAT, FORMAT_MASKED, MANIFEST, is_prepared

SHARD_TOKENS = 1 << 28
"""Tokens per shard file (512 MiB at uint16): few files, each far under any file-size limit."""
FORMATS = ("text", "chat")
BATCH_BYTES = 1 << 20
"""Text per worker task: large enough to keep a worker busy, small enough to stream."""


def _files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise ConfigError(f"input {path!r} is invalid: no such file or folder")
    found = []
    for folder, dirs, names in os.walk(path):
        dirs.sort()
        found.extend(os.path.join(folder, n) for n in sorted(names) if not n.startswith("."))
    return found


def _is_binary(path: str) -> bool:
    """A NUL in the first 8 KiB: what git takes for a binary file (compiled code, images) in a folder."""
    with open(path, "rb") as fh:
        return b"\0" in fh.read(8192)


def documents(inputs: list[str], text_field: str) -> Iterator[str]:
    """Every document of ``inputs``, in order; a bad JSONL line is an error naming file:line. Binary
    files found in a folder are passed over; one named as an input is read as text."""
    for given in inputs:
        for path in _files(given):
            if path.endswith(".jsonl"):
                yield from _jsonl(path, text_field)
                continue
            if path != given and _is_binary(path):
                continue
            with open(path, encoding="utf-8", errors="replace") as fh:
                text = fh.read()
            if text:
                yield text


def _jsonl(path: str, text_field: str) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise ConfigError(f"{path}:{number} is not JSON: {line[:60].strip()!r}") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise ConfigError(f"{path}:{number} has no text field {text_field!r} (--text-field); "
                                  f"its keys: {sorted(record) if isinstance(record, dict) else type(record).__name__}")
            if record[text_field]:
                yield record[text_field]


def conversations(inputs: list[str]) -> Iterator[tuple[list[dict], str]]:
    """Every conversation of the ``.jsonl`` files of ``inputs`` with where it is (FILE:LINE), checked."""
    for given in inputs:
        for path in _files(given):
            if not path.endswith(".jsonl"):
                if path == given:
                    raise ConfigError(f"input {path!r} is invalid for --format chat: it reads .jsonl files of "
                                      "{\"messages\": [...]} records")
                continue
            with open(path, encoding="utf-8", errors="replace") as fh:
                for number, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except ValueError:
                        raise ConfigError(f"{path}:{number} is not JSON: {line[:60].strip()!r}") from None
                    where = f"{path}:{number}"
                    yield chat.messages_of(record, where), where


def _units(inputs: list[str], text_field: str, fmt: str) -> Iterator[tuple[object, str]]:
    """(what a worker encodes, the text the eval split is decided by) for each document."""
    if fmt == "chat":
        for messages, where in conversations(inputs):
            yield (messages, where), json.dumps(messages, sort_keys=True, ensure_ascii=False)
    else:
        for text in documents(inputs, text_field):
            yield text, text


def _is_eval(text: str, fraction: float) -> bool:
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.blake2b(text.encode("utf-8", errors="replace"), digest_size=8).digest(), "little")
    return h < fraction * 2 ** 64


def _batches(units: Iterator[tuple[object, str]], fraction: float) -> Iterator[list[tuple[object, str, bool]]]:
    batch, size = [], 0
    for unit, text in units:
        batch.append((unit, text, _is_eval(text, fraction)))
        size += len(text)
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


_encoder = None
_chat: tuple[chat.ChatTemplate, str] | None = None


def _init_worker(tokenizer_json: str | None, chat_setting: tuple[chat.ChatTemplate, str] | None = None) -> None:
    global _encoder, _chat
    _encoder = tok.Encoder(tokenizer_json)
    _chat = chat_setting


def _encode(batch: list[tuple[object, str, bool]]) -> tuple[list[np.ndarray], list[np.ndarray | None], list[bool], int]:
    """Ids (and loss masks, for chat) of a batch, which split each goes to, and its bytes of text."""
    size = sum(len(text.encode("utf-8", errors="replace")) for _, text, _ in batch)
    to_eval = [e for _, _, e in batch]
    if _chat is None:
        return _encoder.encode([unit for unit, _, _ in batch], special=True), [None] * len(batch), to_eval, size
    template, train_on = _chat
    rendered = [chat.render_with_spans(template, messages, where) for (messages, where), _, _ in batch]
    encoded = _encoder.encode_with_offsets([text for text, _ in rendered])
    masks = [chat.loss_mask(offsets, spans) if train_on == "assistant" else None
             for (ids, offsets), (_, spans) in zip(encoded, rendered)]
    return [ids for ids, _ in encoded], masks, to_eval, size


class ShardWriter:
    """One split's shards: ids and document starts appended, a new shard past ``shard_tokens``."""

    def __init__(self, folder: str, split: str, dtype: str, eod_id: int, vocab_size: int, shard_tokens: int,
                 masked: bool = False):
        self.folder, self.split, self.dtype = folder, split, DTYPES[dtype]
        self.eod_id = eod_id
        self.vocab_size, self.shard_tokens, self.masked = vocab_size, shard_tokens, masked
        self.shards: list[dict] = []
        self._fh = None
        self._mask_fh = None

    def add(self, ids: np.ndarray, mask: np.ndarray | None = None) -> None:
        """A document; ``mask`` (with ``masked``): 1 where its token is a loss target. The
        end-of-document id that follows it is not one in a masked corpus (what follows a
        conversation is not the assistant's to say)."""
        if ids.size and int(ids.max()) >= self.vocab_size:
            raise ConfigError(f"token id {int(ids.max())} does not fit the tokenizer's vocabulary of {self.vocab_size}")
        if self._fh is None:
            name = f"{self.split}-{len(self.shards):05d}"
            self._fh = open(os.path.join(self.folder, name + ".bin"), "wb")
            if self.masked:
                self._mask_fh = open(os.path.join(self.folder, name + ".mask"), "wb")
            self.shards.append({"name": name, "tokens": 0, "documents": 0})
            self._starts = [0]
        shard = self.shards[-1]
        if not (ids.size and int(ids[-1]) == self.eod_id):
            ids = np.append(ids.astype(np.int64, copy=False), self.eod_id)
            if mask is not None:
                mask = np.append(mask, np.uint8(0))
        self._fh.write(ids.astype(self.dtype).tobytes())
        if self.masked:
            self._mask_fh.write((mask if mask is not None else np.ones(ids.size, np.uint8)).astype(np.uint8).tobytes())
        shard["tokens"] += ids.size
        shard["documents"] += 1
        self._starts.append(shard["tokens"])
        if shard["tokens"] >= self.shard_tokens:
            self._close_shard()

    def _close_shard(self) -> None:
        self._fh.close()
        self._fh = None
        if self._mask_fh is not None:
            self._mask_fh.close()
            self._mask_fh = None
        np.asarray(self._starts, dtype="<i8").tofile(os.path.join(self.folder, self.shards[-1]["name"] + ".idx"))

    def close(self) -> dict:
        if self._fh is not None:
            self._close_shard()
        return {"shards": self.shards, "tokens": sum(s["tokens"] for s in self.shards),
                "documents": sum(s["documents"] for s in self.shards)}


def _tokenizer_for(spec: str, inputs: list[str], text_field: str, eod_token: str | None) -> tok.TokenizerSpec:
    if spec.startswith(tok.TRAIN_BPE):
        return tok.train_bpe(spec, documents(inputs, text_field))
    return tok.load(spec, eod_token)


def _claim(out: str, overwrite: bool) -> str:
    """The folder to write into (``OUT.partial``); refuses to replace what is not a prepared corpus."""
    if os.path.exists(out) and not (overwrite and is_prepared(out)):
        if not (os.path.isdir(out) and not os.listdir(out)):
            raise ConfigError(f"--out={out!r} is invalid: it exists; give a new folder"
                              + (", or --overwrite to replace this prepared corpus" if is_prepared(out) else ""))
    partial = out.rstrip(os.sep) + ".partial"
    shutil.rmtree(partial, ignore_errors=True)  # what an interrupted prepare left
    os.makedirs(partial)
    return partial


def prepare(inputs: list[str], out: str, tokenizer: str, text_field: str = "text", workers: int = 1,
            eval_fraction: float = 0.0, eod_token: str | None = None, shard_tokens: int = SHARD_TOKENS,
            overwrite: bool = False, progress: bool = True, fmt: str = "text", train_on: str = "assistant") -> dict:
    """Tokenize ``inputs`` into the prepared corpus ``out``; returns its manifest."""
    if not inputs:
        raise ConfigError("prepare needs at least one INPUT (a text file, a folder or a .jsonl file)")
    if fmt not in FORMATS:
        raise ConfigError(f"--format={fmt!r} is invalid: must be one of {', '.join(FORMATS)}")
    if train_on not in chat.TRAIN_ON:
        raise ConfigError(f"--train-on={train_on!r} is invalid: must be one of {', '.join(chat.TRAIN_ON)}")
    template = None
    if fmt == "chat":
        if not os.path.isdir(tokenizer):
            raise ConfigError(f"--tokenizer={tokenizer!r} is invalid for --format chat: give the model folder whose "
                              "tokenizer.json and chat template render the conversations")
        template = chat.load_template(tokenizer)
    if workers < 1:
        raise ConfigError(f"--workers={workers} is invalid: must be >= 1")
    if not 0.0 <= eval_fraction < 1.0:
        raise ConfigError(f"--eval-fraction={eval_fraction} is invalid: must be in [0, 1)")
    if shard_tokens < 1:
        raise ConfigError(f"--shard-tokens={shard_tokens} is invalid: must be >= 1")
    for path in inputs:
        _files(path)  # a missing input is said before any work
    spec = _tokenizer_for(tokenizer, inputs, text_field, eod_token)
    dtype = "uint16" if spec.vocab_size <= 1 << 16 else "uint32"
    masked = fmt == "chat" and train_on == "assistant"
    chat_setting = (template, train_on) if template is not None else None
    partial = _claim(out, overwrite)
    began = time.perf_counter()
    writers = {split: ShardWriter(partial, split, dtype, spec.eod_id, spec.vocab_size, shard_tokens, masked)
               for split in ("train", "eval")}
    text_bytes = 0
    from tqdm import tqdm

    bar = tqdm(unit="B", unit_scale=True, desc="prepare", disable=not progress or None)
    batches = _batches(_units(inputs, text_field, fmt), eval_fraction)
    pool = None
    if workers > 1 and spec.json is not None:  # bytes take no tokenizing: workers would only copy them
        pool = multiprocessing.get_context("spawn").Pool(workers, _init_worker, (spec.json, chat_setting))
        encoded = pool.imap(_encode, batches)
    else:
        _init_worker(spec.json, chat_setting)
        encoded = map(_encode, batches)
    try:
        for ids, masks, to_eval, size in encoded:
            for one, mask, e in zip(ids, masks, to_eval):
                writers["eval" if e else "train"].add(one, mask)
            text_bytes += size
            bar.update(size)
            tokens = sum(s["tokens"] for w in writers.values() for s in w.shards)
            bar.set_postfix(tokens_per_s=f"{tokens / max(time.perf_counter() - began, 1e-9):.3g}", refresh=False)
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
    splits = {split: w.close() for split, w in writers.items()}
    if splits["train"]["documents"] == 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise ConfigError(f"the inputs {inputs} hold no {'training ' if eval_fraction else ''}documents "
                          f"(empty files, or every .jsonl line empty)")
    took = time.perf_counter() - began
    if spec.json is not None:
        with open(os.path.join(partial, "tokenizer.json"), "w", encoding="utf-8") as fh:
            fh.write(spec.json)
    manifest = {"format": FORMAT_MASKED if masked else FORMAT, "dtype": dtype, "vocab_size": spec.vocab_size,
                "tokenizer": {"name": spec.name, "sha256": spec.sha256, "eod_id": spec.eod_id,
                              "file": "tokenizer.json" if spec.json is not None else None},
                "splits": splits, "eval_fraction": eval_fraction,
                "inputs": [os.path.abspath(i) for i in inputs], "text_field": text_field, "input_format": fmt,
                "loss_mask": {"train_on": train_on, "file": ".mask"} if masked else None,
                "chat_template": ({"source": os.path.abspath(template.source),
                                   "sha256": hashlib.sha256(template.text.encode()).hexdigest()}
                                  if template is not None else None),
                "text_bytes": text_bytes, "prepare_s": took, "workers": workers}
    with open(os.path.join(partial, MANIFEST), "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=1)
    if os.path.exists(out):  # an empty folder, or a prepared corpus with --overwrite
        shutil.rmtree(out)
    os.rename(partial, out)
    return manifest

