"""The held-out score of the deviation benchmark (``bench/peers/peers.py deviation``): one fixed set of
windows that no step trains on, the same for every system and every step, and one function that
scores a model's parameters on it.

- The corpus: a few folders of the Python standard library prepared with ``elaswave prepare
  --tokenizer bytes --eval-fraction 0.1`` (documents go to the eval split by a hash of their text);
  every system trains on its train split.
- The held-out windows: elaswave's own eval sampler (``open_eval_sampler``): micro-batches
  ``0..M-1`` of eval batches ``0..train.eval_batches-1``, each ``micro_batch_size`` windows of
  ``seq_len + 1`` tokens: every window of every held-out batch, whatever layout or policy trains.
- The score: what elaswave's evaluation computes (``elaswave/runtime/evaluation.py``): each
  micro-batch's summed token cross-entropy in float32, the sums added exactly (``math.fsum``) and
  divided by the tokens, with no dropout and one thread. elaswave's parameters are read from its
  per-step disk checkpoints (generation ``s``: the state after ``s`` steps); TorchFT's replica
  scores its live model after each committed step (``bench/peers/torchft_replica.py --heldout``).
"""
from __future__ import annotations

import math
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

EVAL_FRACTION = 0.1
STDLIB_FOLDERS = ("email", "asyncio", "json", "logging", "http", "urllib", "xml", "concurrent")


def prepare_corpus(out: Path) -> Path:
    """The standard library's ``STDLIB_FOLDERS`` prepared (bytes) into ``out``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    cmd = [sys.executable, "-m", "elaswave.cli", "prepare", *(str(root / f) for f in STDLIB_FOLDERS),
           "--out", str(out), "--tokenizer", "bytes", "--eval-fraction", str(EVAL_FRACTION)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return out


class Scorer:
    """The held-out loss of a model's layers (``layer(x, None)`` in order: elaswave's layer modules)."""

    def __init__(self, cfg):
        from elaswave.data.sampler import open_eval_sampler

        self.cfg = cfg
        t, m = cfg.train, cfg.model
        self.sampler = open_eval_sampler(cfg, m)
        self.batches = [self.sampler.micro_batch(j, mb) for j in range(t.eval_batches)
                        for mb in range(t.num_micro_batches)]
        self.tokens = len(self.batches) * t.micro_batch_size * m.seq_len

    def __call__(self, layers: Sequence[nn.Module]) -> float:
        from elaswave.model.gpt import token_loss_sum

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            sums = []
            with torch.no_grad():
                for b in self.batches:
                    x = b.inputs
                    for layer in layers:
                        x = layer(x, None)
                    sums.append(float(token_loss_sum(x, b.targets)))
        finally:
            torch.set_num_threads(threads)
        return math.fsum(sums) / self.tokens

    def checkpoint(self, step_dir: Path) -> float:
        """The held-out loss of an elaswave disk checkpoint (one ``step_*`` folder)."""
        return self(layers_from_checkpoint(step_dir))


def layers_from_checkpoint(step_dir: Path) -> list[nn.Module]:
    """Every layer of the model an elaswave disk checkpoint holds, rebuilt from its chunks' parameter
    rows (as ``elaswave export`` does); built-in GPT only (no ties to re-attach)."""
    from elaswave.checkpoint import disk
    from elaswave.model.config import ModelConfig
    from elaswave.model.registry import family
    from elaswave.plan.chunks import chunk_range, num_chunks
    from elaswave.zero.flat import FlatLayer

    manifest = disk.named(Path(step_dir))
    if manifest is None:
        raise RuntimeError(f"{step_dir}: no complete checkpoint")
    model = family(ModelConfig(**manifest.model))
    if model.ties:
        raise RuntimeError("bench/peers/heldout.py rebuilds untied models only (model.arch=gpt)")
    keys_of, layers = {}, []
    for i in range(model.num_layers):
        layer = FlatLayer(model.build_layer(i, 0, init=False), i)
        keys_of[i] = [(i, c) for c in range(num_chunks(layer.numel, manifest.chunk_numel))]
        layers.append(layer)
    chunks = disk.load_chunks(manifest, [k for keys in keys_of.values() for k in keys])
    with torch.no_grad():
        for layer in layers:
            for key in keys_of[layer.index]:
                start, end = chunk_range(layer.numel, manifest.chunk_numel, key[1])
                layer.flat[start:end] = chunks[key][0, :end - start]
    return [layer.module for layer in layers]
