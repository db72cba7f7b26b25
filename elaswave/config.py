"""Typed job configuration, validated at the edge.

A TOML (or JSON) file and ``--set section.key=value`` overrides map onto the same dataclasses.
Every bad value raises :class:`ConfigError` naming the key, the value and what would be valid, so
the CLI can print one line and exit non-zero instead of failing deep inside a worker.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

from elaswave.checkpoint.config import CheckpointConfig
from elaswave.checkpoint.target import check_target
from elaswave.comm.config import BACKENDS, ParallelConfig  # noqa: F401 - importable here as before
from elaswave.control import faults
from elaswave.control.config import ElasticConfig
from elaswave.data.config import DataConfig
from elaswave.errors import ConfigError, fail as _fail
from elaswave.model.config import ModelConfig, hf_architecture, resolve as resolve_model
from elaswave.plan.frequency import PowerModel
from elaswave.precision import PRECISIONS
from elaswave.tensor.split import check_job as check_tensor_parallel_job

__all__ = ["ConfigError", "TrainConfig", "ParallelConfig", "CheckpointConfig", "EmulateConfig", "FrequencyConfig",
           "JobConfig", "load", "from_dict"]  # ConfigError lives in elaswave.errors; importable here as before

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - exercised only on 3.9/3.10
    import tomli as tomllib  # type: ignore[no-redef]


CHECKPOINTING = "none, full, selective, auto or every_N with N >= 1 (e.g. every_2)"
"""What train.activation_checkpointing may be (the simulator's --checkpointing too)."""


def is_checkpointing(value: str) -> bool:
    return value in ("none", "full", "selective", "auto") or bool(re.fullmatch(r"every_[1-9][0-9]*", value))


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
    precision: str = "auto"
    """fp32, or bf16 (bfloat16 layers, float32 master weights and Adam moments in the ZeRO shards);
    auto: bf16 on a CUDA device that supports it, fp32 on CPU. See elaswave/precision.py."""
    activation_checkpointing: str = "none"
    """none, full (every block recomputes its forward in the backward), every_N (every N-th
    block), selective (every block's attention core, Megatron's: elaswave/model/recompute.py), or
    auto (the planner recomputes, rank by rank, the fewest blocks that bring each rank within
    parallel.stage_memory_mb -- none without a limit -- and chooses again at every re-plan:
    elaswave/plan/recompute.py): less activation memory for more compute; the same bits either way."""

    tokens: int = 0
    """A budget instead of ``steps``: train until this many tokens were seen (rounded up to whole
    steps of num_micro_batches x micro_batch_size x model.seq_len); 0: train.steps says."""
    epochs: float = 0.0
    """A budget instead of ``steps``: this many passes over the corpus's windows of seq_len + 1
    tokens, in whole steps that stay inside them (rounded down: the windows that do not fill a
    last step go unread; a single source, not data.mix); 0: train.steps says."""
    eval_every: int = 0
    """Evaluate on the held-out split (a prepared corpus's eval split) after every this many steps
    and after the last; 0: never. An evaluation is a forward-only pass on the job's own layout."""
    eval_batches: int = 4
    """Batches of num_micro_batches x micro_batch_size held-out windows per evaluation (the same
    windows every time)."""

    measure_memory_step: int = -1
    """Each rank measures its peak tensor memory in this step (elaswave/runtime/memory.py: the
    allocator's figures, through torch.profiler on CPU) and the run's summary reports it beside
    the memory model's prediction. -1: no step."""

    def checkpointed(self, layer: int, num_layers: int) -> bool:
        """Whether layer ``layer`` (of ``num_layers``; blocks are 1..num_layers-2) is recomputed
        whatever the plan (``auto``: none is; the plan's ``recomputed`` says)."""
        if self.activation_checkpointing in ("none", "selective", "auto") or not 0 < layer < num_layers - 1:
            return False
        every = 1 if self.activation_checkpointing == "full" else int(self.activation_checkpointing[6:])
        return layer % every == 0

    def eval_due(self, step: int) -> bool:
        """Whether the state after ``step`` steps is evaluated (every eval_every steps, and the last)."""
        every = self.eval_every
        return every > 0 and step > 0 and (step % every == 0 or step == self.steps)

    def validate(self) -> None:
        if self.steps < 0:
            _fail("train.steps", self.steps, "must be >= 0 (0: load, and export with checkpoint.export_hf)")
        for name in ("micro_batch_size", "num_micro_batches"):
            if getattr(self, name) < 1:
                _fail(f"train.{name}", getattr(self, name), "must be >= 1")
        if self.tokens and self.epochs:
            _fail("train.epochs", self.epochs, f"set one of train.tokens={self.tokens} and train.epochs")
        if not math.isfinite(self.epochs):
            _fail("train.epochs", self.epochs, "must be a finite number >= 0 (0: train.steps says)")
        if self.tokens < 0 or self.epochs < 0:
            _fail("train.tokens" if self.tokens < 0 else "train.epochs", min(self.tokens, self.epochs),
                  "must be >= 0 (0: train.steps says)")
        if self.eval_every < 0:
            _fail("train.eval_every", self.eval_every, "must be >= 0 (0: never evaluate)")
        if self.eval_batches < 1:
            _fail("train.eval_batches", self.eval_batches, "must be >= 1")
        if self.measure_memory_step < -1:
            _fail("train.measure_memory_step", self.measure_memory_step, "must be >= 0, or -1 for none")
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
        if self.precision not in PRECISIONS:
            _fail("train.precision", self.precision, f"must be one of {', '.join(PRECISIONS)}")
        if not is_checkpointing(self.activation_checkpointing):
            _fail("train.activation_checkpointing", self.activation_checkpointing, f"must be {CHECKPOINTING}")


@dataclass
class EmulateConfig:
    """Emulated compute: each layer's forward and backward also take a modelled time (a sleep, scaled
    by the rank's frequency level) while the tensors stay tiny; communication and control flow stay
    real. Many ranks then fit on a few cores and step time reflects scheduling, not CPU contention."""

    enabled: bool = False
    block_forward_ms: float = 5.0
    """Forward time of one transformer block per micro-batch at nominal frequency; the embedding and
    head take their share by the model's cost profile (multiply-adds per token)."""
    backward_factor: float = 2.0
    """Backward time as a multiple of forward time."""
    link_gbps: float = 0.0
    """The data-parallel gradient sums also take a modelled time: a ring all-reduce of each bucket
    over a link of this many GB/s (``2 (n-1)/n`` of its bytes), counted from when the sum started,
    so an overlapped one (parallel.overlap_grad_reduce) hides it behind the compute; so do the
    parameter all-gathers, a ring all-gather each (parallel.overlap_param_gather). 0: only the
    real transfer's time. They still run for real; the pipeline's sends are not slowed."""

    def validate(self) -> None:
        if self.block_forward_ms <= 0:
            _fail("emulate.block_forward_ms", self.block_forward_ms, "must be > 0")
        if not self.link_gbps >= 0:
            _fail("emulate.link_gbps", self.link_gbps, "must be >= 0 (0: no modelled link time)")
        if self.backward_factor <= 0:
            _fail("emulate.backward_factor", self.backward_factor, "must be > 0")


ACTUATORS = ("auto", "none", "emulated", "nvml")


@dataclass
class FrequencyConfig:
    """Frequency (DVFS) planning after a re-plan: raise the bottleneck stage, lower stages that would
    only wait, within a power cap (power model: static + dynamic * f**3 per device)."""

    planning: bool = True
    """Choose per-stage frequency levels with the micro-batch balance (elastic.policy=elaswave)."""
    actuator: str = "auto"
    """auto: emulated under emulate.enabled, else none; none: plans are logged, clocks untouched;
    emulated: emulated compute runs at the planned level; nvml: GPU application clocks through NVML
    (needs permission to set clocks; never chosen by auto)."""
    power_cap_w: float = 0.0
    """Total modelled power all devices may draw (1.0 = one device at nominal frequency), a fixed
    budget that a lost device's share stays in; 0: what the live ranks draw at nominal frequency, so
    a failure never buys the survivors clocks they could not have had before it."""

    def validate(self) -> None:
        if self.actuator not in ACTUATORS:
            _fail("frequency.actuator", self.actuator, f"must be one of {', '.join(ACTUATORS)}")
        if self.power_cap_w < 0:
            _fail("frequency.power_cap_w", self.power_cap_w, "must be >= 0 (0: the live ranks' nominal power)")


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    emulate: EmulateConfig = field(default_factory=EmulateConfig)
    frequency: FrequencyConfig = field(default_factory=FrequencyConfig)

    @property
    def world_size(self) -> int:
        return self.parallel.dp * self.parallel.pp * self.parallel.tp

    def validate(self) -> "JobConfig":
        self.model.validate()
        self.data.validate()
        for section in (self.train, self.parallel, self.elastic, self.checkpoint, self.emulate, self.frequency):
            section.validate()
        lowest = PowerModel().power(min(PowerModel().levels)) * self.world_size
        if 0 < self.frequency.power_cap_w < lowest:
            _fail("frequency.power_cap_w", self.frequency.power_cap_w, f"below what the {self.world_size} ranks draw "
                  f"at the lowest frequency level ({lowest:.3f}); raise it, or 0: the live ranks' nominal power")
        if self.frequency.actuator == "emulated" and not self.emulate.enabled:
            _fail("frequency.actuator", self.frequency.actuator, "needs emulate.enabled=true (or --emulate); "
                                                                 "use none or nvml for real compute")
        for text in self.elastic.inject:
            fault = faults.parse(text)
            if fault.rank >= self.world_size and fault.phase != "admission":  # (a joiner's number is past them)
                _fail("elastic.inject", text, f"rank {fault.rank} does not exist: the job has ranks "
                                              f"0..{self.world_size - 1}")
            if fault.phase in ("dispatch", "combine") and self.parallel.ep == 1:
                _fail("elastic.inject", text, f"phase={fault.phase} is an expert-parallel exchange's: needs parallel.ep > 1")
            if fault.what == "replica" and self.parallel.tp == 1:
                _fail("elastic.inject", text, "needs parallel.tp > 1: only a tensor-parallel shard holds replicas")
        if self.elastic.snapshot_copies > max(1, self.world_size - 1):
            _fail("elastic.snapshot_copies", self.elastic.snapshot_copies,
                  f"must be <= {max(1, self.world_size - 1)}: each of the job's {self.world_size} ranks has "
                  f"{self.world_size - 1} peers to keep its snapshot")
        if self.parallel.pp > self.model.num_layers:
            _fail("parallel.pp", self.parallel.pp,
                  f"must be <= the model's {self.model.num_layers} layers "
                  f"(model.num_blocks={self.model.num_blocks} + embedding + head)")
        chunks = self.parallel.pp * self.parallel.virtual_stages
        if self.parallel.virtual_stages > 1 and chunks > self.model.num_layers:
            _fail("parallel.virtual_stages", self.parallel.virtual_stages,
                  f"x parallel.pp={self.parallel.pp} = {chunks} chunks must be <= the model's {self.model.num_layers} layers")
        moe = self.model.num_experts and self._llama
        if self.checkpoint.export_hf and self._llama and not self.model.init_from:
            try:
                hf_architecture(self.model)
            except ValueError as exc:
                _fail("checkpoint.export_hf", self.checkpoint.export_hf, f"this model's shape is no Hugging Face "
                      f"family's, so no folder could hold it: {exc}")
        self.parallel.check_experts(self.model.num_experts if moe else 0)
        if self.parallel.ep > 1 and self.elastic.reshape:
            _fail("parallel.ep", self.parallel.ep, "with elastic.reshape=true would never exchange: a reshaped "
                  "micro-batch's units run alone (runtime/experts.py); leave one of them at its default")
        if self.parallel.tp > 1 and self.model.lora.enabled:
            _fail("model.lora.rank", self.model.lora.rank, f"adapters on tensor-parallel shards are not built yet "
                  f"(parallel.tp={self.parallel.tp}); use parallel.tp=1, or model.lora.rank=0")
        if self.parallel.tp > 1:
            check_tensor_parallel_job(self)
        if self.checkpoint.export_hf and (self.model.arch != "llama" or self.model.factory):
            _fail("checkpoint.export_hf", self.checkpoint.export_hf,
                  f"needs model.arch=llama (Hugging Face's Llama layout); this job's model is "
                  f"{self.model.factory or self.model.arch}")
        if self.data.position_ids == "per_document" and (not self._llama or self.parallel.tp > 1):
            _fail("data.position_ids", self.data.position_ids, "is built for model.arch=llama at parallel.tp=1"
                  + (f"; this job's model is {self.model.factory or self.model.arch}" if not self._llama else ""))
        if self.data.document_masking == "true" and not self._llama:
            _fail("data.document_masking", self.data.document_masking,
                  f"is implemented for model.arch=llama; this job's model is {self.model.factory or self.model.arch}")
        if self.checkpoint.export_hf:
            check_target(self.checkpoint.export_hf, self.checkpoint.overwrite,
                         keep={"model.init_from": self.model.init_from, "checkpoint.dir": self.checkpoint.dir,
                               "data.path": self.data.path, "data.mix": [p for p, _ in self.data.mixture]})
        if self.elastic.reshape and self.train.micro_batch_size == 1:
            _fail("elastic.reshape", self.elastic.reshape, "needs train.micro_batch_size > 1: a micro-batch of one "
                  "sequence is never reshaped (raise the size, or leave elastic.reshape=false)")
        if self.train.num_micro_batches < self.parallel.dp:
            _fail("train.num_micro_batches", self.train.num_micro_batches,
                  f"must be >= parallel.dp={self.parallel.dp} so every pipeline has work")
        if self.train.eval_every and self.data.kind != "tokens":
            _fail("train.eval_every", self.train.eval_every,
                  f"evaluation reads a held-out split, and data.source={self.data.kind} has none; give data.path a "
                  f"corpus made by `elaswave prepare --eval-fraction F`, or leave train.eval_every=0")
        if self.data.source == "stdlib" or self.data.source == "text":
            if self.model.vocab_size < 256 and self.model.init_from:
                _fail("data.source", self.data.source, f"reads bytes (ids up to 255), and the vocabulary of "
                      f"model.init_from={self.model.init_from!r} has {self.model.vocab_size}; prepare the text with the "
                      f"model's own tokenizer (elaswave prepare TEXT --tokenizer {self.model.init_from} --out DIR) "
                      "and set data.path=DIR")
            if self.model.vocab_size < 256:
                _fail("model.vocab_size", self.model.vocab_size,
                      f"must be >= 256 for byte-level data.source={self.data.source}")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def _llama(self) -> bool:
        return self.model.arch == "llama" and not self.model.factory

    @property
    def masks_documents(self) -> bool:
        """Document masking in effect: data.document_masking resolved, for the Llama family only
        (``auto`` on a corpus of conversations leaves other models unmasked)."""
        return self._llama and self.data.masks_documents

    def sources(self) -> dict:
        """Where the model and data came from, as absolute paths (recorded in checkpoints)."""
        return {"init_from": os.path.abspath(self.model.init_from) if self.model.init_from else "",
                "data": os.path.abspath(self.data.path) if self.data.kind == "tokens" else ""}

    def data_identity(self) -> dict:
        """What a resumed run must read as the run that saved the checkpoint did: the corpus (its
        manifest's hash), its tokenizer's, and every setting that decides which samples a step holds."""
        from elaswave.data.shards import corpus_identity  # late: keeps numpy off the config edge

        d, t = self.data, self.train
        paths = [p for p, _ in d.mixture] or [d.path]
        corpora = [list(corpus_identity(p)) if d.kind == "tokens" else [d.kind, os.path.abspath(p) if p else "",
                                                                         d.max_corpus_bytes]
                   for p in paths]  # lists: what the manifest's JSON gives back
        return {"corpus": [c[1] for c in corpora] if d.kind == "tokens" else corpora,
                "tokenizer": [c[0] for c in corpora] if d.kind == "tokens" else "bytes",
                "mix": list(d.mix), "document_masking": self.masks_documents, "seed": t.seed, "seq_len": self.model.seq_len,
                "micro_batch_size": t.micro_batch_size, "num_micro_batches": t.num_micro_batches,
                "tokens_per_step": t.num_micro_batches * t.micro_batch_size * self.model.seq_len}

    def model_identity(self) -> dict:
        """What a checkpoint must match to load into this job: the model's shape."""
        shape = {k: v for k, v in dataclasses.asdict(self.model).items() if k not in ("dropout", "preset", "init_from")}
        return json.loads(json.dumps(shape))  # as a checkpoint's manifest gives it back (model.lora.targets: a list)

    @property
    def actuator(self) -> str:
        """The frequency actuator in effect (``auto`` resolved)."""
        if self.frequency.actuator != "auto":
            return self.frequency.actuator
        return "emulated" if self.emulate.enabled else "none"


_SECTIONS = {f.name: f.type for f in fields(JobConfig)}


def _coerce(key: str, raw: Any, default: Any) -> Any:
    """Parse ``raw`` (a string from --set, or a TOML value) into the type of ``default``."""
    kind = type(default)
    if kind is str and isinstance(raw, bool):  # a TOML true/false for a key that also takes auto
        return str(raw).lower()
    if kind is str and isinstance(raw, (int, float)):  # a TOML number for a key that also takes auto
        return str(raw)
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
    # A section inside a section (model.lora): `--set model.lora.rank=8`, TOML's [model.lora], or
    # the nested dict a config's to_dict wrote.
    while True:
        head, dot, rest = name.partition(".")
        valid = [f.name for f in fields(target)]
        if head not in valid:
            _fail(key, raw, f"unknown key; {key[:len(key) - len(name)].rstrip('.')} has {', '.join(valid)}")
        inner = getattr(target, head)
        if not dataclasses.is_dataclass(inner):
            break
        if not dot:
            if not isinstance(raw, dict):
                _fail(key, raw, f"is a section; set its keys ({', '.join(f.name for f in fields(inner))})")
            for sub, value in raw.items():
                _apply(cfg, f"{key}.{sub}", value)
            return
        target, name = inner, rest
    if dot:
        _fail(key, raw, f"unknown key; {head} is not a section")
    setattr(target, name, _coerce(key, raw, getattr(target, name)))


def load(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Defaults, then the file at ``path`` (.toml or .json), then ``key=value`` overrides."""
    cfg = JobConfig()
    _file_keys: list[str] = []
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
                _file_keys.append(f"{section}.{name}")
    explicit = set(_file_keys)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            _fail("--set", item, "must look like section.key=value")
        _apply(cfg, key.strip(), raw)
        explicit.add(key.strip())
    t = cfg.train
    steps, budget = t.steps, ("train.tokens", t.tokens) if t.tokens else ("train.epochs", t.epochs)
    cfg = _budgeted(_resolved(cfg, explicit).validate())
    if "train.steps" in explicit and budget[1] and cfg.train.steps != steps:
        _fail("train.steps", steps, f"set one of train.steps and {budget[0]}: {budget[0]}={budget[1]} "
                                    f"means {cfg.train.steps} steps")
    for text in cfg.elastic.inject:  # (after the budget: it sets train.steps, which says when evaluations are)
        fault = faults.parse(text)
        if fault.phase == "eval" and not cfg.train.eval_due(fault.step):
            _fail("elastic.inject", text, f"no evaluation runs before step {fault.step} "
                                          f"(train.eval_every={cfg.train.eval_every}, train.steps={cfg.train.steps})")
    return cfg


def _budgeted(cfg: JobConfig) -> JobConfig:
    """train.steps from a token or epoch budget, which it replaces: the launcher resolves it once,
    and the config it hands its ranks (and a joiner) says steps, whatever their view of the corpus."""
    t = cfg.train
    if not (t.tokens or t.epochs):
        return cfg
    per_step = t.num_micro_batches * t.micro_batch_size
    if t.tokens:
        t.steps, t.tokens = -(-t.tokens // (per_step * cfg.model.seq_len)), 0
        return cfg
    if cfg.data.mix:
        _fail("train.epochs", t.epochs, "is ambiguous with data.mix (every source has its own epochs); "
                                        "use train.tokens or train.steps")
    from elaswave.data.corpus import corpus_tokens  # late: keeps numpy off the config edge

    windows = (corpus_tokens(cfg.data) - 1) // cfg.model.seq_len
    # Whole steps inside the epochs asked for: the last steps never read a window of the next
    # epoch; the few windows that do not fill a last step go unread (at most one step's worth).
    steps = math.floor(t.epochs * windows / per_step)
    if steps < 1:
        _fail("train.epochs", t.epochs, f"is less than one step: the corpus holds {windows} windows of model.seq_len + 1 "
                                        f"= {cfg.model.seq_len + 1} tokens and a step reads {per_step}; use more epochs "
                                        "or smaller batches")
    t.steps, t.epochs = steps, 0.0
    return cfg


def _resolved(cfg: JobConfig, explicit: set[str]) -> JobConfig:
    """The model section with its preset or checkpoint config applied (keys set explicitly win)."""
    cfg.model = resolve_model(cfg.model, {k.split(".", 1)[1] for k in explicit if k.startswith("model.")})
    return cfg


def from_dict(doc: dict) -> JobConfig:
    """Rebuild a config that :meth:`JobConfig.to_dict` wrote (launcher -> workers)."""
    cfg = JobConfig()
    for section, body in doc.items():
        for name, raw in body.items():
            _apply(cfg, f"{section}.{name}", raw)
    return _budgeted(_resolved(cfg, {f"model.{k}" for k in doc.get("model", {})}).validate())
