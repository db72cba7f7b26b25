"""Typed job configuration, validated at the edge.

A TOML (or JSON) file and ``--set section.key=value`` overrides map onto the same dataclasses.
Every bad value raises :class:`ConfigError` naming the key, the value and what would be valid, so
the CLI can print one line and exit non-zero instead of failing deep inside a worker.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field, fields
from typing import Any

from elaswave.control import faults

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - exercised only on 3.9/3.10
    import tomli as tomllib  # type: ignore[no-redef]


class ConfigError(ValueError):
    """A configuration value is invalid; the message is one line meant for the user."""


def _fail(key: str, value: Any, valid: str) -> None:
    raise ConfigError(f"{key}={value!r} is invalid: {valid}")


@dataclass
class ModelConfig:
    """A small decoder-only transformer; layers = embedding + ``num_blocks`` blocks + head."""

    vocab_size: int = 256
    """Byte-level corpora need 256; a token file needs more than its largest token id."""
    seq_len: int = 64
    d_model: int = 64
    num_heads: int = 4
    num_blocks: int = 4
    dropout: float = 0.1

    @property
    def num_layers(self) -> int:
        return self.num_blocks + 2

    def validate(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "num_heads", "num_blocks"):
            if getattr(self, name) < 1:
                _fail(f"model.{name}", getattr(self, name), "must be >= 1")
        if self.d_model % self.num_heads:
            _fail("model.d_model", self.d_model, f"must be divisible by model.num_heads={self.num_heads}")
        if not 0.0 <= self.dropout < 1.0:
            _fail("model.dropout", self.dropout, "must be in [0, 1)")


DATA_SOURCES = ("stdlib", "text", "bin")


@dataclass
class DataConfig:
    source: str = "stdlib"
    """stdlib: the Python standard library's own source as bytes (no download);
    text: ``path`` is a text file or a folder of them (bytes as tokens);
    bin: ``path`` is a flat little-endian uint16 token file (nanoGPT-style .bin)."""
    path: str = ""
    max_corpus_bytes: int = 4_000_000
    """Upper bound on how much of a text corpus is read (keeps start-up short on every rank)."""

    def validate(self) -> None:
        if self.source not in DATA_SOURCES:
            _fail("data.source", self.source, f"must be one of {', '.join(DATA_SOURCES)}")
        if self.source != "stdlib":
            if not self.path:
                _fail("data.path", self.path, f"data.source={self.source} needs a path")
            if not os.path.exists(self.path):
                _fail("data.path", self.path, "no such file or folder")
        if self.max_corpus_bytes < 1024:
            _fail("data.max_corpus_bytes", self.max_corpus_bytes, "must be >= 1024")


@dataclass
class TrainConfig:
    steps: int = 40
    seed: int = 1234
    micro_batch_size: int = 4
    num_micro_batches: int = 8
    """The global batch is always this many micro-batches (fixed ids 0..M-1 in every step)."""
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 turns clipping off."""
    deterministic: bool = False
    """Bit-identical results across every dp x pp layout (fixed-point gradient reduction)."""
    grad_fixed_point_bits: int = 32
    """Deterministic mode: gradients are summed as round(g * 2**bits) in int64."""

    def validate(self) -> None:
        for name in ("steps", "micro_batch_size", "num_micro_batches"):
            if getattr(self, name) < 1:
                _fail(f"train.{name}", getattr(self, name), "must be >= 1")
        for name in ("warmup_steps", "seed"):
            if getattr(self, name) < 0:
                _fail(f"train.{name}", getattr(self, name), "must be >= 0")
        for name in ("lr", "min_lr", "weight_decay", "grad_clip", "eps"):
            if getattr(self, name) < 0:
                _fail(f"train.{name}", getattr(self, name), "must be >= 0")
        if self.lr <= 0:
            _fail("train.lr", self.lr, "must be > 0")
        if self.min_lr > self.lr:
            _fail("train.min_lr", self.min_lr, f"must be <= train.lr={self.lr}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                _fail(f"train.{name}", getattr(self, name), "must be in [0, 1)")
        if not 8 <= self.grad_fixed_point_bits <= 48:
            _fail("train.grad_fixed_point_bits", self.grad_fixed_point_bits, "must be in [8, 48]")


BACKENDS = ("auto", "gloo", "nccl")


@dataclass
class ParallelConfig:
    dp: int = 2
    """Pipelines (data-parallel replicas)."""
    pp: int = 2
    """Stages per pipeline."""
    backend: str = "auto"
    """auto: nccl when CUDA is available, else gloo."""
    chunk_numel: int = 4096
    """ZeRO-1 chunk size in elements; chunk c of a layer is owned by holder c mod n."""
    timeout_s: float = 120.0
    """Bound on every collective and p2p wait."""

    def validate(self) -> None:
        for name in ("dp", "pp"):
            if getattr(self, name) < 1:
                _fail(f"parallel.{name}", getattr(self, name), "must be >= 1")
        if self.backend not in BACKENDS:
            _fail("parallel.backend", self.backend, f"must be one of {', '.join(BACKENDS)}")
        if self.chunk_numel < 64:
            _fail("parallel.chunk_numel", self.chunk_numel, "must be >= 64")
        if self.timeout_s <= 0:
            _fail("parallel.timeout_s", self.timeout_s, "must be > 0")


POLICIES = ("elaswave", "drop_replica")


@dataclass
class ElasticConfig:
    enabled: bool = True
    """Survive rank failures; off: one dead rank ends the job (the launcher stops every worker)."""
    heartbeat_interval_s: float = 0.2
    heartbeat_timeout_s: float = 2.0
    """A rank whose heartbeat has not moved for this long is declared gone (a hang, e.g. SIGSTOP)."""
    agree_timeout_s: float = 1.0
    """After an alert, a member that has not checked in within this long is left out of the next
    epoch (a dead process is usually known sooner: its launcher reports it)."""
    snapshots: bool = True
    """Copy every rank's ZeRO chunks into a peer's memory after each step (needed to recover them)."""
    standby_groups: bool = True
    """Pre-build the communicator for the loss of each member (gloo), so recovery does not wait for it."""
    policy: str = "elaswave"
    """elaswave: the dead rank's micro-batches move to survivors (global batch kept);
    drop_replica: a baseline that skips them and averages over the live replicas, as TorchFT does."""
    inject: tuple = ()
    """Faults to inject, e.g. "kill:rank=2,step=12,phase=reduce" or "stop:rank=1,step=5"."""

    def validate(self) -> None:
        for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "agree_timeout_s"):
            if getattr(self, name) <= 0:
                _fail(f"elastic.{name}", getattr(self, name), "must be > 0")
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            _fail("elastic.heartbeat_timeout_s", self.heartbeat_timeout_s,
                  f"must be >= 2 x elastic.heartbeat_interval_s={self.heartbeat_interval_s}")
        if self.policy not in POLICIES:
            _fail("elastic.policy", self.policy, f"must be one of {', '.join(POLICIES)}")
        for text in self.inject:
            try:
                faults.parse(text)
            except ValueError as exc:
                _fail("elastic.inject", text, str(exc))

    @property
    def faults(self) -> list[faults.Fault]:
        return [faults.parse(text) for text in self.inject]


