"""The checkpoint section of a job's config: disk checkpoints and the Hugging Face export (pure: no torch)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from elaswave.checkpoint.target import EXPORT_DTYPES, EXPORT_LORA
from elaswave.errors import fail as _fail


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
    export_hf: str = ""
    """When the run ends, write the model here as a Hugging Face folder: the weights, the input
    folder's config.json and tokenizer files (see elaswave/checkpoint/hf_folder.py); model.arch=llama
    only. A folder that exists and is not empty is refused unless checkpoint.overwrite."""
    export_dtype: str = "auto"
    """auto | bf16 | fp32 | fp16: the exported weights' dtype; auto: model.init_from's, bf16 for a
    model built from a preset."""
    max_shard_gb: float = 5.0
    """The largest safetensors shard of an export; one shard is named model.safetensors."""
    overwrite: bool = False
    """Let checkpoint.export_hf replace a folder that is not empty (never model.init_from's): the model in
    it is replaced, its other files (a README, notes) are kept."""
    export_lora: str = "adapter"
    """With model.lora: adapter (a peft adapter folder: adapter_config.json and
    adapter_model.safetensors, for peft.PeftModel.from_pretrained on the base) or merged (a whole
    Hugging Face folder, each adapter merged into its weight)."""

    def validate(self) -> None:
        if self.every_steps < 0:
            _fail("checkpoint.every_steps", self.every_steps, "must be >= 0 (0: never save)")
        if self.every_steps > 0 and not self.dir:
            _fail("checkpoint.every_steps", self.every_steps, "needs checkpoint.dir set to a directory")
        if self.keep < 1:
            _fail("checkpoint.keep", self.keep, "must be >= 1")
        if self.dir and os.path.exists(self.dir) and not os.path.isdir(self.dir):
            _fail("checkpoint.dir", self.dir, "exists and is not a directory")
        if self.export_dtype not in EXPORT_DTYPES:
            _fail("checkpoint.export_dtype", self.export_dtype, f"must be one of {', '.join(EXPORT_DTYPES)}")
        if not self.max_shard_gb > 0:
            _fail("checkpoint.max_shard_gb", self.max_shard_gb, "must be > 0")
        if self.export_lora not in EXPORT_LORA:
            _fail("checkpoint.export_lora", self.export_lora, f"must be one of {', '.join(EXPORT_LORA)}")
