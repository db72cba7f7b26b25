"""Conversations as training documents: rendered with the tokenizer's own chat template, and the
loss mask of what the assistant says.

A record is ``{"messages": [{"role": ..., "content": ...}, ...]}`` (one JSONL line). It is rendered
with the model folder's chat template (``tokenizer_config.json``'s ``chat_template``, or
``chat_template.jinja`` beside it: the Jinja text transformers renders, in a sandbox as
transformers does, with ``bos_token``, ``eos_token`` and ``raise_exception``), so the tokens are the
ones the model meets when served. Which characters the assistant says is found by rendering again:
the conversation up to an assistant turn with the generation prompt, then with that turn -- what the
second adds to the first is the turn (its content and the template's end-of-turn marker, which
the model must learn to emit). A template whose renderings do not extend one another (one that
rewrites earlier turns) is refused, naming the record. Tokens are marked by where they start in
the text (the tokenizer's offsets): a token that starts inside an assistant turn is trained.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime

import numpy as np

from elaswave.errors import ConfigError

TRAIN_ON = ("assistant", "all")
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatTemplate:
    """A model folder's chat template and the special tokens it refers to (picklable: workers
    rebuild the Jinja template from the text)."""

    source: str
    text: str
    bos_token: str = ""
    eos_token: str = ""

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return _compiled(self.text).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                           bos_token=self.bos_token, eos_token=self.eos_token)


def _token_text(value) -> str:
    """A special token as tokenizer_config.json writes it: a string, or ``{"content": ...}``."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value or ""


def load_template(model_dir: str) -> ChatTemplate:
    """The chat template of a model folder; a one-line error naming the folder when it has none."""
    config_path = os.path.join(model_dir, "tokenizer_config.json")
    doc = {}
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as fh:
            doc = json.load(fh)
    text = doc.get("chat_template")
    if isinstance(text, list):  # several named templates: the default one
        text = next((t.get("template") for t in text if t.get("name") == "default"), None)
    jinja = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(jinja):  # transformers gives the file priority over the config's entry
        with open(jinja, encoding="utf-8") as fh:
            text = fh.read()
    if not text:
        raise ConfigError(f"--tokenizer={model_dir!r} is invalid for --format chat: it has no chat template "
                          "(tokenizer_config.json's chat_template, or chat_template.jinja); give the folder of a "
                          "chat model, or use --format text")
    return ChatTemplate(model_dir, text, _token_text(doc.get("bos_token")), _token_text(doc.get("eos_token")))


_templates: dict = {}


TEMPLATE_FILE = "chat_template.jinja"
"""Where a prepared corpus of conversations keeps the template it was rendered with."""


def template_sha256(text: str) -> str:
    import hashlib
    return hashlib.sha256(text.encode()).hexdigest()


def corpus_template(corpus: str) -> tuple[str, str | None] | None:
    """(sha256, text) of the chat template a prepared corpus was rendered with -- the text None for
    a corpus prepared before it was kept there; None for a corpus of plain text."""
    try:
        with open(os.path.join(corpus, "manifest.json"), encoding="utf-8") as fh:
            recorded = json.load(fh).get("chat_template")
    except (OSError, ValueError):
        return None
    if not recorded:
        return None
    path = os.path.join(corpus, recorded.get("file") or TEMPLATE_FILE)
    text = None
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    return recorded["sha256"], text


def folder_template(model_dir: str) -> ChatTemplate | None:
    """The folder's chat template, or None for a folder without one (a base model)."""
    try:
        return load_template(model_dir)
    except ConfigError:
        return None


def _compiled(text: str):
    if text not in _templates:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ConfigError(f"the chat template refused a conversation: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
        _templates[text] = env.from_string(text)
    return _templates[text]


def _content_ok(m: dict) -> bool:
    """Text; a list of text parts ({"type": "text", "text": ...}, as OpenAI's format writes it), which
    is joined into one text (a template that reads content as text would render the list's repr);
    or none on an assistant turn that calls tools (``tool_calls``), given to the template as is."""
    content = m.get("content")
    if isinstance(content, str):
        return True
    if isinstance(content, list):
        return bool(content) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                     for p in content)
    return content is None and m["role"] == "assistant" and isinstance(m.get("tool_calls"), list) and bool(m["tool_calls"])


def messages_of(record, where: str) -> list[dict]:
    """The record's messages, checked: a list of {role, content} with known roles and text content
    (see :func:`_content_ok`)."""
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(f"{where} has no \"messages\" list (--format chat); its keys: {keys}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ConfigError(f"{where}: message {i} has no \"role\"")
        if m["role"] not in ROLES:
            raise ConfigError(f"{where}: message {i} has role {m['role']!r}; known: {', '.join(ROLES)}")
        if not _content_ok(m):
            raise ConfigError(f"{where}: message {i} ({m['role']}) has no text \"content\" (a text, a list of "
                              "{\"type\": \"text\", \"text\": ...} parts, or none beside an assistant's \"tool_calls\")")
    return [{**m, "content": "".join(p["text"] for p in m["content"])} if isinstance(m.get("content"), list) else m
            for m in messages]


def render_with_spans(template: ChatTemplate, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The whole conversation's text, and the (start, end) characters of each assistant turn."""
    text = template.render(messages)
    for i, m in enumerate(messages):  # a template without a branch for a role drops its turns silently
        said = m.get("content")
        if isinstance(said, str) and said.strip() and said.strip() not in text:
            raise ConfigError(f"{where}: the chat template of {template.source!r} leaves out message {i} "
                              f"({m['role']}): its text is not in the rendering; give it a role the template "
                              "renders (e.g. system for developer)")
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = template.render(messages[:i], add_generation_prompt=True)
        upto = template.render(messages[:i + 1])
        if not (upto.startswith(before) and text.startswith(upto)):
            raise ConfigError(f"{where}: the chat template of {template.source!r} does not render this conversation "
                              f"turn by turn (its text up to message {i} is not a prefix of the whole), so which "
                              "tokens the assistant says cannot be told; use --train-on all")
        spans.append((len(before), len(upto)))
    return text, spans


def loss_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token that starts inside an assistant turn, else 0."""
    starts = np.asarray([o[0] for o in offsets], dtype=np.int64)
    mask = np.zeros(len(offsets), dtype=np.uint8)
    for lo, hi in spans:
        mask[(starts >= lo) & (starts < hi)] = 1
    return mask