@dataclass
class CheckpointConfig:
    """Disk checkpoints (torch.distributed.checkpoint): for whole-job restarts, and the fallback when
    a rank dies together with the peer that holds its in-memory snapshot."""

    dir: str = ""
    """Where checkpoints go; empty: none are written or read."""
    every_steps: int = 0
    """Save the state every this many steps, in the background; 0: never save."""
    keep: int = 2
    """Complete checkpoints kept; older ones are deleted."""
    resume: bool = True
    """At start, continue from the newest complete checkpoint in ``dir`` if there is one."""

    def validate(self) -> None:
        if self.every_steps < 0:
            _fail("checkpoint.every_steps", self.every_steps, "must be >= 0 (0: never save)")
        if self.every_steps > 0 and not self.dir:
            _fail("checkpoint.every_steps", self.every_steps, "needs checkpoint.dir set to a directory")
        if self.keep < 1:
            _fail("checkpoint.keep", self.keep, "must be >= 1")
        if self.dir and os.path.exists(self.dir) and not os.path.isdir(self.dir):
            _fail("checkpoint.dir", self.dir, "exists and is not a directory")


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    @property
    def world_size(self) -> int:
        return self.parallel.dp * self.parallel.pp

    def validate(self) -> "JobConfig":
        self.model.validate()
        self.data.validate()
        self.train.validate()
        self.parallel.validate()
        self.elastic.validate()
        self.checkpoint.validate()
        for text in self.elastic.inject:
            fault = faults.parse(text)
            if fault.rank >= self.world_size:
                _fail("elastic.inject", text, f"rank {fault.rank} does not exist: the job has ranks "
                                              f"0..{self.world_size - 1}")
        if self.parallel.pp > self.model.num_layers:
            _fail("parallel.pp", self.parallel.pp,
                  f"must be <= the model's {self.model.num_layers} layers "
                  f"(model.num_blocks={self.model.num_blocks} + embedding + head)")
        if self.train.num_micro_batches < self.parallel.dp:
            _fail("train.num_micro_batches", self.train.num_micro_batches,
                  f"must be >= parallel.dp={self.parallel.dp} so every pipeline has work")
        if self.data.source == "stdlib" or self.data.source == "text":
            if self.model.vocab_size < 256:
                _fail("model.vocab_size", self.model.vocab_size,
                      f"must be >= 256 for byte-level data.source={self.data.source}")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def model_identity(self) -> dict:
        """What a checkpoint must match to load into this job: the model's shape."""
        return {k: v for k, v in dataclasses.asdict(self.model).items() if k != "dropout"}


