"""``elaswave prepare``: text in, a prepared corpus out (:mod:`elaswave.data.shards`), tokenized once.

Documents are the parts of text files between blank lines (``--separator``, or whole files),
or one field of each line of a ``.jsonl`` file (``--format text``), or the conversations of a ``.jsonl`` file (``--format chat``: rendered with the model's chat
template, with a loss mask beside the tokens, :mod:`elaswave.data.chat`); folders are read
recursively in sorted order, so the same inputs always make the same corpus. A text document gets
the special tokens its tokenizer adds of its own accord (a Llama's BOS), and each document is
followed by the end-of-document id (unless the tokenizer already ended it with that id). A document goes to the eval split when a hash of its text
falls under ``eval_fraction``: the split does not depend on the order of inputs or the number of
workers, and a document repeated in the input is never on both sides.

Everything is streamed: a text file is read in chunks and cut into documents as it goes (a stretch
longer than ``MAX_DOCUMENT_CHARS`` without a separator is cut at a line end), and at most two
batches per worker are in flight, so memory does not grow with the input. Workers (spawned
processes) tokenize batches of documents; the parent writes them in input order.
Everything is written into ``OUT.partial`` and renamed to ``OUT`` at the end, so an interrupted
prepare never leaves a manifest that points at half-written shards.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Iterator

import numpy as np

from elaswave.data.bad_lines import BadLines
from elaswave.errors import ConfigError
from elaswave.data import chat, packing, tokenizer as tok
from elaswave.data.shards import DTYPES, FORMAT, FORMAT_MASKED, MANIFEST, is_prepared

SHARD_TOKENS = 1 << 28
"""Tokens per shard file (512 MiB at uint16): few files, each far under any file-size limit."""
FORMATS = ("text", "chat")
BLANK_LINE = "blank-line"
WHOLE_FILE = "file"
MAX_DOCUMENT_CHARS = 1 << 23
"""A document longer than this (8 Mi characters) is cut at a line end: tokenizing one unbounded
string is what made a 21.6 MB file peak at 3 GB."""
READ_CHARS = 1 << 20
LOG_EVERY_S = 10.0
"""Off a terminal (a log file, CI), a progress line this often instead of a bar."""
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


def documents(inputs: list[str], text_field: str, separator: str = BLANK_LINE,
              bad: BadLines | None = None) -> Iterator[str]:
    """Every document of ``inputs``, in order; a bad JSONL line is counted in ``bad`` (naming
    file:line), or without it an error. Binary files found in a folder are passed over; one named
    as an input is an error."""
    for given in inputs:
        for path in _files(given):
            if path.endswith(".jsonl"):
                yield from _jsonl(path, text_field, bad)
                continue
            if _is_binary(path):
                if path == given:
                    raise ConfigError(f"input {path!r} is invalid: it is binary (a NUL byte in its first 8 KiB); "
                                      "give text files, folders of them or .jsonl files")
                continue
            yield from _text_documents(path, separator)


def _text_documents(path: str, separator: str) -> Iterator[str]:
    """A text file's documents, read in chunks: the parts between separators (a blank line: a line
    of nothing but whitespace), or the whole file; never one longer than MAX_DOCUMENT_CHARS."""
    cut = _splitter(separator)
    with open(path, encoding="utf-8", errors="replace") as fh:
        tail = ""
        while chunk := fh.read(READ_CHARS):
            tail += chunk
            if cut is not None:
                *done, tail = cut(tail)
                yield from (d for d in done if d.strip())
            while len(tail) > MAX_DOCUMENT_CHARS:
                at = tail.rfind("\n", 0, MAX_DOCUMENT_CHARS) + 1 or MAX_DOCUMENT_CHARS
                if tail[:at].strip():
                    yield tail[:at]
                tail = tail[at:]
        if tail.strip():
            yield tail


def _splitter(separator: str):
    if separator == WHOLE_FILE:
        return None
    if separator == BLANK_LINE:
        import re

        return re.compile(r"\n[ \t\r\f\v]*\n").split
    return lambda text: text.split(separator)


def _records(path: str, bad: BadLines) -> Iterator[tuple[object, int]]:
    """Each non-empty line of a JSONL file, parsed, with its line number; a line that is not JSON
    is counted in ``bad``, naming file:line."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            bad.read += 1
            try:
                record = json.loads(line)
            except ValueError:
                bad.add(f"{path}:{number} is not JSON: {line[:60].strip()!r}")
                continue
            yield record, number


