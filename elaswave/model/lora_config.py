"""The ``model.lora`` section: low-rank adapters on the Llama family's projections (pure: no torch).

``rank`` 0 (the default) trains every weight; above 0 the base weights are frozen and only the
adapters train (:mod:`elaswave.model.lora`). The targets are named as Hugging Face names the
projections (``q_proj``) or by their short names (``q``); both mean the same module.
"""
from __future__ import annotations

from dataclasses import dataclass

from elaswave.errors import fail as _fail

TARGETS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
           "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
"""Short name -> the projection's path inside a decoder block (Hugging Face's module names)."""


@dataclass
class LoraConfig:
    rank: int = 0
    """r: the adapters' inner width; 0: no adapters (every weight trains)."""
    alpha: float = 16.0
    """lora_alpha: the update is scaled by alpha / rank (peft's default scaling)."""
    dropout: float = 0.0
    """Dropout on an adapter's input (peft's lora_dropout), drawn from the layer's keyed stream."""
    targets: tuple[str, ...] = tuple(TARGETS)
    """Which projections get adapters: every linear projection of a block by default, as QLoRA found
    it needs to match full fine-tuning (peft's own default for Llama is q and v only)."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def paths(self) -> tuple[str, ...]:
        """The targeted projections' paths inside a block, in the block's module order."""
        wanted = {TARGETS.get(t, TARGETS.get(t.removesuffix("_proj"), t)) for t in self.targets}
        return tuple(p for p in TARGETS.values() if p in wanted)

    def validate(self, arch: str, factory: str) -> None:
        if self.rank < 0:
            _fail("model.lora.rank", self.rank, "must be >= 0 (0: no adapters)")
        if not self.enabled:
            return
        if arch != "llama" or factory:
            _fail("model.lora.rank", self.rank, f"adapters are built for model.arch=llama (Hugging Face's "
                                                f"projection names); this job's model is {factory or arch}")
        if self.alpha <= 0:
            _fail("model.lora.alpha", self.alpha, "must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            _fail("model.lora.dropout", self.dropout, "must be in [0, 1)")
        known = set(TARGETS) | {p.rpartition(".")[2] for p in TARGETS.values()}
        bad = [t for t in self.targets if t not in known]
        if bad or not self.targets:
            _fail("model.lora.targets", list(self.targets), f"must name some of {', '.join(TARGETS)} "
                                                            f"(or their Hugging Face names, e.g. q_proj)")
