"""What a job checks once, up front, before any worker starts -- from the command line and the
Python API alike: so a bad weights file, corpus, factory or memory limit is one line here, not N
worker tracebacks (or one worker's exit and its peers waiting ``parallel.timeout_s``)."""
from __future__ import annotations

from elaswave.config import JobConfig
from elaswave.errors import ConfigError


def check(cfg: JobConfig) -> None:
    check_model_and_data(cfg)
    check_memory(cfg)
    check_resume(cfg)


def check_resume(cfg: JobConfig) -> None:
    """The newest checkpoint a run would resume from was trained on the same data, read the same way."""
    c = cfg.checkpoint
    if not (c.dir and c.resume):
        return
    from elaswave.checkpoint import disk

    from elaswave.tensor import checkpoints

    checkpoints.check_degree(c.dir, cfg.parallel.tp)
    manifest = checkpoints.latest(c.dir, 0, cfg.parallel.tp)
    if manifest is not None:
        try:
            manifest.check_data(cfg.data_identity())
        except disk.CheckpointError as exc:
            raise ConfigError(f"checkpoint.dir={c.dir!r} is invalid: {exc}") from None


def check_tokenizer(cfg: JobConfig) -> None:
    """A model from a folder trains on text tokenized by its own tokenizer: a prepared corpus whose
    tokenizer is the folder's (by hash: the same vocabulary size is not the same tokenizer), or
    bytes only when asked for by name."""
    m, d = cfg.model, cfg.data
    if not m.init_from:
        return
    import hashlib
    import os

    if d.kind != "tokens":
        if d.source == "auto":
            raise ConfigError(f"model.init_from={m.init_from!r} is invalid without data.path: the job would train the "
                              f"model on {'the Python standard library' if d.kind == 'stdlib' else d.path!r} as bytes, "
                              f"not as its tokenizer reads text; give data.path a corpus made with `elaswave prepare ... "
                              f"--tokenizer {m.init_from}`, or set data.source={d.kind} to train on bytes anyway")
        return
    own = os.path.join(m.init_from, "tokenizer.json")
    if not os.path.isfile(own):
        return  # nothing to compare with: the folder carries no tokenizer
    with open(own, encoding="utf-8") as fh:
        expected = hashlib.sha256(fh.read().encode()).hexdigest()
    from elaswave.data.shards import read_manifest

    from elaswave.data.chat import corpus_template

    paths = [p for p, _ in d.mixture] or [d.path]
    rendered = {corpus_template(p)[0] for p in paths if corpus_template(p) is not None}
    if len(rendered) > 1:
        raise ConfigError(f"data.mix={list(d.mix)} is invalid: its corpora of conversations were rendered with "
                          f"{len(rendered)} different chat templates, and the model learns one; prepare them with "
                          f"the same --tokenizer {m.init_from}")
    for path in paths:
        tok = read_manifest(path)["tokenizer"]
        if tok["sha256"] != expected:
            raise ConfigError(f"data.path={path!r} is invalid for model.init_from={m.init_from!r}: it was tokenized "
                              f"with {tok['name']!r}, not with the model's tokenizer.json; prepare it again with "
                              f"--tokenizer {m.init_from}")
        check_chat_template(cfg, path)


def check_chat_template(cfg: JobConfig, path: str) -> None:
    """A corpus of conversations is trained from a folder with the template it was rendered with,
    or one without a template; another only with data.chat_template=corpus, whose export carries
    the corpus's (so its text must be in the corpus)."""
    from elaswave.data import chat

    rendered = chat.corpus_template(path)
    if rendered is None:
        return
    sha, text = rendered
    own = chat.folder_template(cfg.model.init_from)
    if own is not None and chat.template_sha256(own.text) != sha and cfg.data.chat_template == "check":
        raise ConfigError(f"data.path={path!r} is invalid for model.init_from={cfg.model.init_from!r}: its conversations "
                          f"were rendered with another chat template than the folder's ({own.source}); prepare it "
                          f"again with --tokenizer {cfg.model.init_from}, or set data.chat_template=corpus to train on "
                          "it and export the corpus's template")
    if text is None and (own is None or cfg.data.chat_template == "corpus"):
        raise ConfigError(f"data.path={path!r} is invalid for model.init_from={cfg.model.init_from!r}: it was prepared "
                          f"before elaswave kept the chat template's text beside it ({chat.TEMPLATE_FILE}), which the "
                          "export must carry; prepare it again")


def check_memory(cfg: JobConfig) -> None:
    """A configured memory limit no layout meets: said here once, before any rank starts (``auto``
    is agreed by the ranks, which check it: elaswave.runtime.device_memory)."""
    limit = cfg.parallel.stage_memory_limit_mb
    if not limit:
        return
    from elaswave.comm import backend
    from elaswave.runtime.memory import least_stage_memory_mb

    least = least_stage_memory_mb(cfg, cfg.parallel.pp, cfg.parallel.dp, backend.choose(cfg.parallel.backend)[1])
    if least > limit:
        raise ConfigError(f"parallel.stage_memory_mb={cfg.parallel.stage_memory_mb} is invalid: no partition of the model into "
                          f"{cfg.parallel.pp} stages fits it at dp={cfg.parallel.dp}; the least any needs is "
                          f"{least:.4g} (MiB per rank, as elaswave/plan/memory.py models it)")


def check_model_and_data(cfg: JobConfig) -> None:
    """Load the corpus and check the model once up front, so a bad data file, factory or checkpoint
    is one line here, not N worker tracebacks."""
    from elaswave.data.sampler import open_eval_sampler, open_sampler
    from elaswave.model.registry import model_for

    check_tokenizer(cfg)
    model = model_for(cfg)
    if cfg.model.init_from:
        model.weights.check(model)
    if cfg.train.activation_checkpointing == "selective":
        _require_attention_core(model, f"model.factory={cfg.model.factory}" if cfg.model.factory else
                                f"model.arch={cfg.model.arch}")
    open_sampler(cfg, model)
    if cfg.train.eval_every:
        open_eval_sampler(cfg, model)
    note_unpacked_conversations(cfg)


def _require_attention_core(model, what: str) -> None:
    """One line unless the model's blocks name an attention core to recompute (a module with a
    ``recompute_core`` flag that routes its core through ``model.recompute.attention_core``)."""
    from elaswave.model.contract import on_meta

    with on_meta():
        layer = model.build_layer(1 if model.num_layers > 2 else 0, 0, init=False)
    if not any(hasattr(m, "recompute_core") for m in layer.modules()):
        raise ConfigError(f"train.activation_checkpointing=selective is invalid for {what}: its layers name no "
                          "attention core to recompute (a module with a recompute_core flag, "
                          "elaswave/model/recompute.py); use full or every_N")


def note_unpacked_conversations(cfg: JobConfig) -> None:
    """A corpus of conversations streamed across window edges (prepared without --pack-to) trains
    answers whose prompt sits in the window before: said once, with the command that packs them."""
    if cfg.data.kind != "tokens":
        return
    import sys

    from elaswave.data.shards import read_manifest

    for path in [p for p, _ in cfg.data.mixture] or [cfg.data.path]:
        manifest = read_manifest(path)
        if manifest.get("input_format") == "chat" and not manifest.get("packing"):
            print(f"elaswave: note: data.path={path!r} holds conversations streamed across window edges (prepared "
                  f"without --pack-to), so many are cut and trained without their start; `elaswave prepare ... "
                  f"--format chat --pack-to {cfg.model.seq_len}` packs each whole into a window", file=sys.stderr,
                  flush=True)