def _jsonl(path: str, text_field: str, bad: BadLines | None = None) -> Iterator[str]:
    alone = bad is None
    bad = BadLines() if alone else bad
    for record, number in _records(path, bad):
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            bad.add(f"{path}:{number} has no text field {text_field!r} (--text-field); "
                    f"its keys: {sorted(record) if isinstance(record, dict) else type(record).__name__}")
        elif record[text_field]:
            yield record[text_field]
    if alone:
        bad.check()


def conversations(inputs: list[str], bad: BadLines | None = None) -> Iterator[tuple[list[dict], str]]:
    """Every conversation of the ``.jsonl`` files of ``inputs`` with where it is (FILE:LINE),
    checked: a bad one counted in ``bad`` (without it, the first is an error)."""
    alone = bad is None
    bad = BadLines() if alone else bad
    for given in inputs:
        for path in _files(given):
            if not path.endswith(".jsonl"):
                if path == given:
                    raise ConfigError(f"input {path!r} is invalid for --format chat: it reads .jsonl files of "
                                      "{\"messages\": [...]} records")
                continue
            for record, number in _records(path, bad):
                where = f"{path}:{number}"
                try:
                    messages = chat.messages_of(record, where)
                except ConfigError as exc:
                    bad.add(str(exc))
                    if alone:
                        bad.check()
                    continue
                yield messages, where
    if alone:
        bad.check()


def _units(inputs: list[str], text_field: str, fmt: str, separator: str,
           bad: BadLines) -> Iterator[tuple[object, str]]:
    """(what a worker encodes, the text the eval split is decided by) for each document."""
    if fmt == "chat":
        for messages, where in conversations(inputs, bad):
            yield (messages, where), json.dumps(messages, sort_keys=True, ensure_ascii=False)
    else:
        for text in documents(inputs, text_field, separator, bad):
            yield text, text


@contextlib.contextmanager
def _workers_without_main():
    """Start worker processes that do not import the parent's main module: a spawned worker runs it
    again first (``python -m elaswave.cli``: the command line, which imports torch; measured ~200 MB
    a worker), and the workers need only this module. Hidden only while the pool starts them."""
    main = sys.modules["__main__"]
    saved = {k: getattr(main, k) for k in ("__spec__", "__file__") if hasattr(main, k)}
    main.__spec__ = None
    if "__file__" in saved:
        del main.__file__
    try:
        yield multiprocessing.get_context("spawn")
    finally:
        for k, v in saved.items():
            setattr(main, k, v)


def _in_order(pool, fn, items: Iterator, ahead: int) -> Iterator:
    """``pool.imap`` with at most ``ahead`` tasks in flight (imap reads its whole input at once:
    the corpus would sit in the parent's memory, waiting)."""
    from collections import deque

    pending: deque = deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= ahead:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


class _Progress:
    """A bar with the input's total bytes on a terminal; a line every LOG_EVERY_S elsewhere."""

    def __init__(self, total: int, show: bool):
        import sys

        from tqdm import tqdm

        self.total, self.done, self.tokens = total, 0, 0
        self.began = self.logged = time.perf_counter()
        self.lines = show and not sys.stderr.isatty()
        self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="prepare", disable=not show or self.lines)

    def update(self, size: int, tokens: int) -> None:
        self.done += size
        now = time.perf_counter()
        self.bar.update(size)
        self.bar.set_postfix(tokens_per_s=f"{tokens / max(now - self.began, 1e-9):.3g}", refresh=False)
        self.tokens = tokens
        if self.lines and now - self.logged >= LOG_EVERY_S:
            self.logged = now
            self._line(min(99, int(100 * self.done / max(self.total, 1))))

    def _line(self, percent: int) -> None:
        took = max(time.perf_counter() - self.began, 1e-9)
        print(f"elaswave prepare: {self.done / 1e6:,.1f} MB of text of {self.total / 1e6:,.1f} MB of input "
              f"({percent}%), {self.done / 1e6 / took:.2f} MB/s, {self.tokens:,} tokens", file=sys.stderr, flush=True)

    def close(self) -> None:
        """(The text is the documents without their separators: less than the input's bytes.)"""
        self.bar.close()
        if self.lines and self.done:
            self._line(100)


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