_SECTIONS = {f.name: f.type for f in fields(JobConfig)}


def _coerce(key: str, raw: Any, default: Any) -> Any:
    """Parse ``raw`` (a string from --set, or a TOML value) into the type of ``default``."""
    kind = type(default)
    if kind is tuple:  # a list in TOML/JSON, or ';'-separated items from --set
        items = raw.split(";") if isinstance(raw, str) else raw
        if not isinstance(items, (list, tuple)) or not all(isinstance(x, str) for x in items):
            _fail(key, raw, "must be a list of strings")
        return tuple(x.strip() for x in items if x.strip())
    if isinstance(raw, str) and kind is not str:
        text = raw.strip()
        try:
            if kind is bool:
                if text.lower() in ("1", "true", "yes", "on"):
                    return True
                if text.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError
            return kind(float(text)) if kind is int and "e" in text.lower() else kind(text)
        except ValueError:
            _fail(key, raw, f"must be a {kind.__name__}")
    if kind is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    if kind is int and isinstance(raw, float) and raw.is_integer():
        return int(raw)
    if not isinstance(raw, kind) or (kind is int and isinstance(raw, bool)):
        _fail(key, raw, f"must be a {kind.__name__}")
    return raw


def _apply(cfg: JobConfig, key: str, raw: Any) -> None:
    section, _, name = key.partition(".")
    if section not in _SECTIONS or not name:
        _fail(key, raw, f"unknown key; sections are {', '.join(_SECTIONS)} (e.g. parallel.dp)")
    target = getattr(cfg, section)
    valid = [f.name for f in fields(target)]
    if name not in valid:
        _fail(key, raw, f"unknown key; {section} has {', '.join(valid)}")
    setattr(target, name, _coerce(key, raw, getattr(target, name)))


def load(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Defaults, then the file at ``path`` (.toml or .json), then ``key=value`` overrides."""
    cfg = JobConfig()
    if path:
        if not os.path.isfile(path):
            _fail("--config", path, "no such file")
        try:
            with open(path, "rb") as fh:
                doc = json.load(fh) if path.endswith(".json") else tomllib.load(fh)
        except (ValueError, tomllib.TOMLDecodeError) as exc:
            _fail("--config", path, f"not valid {'JSON' if path.endswith('.json') else 'TOML'} ({exc})")
        for section, body in doc.items():
            if not isinstance(body, dict):
                _fail(section, body, "top-level entries must be sections like [train]")
            for name, raw in body.items():
                _apply(cfg, f"{section}.{name}", raw)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            _fail("--set", item, "must look like section.key=value")
        _apply(cfg, key.strip(), raw)
    return cfg.validate()


def from_dict(doc: dict) -> JobConfig:
    """Rebuild a config that :meth:`JobConfig.to_dict` wrote (launcher -> workers)."""
    cfg = JobConfig()
    for section, body in doc.items():
        for name, raw in body.items():
            _apply(cfg, f"{section}.{name}", raw)
    return cfg.validate()
