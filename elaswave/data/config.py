"""The ``[data]`` section of a job's configuration: which corpus, read how, blended how.

Kept beside the data it describes; :mod:`elaswave.config` holds it in the job's config and
validates it at the edge like every other section.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from elaswave.errors import fail as _fail


DATA_SOURCES = ("auto", "stdlib", "text", "bin", "tokens")
DOCUMENT_MASKING = ("auto", "true", "false")
POSITION_IDS = ("continuous", "per_document")


def _is_prepared(path: str) -> bool:
    from elaswave.data.shards import is_prepared  # late: keeps numpy off the config edge

    return is_prepared(path)


@dataclass
class DataConfig:
    source: str = "auto"
    """auto: what is at ``path`` says (nothing: stdlib; a folder with a manifest.json: tokens; a
    ``.bin`` file: bin; any other file or folder: text);
    stdlib: the Python standard library's own source as bytes (no download);
    text: ``path`` is a text file or a folder of them (bytes as tokens);
    bin: ``path`` is a flat little-endian uint16 token file (nanoGPT-style .bin);
    tokens: ``path`` is a corpus made by ``elaswave prepare`` (memory-mapped shards)."""
    path: str = ""
    max_corpus_bytes: int = 4_000_000
    """Upper bound on how much of a text corpus is read (keeps start-up short on every rank)."""
    mix: tuple = ()
    """Prepared corpora blended by weight, ``PATH=WEIGHT`` each (instead of ``path``); every source
    keeps its own exactly-once epochs."""
    chat_template: str = "check"
    """A corpus of conversations (``prepare --format chat``) and model.init_from's chat template:
    check -- a folder whose template differs from the one the corpus was rendered with is refused
    (a folder without one is fine: the export carries the corpus's); corpus -- train anyway, and the
    export carries the corpus's template, the one the model learnt."""
    document_masking: str = "auto"
    """true: attention never crosses a document boundary inside a packed window (block-causal, from
    the prepared corpus's document index); auto: true for a corpus of conversations (``prepare
    --format chat``), else false."""

    position_ids: str = "continuous"
    """continuous: a token's rotary position is its place in the window; per_document: its place in
    its own document (positions restart at each document, as transformers' DataCollatorWithFlattening
    gives them). Needs document masking. Under block-causal masking rotary attention depends only on
    the distance between tokens, so the two compute the same function; per_document rounds as each
    document alone would (tests/model/test_llama_parity.py measures both)."""

    @property
    def mixture(self) -> list[tuple[str, float]]:
        """``mix`` as (path, weight) pairs."""
        pairs = []
        for item in self.mix:
            path, sep, weight = item.rpartition("=")
            try:
                value = float(weight) if sep and path else -1.0
            except ValueError:
                value = -1.0
            if not value > 0:
                _fail("data.mix", item, "each item is PATH=WEIGHT with a weight > 0, e.g. data.mix=web=0.7;code=0.3")
            pairs.append((path, value))
        return pairs

    @property
    def masks_documents(self) -> bool:
        """``document_masking`` in effect (``auto`` resolved by the corpus's manifest)."""
        if self.document_masking != "auto":
            return self.document_masking == "true"
        if self.kind != "tokens":
            return False
        from elaswave.data.shards import read_manifest  # late: keeps numpy off the config edge

        paths = [p for p, _ in self.mixture] or [self.path]
        return all(read_manifest(p).get("input_format") == "chat" for p in paths)

    @property
    def kind(self) -> str:
        """The source in effect (``auto`` resolved by what is at the path)."""
        if self.source != "auto":
            return self.source
        if self.mix:
            return "tokens"
        if not self.path:
            return "stdlib"
        if _is_prepared(self.path):
            return "tokens"
        return "bin" if os.path.isfile(self.path) and self.path.endswith(".bin") else "text"

    def validate(self) -> None:
        if self.source not in DATA_SOURCES:
            _fail("data.source", self.source, f"must be one of {', '.join(DATA_SOURCES)}")
        if self.chat_template not in ("check", "corpus"):
            _fail("data.chat_template", self.chat_template, "must be check (refuse a model folder whose chat template "
                  "differs from the corpus's) or corpus (train, and export the corpus's template)")
        if self.document_masking not in DOCUMENT_MASKING:
            _fail("data.document_masking", self.document_masking, f"must be one of {', '.join(DOCUMENT_MASKING)}")
        if self.position_ids not in POSITION_IDS:
            _fail("data.position_ids", self.position_ids, f"must be one of {', '.join(POSITION_IDS)}")
        if self.position_ids == "per_document" and not self.masks_documents:
            _fail("data.position_ids", self.position_ids, "restarts positions at each document, which needs "
                  "data.document_masking in effect (a corpus of conversations, or =true with a prepared corpus)")
        if self.document_masking == "true" and self.kind != "tokens":
            _fail("data.document_masking", self.document_masking, f"needs a corpus made by `elaswave prepare` (its "
                  f"document index); data.source={self.kind} has none")
        if self.mix:
            if self.path or self.source not in ("auto", "tokens"):
                _fail("data.path" if self.path else "data.source", self.path or self.source,
                      "has no effect with data.mix (a mixture of prepared corpora); leave it unset")
            for path, _ in self.mixture:
                if not _is_prepared(path):
                    _fail("data.mix", path, "each source must be a folder made by `elaswave prepare` (no manifest.json)")
            return
        if self.source == "stdlib" and self.path:
            _fail("data.path", self.path, "has no effect with data.source=stdlib; leave data.source=auto (the "
                                          "default) to read what is at the path, or name text, bin or tokens")
        if self.kind != "stdlib":
            if not self.path:
                _fail("data.path", self.path, f"data.source={self.source} needs a path")
            if not os.path.exists(self.path):
                _fail("data.path", self.path, "no such file or folder")
        if self.kind == "tokens" and not _is_prepared(self.path):
            _fail("data.path", self.path, "data.source=tokens needs a folder made by `elaswave prepare` "
                                          "(it has no manifest.json)")
        if self.max_corpus_bytes < 1024:
            _fail("data.max_corpus_bytes", self.max_corpus_bytes, "must be >= 1024")