def _encode(batch: list[tuple[object, str, bool]]) -> tuple[list, list, list[bool], int, list[str]]:
    """Ids (and loss masks, for chat) of a batch, which split each goes to, its bytes of text, and
    why each conversation the template refused was (its ids None)."""
    size = sum(len(text.encode("utf-8", errors="replace")) for _, text, _ in batch)
    to_eval = [e for _, _, e in batch]
    if _chat is None:
        return _encoder.encode([unit for unit, _, _ in batch], special=True), [None] * len(batch), to_eval, size, []
    template, train_on = _chat
    rendered, refused = [], []
    for (messages, where), _, _ in batch:
        try:
            rendered.append(chat.render_with_spans(template, messages, where))
        except ConfigError as exc:
            rendered.append(None)
            refused.append(str(exc))
    encoded = iter(_encoder.encode_with_offsets([r[0] for r in rendered if r is not None]))
    ids, masks = [], []
    for r in rendered:
        one, offsets = next(encoded) if r is not None else (None, None)
        ids.append(one)
        masks.append(chat.loss_mask(offsets, r[1]) if r is not None and train_on == "assistant" else None)
    return ids, masks, to_eval, size, refused


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
            # Document starts go to the index as they come: a list of Python ints held them all
            # (~36 bytes a document: ~150 MB for a shard of 4 M documents).
            self._idx_fh = open(os.path.join(self.folder, name + ".idx"), "wb")
            self._idx_fh.write(np.int64(0).astype("<i8").tobytes())
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
        self._idx_fh.write(np.int64(shard["tokens"]).astype("<i8").tobytes())
        if shard["tokens"] >= self.shard_tokens:
            self._close_shard()

    def _close_shard(self) -> None:
        self._fh.close()
        self._fh = None
        if self._mask_fh is not None:
            self._mask_fh.close()
            self._mask_fh = None
        self._idx_fh.close()

    def close(self) -> dict:
        if self._fh is not None:
            self._close_shard()
        return {"shards": self.shards, "tokens": sum(s["tokens"] for s in self.shards),
                "documents": sum(s["documents"] for s in self.shards)}


