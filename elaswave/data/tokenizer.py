"""What turns text into token ids for ``elaswave prepare``: Hugging Face ``tokenizers`` for every
real vocabulary (a ``tokenizer.json``, a model directory's, or a byte-level BPE trained here), and
the byte tokenizer the default job has always used.

SPEC is one of ``bytes``, ``PATH/tokenizer.json``, ``MODEL_DIR`` (its ``tokenizer.json``, the
end-of-document token from its ``tokenizer_config.json``) or ``train-bpe:VOCAB``.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from elaswave.errors import ConfigError

BYTES = "bytes"
BYTES_EOD = 0
"""The byte tokenizer's end-of-document id: NUL, which text does not hold, so the default model's
256-entry vocabulary needs no extra entry."""
TRAIN_BPE = "train-bpe:"
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
"""End-of-document tokens of the common families (GPT-2, Llama 3, Llama 2/Mistral, Gemma), tried in order."""


@dataclass
class TokenizerSpec:
    """A loaded tokenizer: ``json`` is its ``tokenizer.json`` text (None for bytes), which is what
    worker processes rebuild it from and what prepare stores with the data."""

    name: str
    vocab_size: int
    eod_id: int
    json: str | None

    @property
    def sha256(self) -> str:
        return hashlib.sha256((self.json or BYTES).encode()).hexdigest()

    def encoder(self):
        return Encoder(self.json)


class Encoder:
    """Documents -> ids, in whichever process runs it (tokenizers objects are rebuilt, not pickled)."""

    def __init__(self, tokenizer_json: str | None):
        self.tokenizer = None
        if tokenizer_json is not None:
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_str(tokenizer_json)

    def encode(self, documents: list[str], special: bool = False) -> list[np.ndarray]:
        """``special``: with the tokens the tokenizer adds to a text of its own accord (a Llama's BOS)."""
        if self.tokenizer is None:
            return [np.frombuffer(d.encode("utf-8"), dtype=np.uint8) for d in documents]
        return [np.asarray(e.ids, dtype=np.int64) for e in self.tokenizer.encode_batch(documents, add_special_tokens=special)]

    def encode_with_offsets(self, texts: list[str]) -> list[tuple[np.ndarray, list[tuple[int, int]]]]:
        """Ids and each token's (start, end) characters; nothing added (a chat template writes its
        own special tokens)."""
        return [(np.asarray(e.ids, dtype=np.int64), e.offsets)
                for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        if self.tokenizer is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def _eod_from(tokenizer, config_path: str | None, spec: str, eod_token: str | None) -> int:
    names = [eod_token] if eod_token else []
    if not eod_token and config_path and os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as fh:
            eos = json.load(fh).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if eos:
            names.append(eos)
    if not eod_token:
        names.extend(EOD_CANDIDATES)
    for name in names:
        found = tokenizer.token_to_id(name)
        if found is not None:
            return found
    raise ConfigError(f"--tokenizer={spec!r} is invalid for prepare: it has no end-of-document token "
                      f"({eod_token or ', '.join(EOD_CANDIDATES)}); name one with --eod-token")


def load(spec: str, eod_token: str | None = None) -> TokenizerSpec:
    """``bytes``, a ``tokenizer.json`` or a model directory (``train-bpe:`` is :func:`train_bpe`)."""
    if spec == BYTES:
        return TokenizerSpec(BYTES, 256, BYTES_EOD, None)
    from tokenizers import Tokenizer

    path, config_path = spec, None
    if os.path.isdir(spec):
        path, config_path = os.path.join(spec, "tokenizer.json"), os.path.join(spec, "tokenizer_config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"--tokenizer={spec!r} is invalid: no such tokenizer.json; give bytes, a tokenizer.json, "
                          f"a model directory holding one, or {TRAIN_BPE}VOCAB")
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises its own exception type for a malformed file
        raise ConfigError(f"--tokenizer={spec!r} is invalid: {path} is not a tokenizers file ({exc})") from None
    return TokenizerSpec(path, tokenizer.get_vocab_size(with_added_tokens=True),
                         _eod_from(tokenizer, config_path, spec, eod_token), text)


def train_bpe(spec: str, documents: Iterable[str]) -> TokenizerSpec:
    """A byte-level BPE trained offline on ``documents``, ``<|endoftext|>`` its id 0."""
    try:
        vocab = int(spec[len(TRAIN_BPE):])
    except ValueError:
        vocab = 0
    if vocab < 257:
        raise ConfigError(f"--tokenizer={spec!r} is invalid: {TRAIN_BPE}VOCAB needs an integer VOCAB >= 257 "
                          f"(256 bytes and the end-of-document token)")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOD_CANDIDATES[0]], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(documents, trainer)
    return TokenizerSpec(spec, tokenizer.get_vocab_size(with_added_tokens=True),
                         tokenizer.token_to_id(EOD_CANDIDATES[0]), tokenizer.to_str())