def _tokenizer_for(spec: str, inputs: list[str], text_field: str, eod_token: str | None,
                   separator: str = BLANK_LINE) -> tok.TokenizerSpec:
    if spec.startswith(tok.TRAIN_BPE):
        return tok.train_bpe(spec, documents(inputs, text_field, separator))
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
            overwrite: bool = False, progress: bool = True, fmt: str = "text", train_on: str = "assistant",
            separator: str = BLANK_LINE, pack_to: int = 0, overlong: str = "truncate") -> dict:
    """Tokenize ``inputs`` into the prepared corpus ``out``; returns its manifest. ``pack_to``: whole
    conversations packed into windows of that many tokens (model.seq_len; elaswave.data.packing)."""
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
    if pack_to and (fmt != "chat" or pack_to < 2):
        raise ConfigError(f"--pack-to={pack_to} is invalid" + (": it packs conversations, with --format chat"
                                                               if fmt != "chat" else ": a window of >= 2 tokens"))
    if overlong not in packing.OVERLONG:
        raise ConfigError(f"--overlong={overlong!r} is invalid: must be one of {', '.join(packing.OVERLONG)}")
    if workers < 1:
        raise ConfigError(f"--workers={workers} is invalid: must be >= 1")
    if not 0.0 <= eval_fraction < 1.0:
        raise ConfigError(f"--eval-fraction={eval_fraction} is invalid: must be in [0, 1)")
    if shard_tokens < 1:
        raise ConfigError(f"--shard-tokens={shard_tokens} is invalid: must be >= 1")
    if not separator:
        raise ConfigError(f"--separator={separator!r} is invalid: give {BLANK_LINE}, {WHOLE_FILE} or a text")
    for path in inputs:
        _files(path)  # a missing input is said before any work
    spec = _tokenizer_for(tokenizer, inputs, text_field, eod_token, separator)
    dtype = "uint16" if spec.vocab_size <= 1 << 16 else "uint32"
    masked = fmt == "chat" and (train_on == "assistant" or bool(pack_to))  # packed: no cross-conversation target
    chat_setting = (template, train_on) if template is not None else None
    partial = _claim(out, overwrite)
    try:  # a bad line, a full disk, ^C: nothing half-written is left behind (OUT.partial goes)
        began = time.perf_counter()
        writers = {split: ShardWriter(partial, split, dtype, spec.eod_id, spec.vocab_size, shard_tokens, masked)
                   for split in ("train", "eval")}
        packers = {split: packing.Packer(pack_to, spec.eod_id, overlong) for split in writers} if pack_to else None
        text_bytes = 0
        bar = _Progress(sum(os.path.getsize(f) for given in inputs for f in _files(given)), progress)
        bad = BadLines()
        batches = _batches(_units(inputs, text_field, fmt, separator, bad), eval_fraction)
        pool = None
        if workers > 1 and spec.json is not None:  # bytes take no tokenizing: workers would only copy them
            with _workers_without_main() as ctx:
                pool = ctx.Pool(workers, _init_worker, (spec.json, chat_setting))
            encoded = _in_order(pool, _encode, batches, 2 * workers)
        else:
            _init_worker(spec.json, chat_setting)
            encoded = map(_encode, batches)
        try:
            for ids, masks, to_eval, size, refused in encoded:
                for message in refused:
                    bad.add(message)
                for one, mask, e in zip(ids, masks, to_eval):
                    if one is None:  # refused by the template: counted above
                        continue
                    if packers is not None:
                        packers["eval" if e else "train"].add(one, mask if mask is not None else np.ones(one.size, np.uint8))
                    else:
                        writers["eval" if e else "train"].add(one, mask)
                text_bytes += size
                bar.update(size, sum(s["tokens"] for w in writers.values() for s in w.shards))
        finally:
            bar.close()
            if pool is not None:
                pool.terminate()
        bad.check()
        packed = {split: packers[split].write(writers[split]) for split in writers} if packers is not None else None
        splits = {split: w.close() for split, w in writers.items()}
        if splits["train"]["documents"] == 0:
            shutil.rmtree(partial, ignore_errors=True)
            raise ConfigError(f"the inputs {inputs} hold no {'training ' if eval_fraction else ''}documents "
                              f"(empty files, or every .jsonl line empty)")
        took = time.perf_counter() - began
        if spec.json is not None:
            with open(os.path.join(partial, "tokenizer.json"), "w", encoding="utf-8") as fh:
                fh.write(spec.json)
        if template is not None:  # what the export of a model trained on it carries (checkpoint/hf_folder)
            with open(os.path.join(partial, chat.TEMPLATE_FILE), "w", encoding="utf-8") as fh:
                fh.write(template.text)
        manifest = {"format": FORMAT_MASKED if masked else FORMAT, "dtype": dtype, "vocab_size": spec.vocab_size,
                    "tokenizer": {"name": spec.name, "sha256": spec.sha256, "eod_id": spec.eod_id,
                                  "file": "tokenizer.json" if spec.json is not None else None},
                    "splits": splits, "eval_fraction": eval_fraction,
                    "inputs": [os.path.abspath(i) for i in inputs], "text_field": text_field, "input_format": fmt,
                    "separator": separator if fmt == "text" else None,
                    "loss_mask": {"train_on": train_on, "file": ".mask"} if masked else None,
                    "chat_template": ({"source": os.path.abspath(template.source),
                                       "sha256": chat.template_sha256(template.text), "file": chat.TEMPLATE_FILE}
                                      if template is not None else None),
                    "packing": {"window": pack_to, "overlong": overlong, **packed} if packed is not None else None,
                    "text_bytes": text_bytes, "prepare_s": took, "workers": workers}
        with open(os.path.join(partial, MANIFEST), "w", encoding="utf-8") as fh:
            json.dump(manifest, fh, indent=1)
        if os.path.exists(out):  # an empty folder, or a prepared corpus with --overwrite
            shutil.rmtree(out)
        os.rename(partial, out)
        return manifest
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise

