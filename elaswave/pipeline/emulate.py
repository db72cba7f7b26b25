"""Emulated compute: a layer's forward or backward also takes a modelled time.

The real (tiny) layers still run, so values, gradients and the bits of every result are those of
real training; the sleep adds the time a full-size layer would take at the rank's frequency level.
Sleeping leaves the cores free, so 16-32 ranks on a 2-core machine keep the timing of a schedule
instead of the timing of CPU contention.
"""
from __future__ import annotations

import time
from typing import Sequence

from elaswave.config import JobConfig
from elaswave.model.registry import model_for
from elaswave.runtime.actuator import Actuator


def layer_forward_s(cfg: JobConfig, model=None) -> list[float]:
    """Each layer's modelled forward time per micro-batch at nominal frequency: the block's time
    (layer 1's), shared out by the model's cost profile (the same one the planner balances stages by)."""
    flops = [c.flops_per_token for c in (model or model_for(cfg)).layer_costs()]
    return [cfg.emulate.block_forward_ms / 1e3 * f / flops[1] for f in flops]


class EmulatedCompute:
    """``chunks``: the (start, end) layers of each model chunk the rank runs."""

    def __init__(self, forward_s: Sequence[float], backward_factor: float, chunks: Sequence[tuple[int, int]],
                 actuator: Actuator):
        self.layer_s, self.chunks = list(forward_s), list(chunks)
        self.forward_s = [sum(forward_s[start:end]) for start, end in chunks]
        self.backward_s = [f * backward_factor for f in self.forward_s]
        self.actuator = actuator

    def _take(self, seconds: float, began: float) -> None:
        # The real compute already spent some of the modelled time; sleep only what is left.
        left = seconds / self.actuator.level - (time.perf_counter() - began)
        if left > 0:
            time.sleep(left)

    def forward(self, began: float, chunk: int = 0) -> None:
        self._take(self.forward_s[chunk], began)

    def backward(self, began: float, share: float = 1.0, chunk: int = 0) -> None:
        """``share``: the part of a whole backward this one is (ZB-H1's B and W split it)."""
        self._take(self.backward_s[chunk] * share, began)

    def backward_through(self, began: float, chunk: int, layer: int, share: float = 1.0) -> None:
        """A backward of ``chunk`` (``share`` of a whole one: ZB-H1's W), which runs its layers from
        the last down, has made ``layer``'s gradient whole: take the modelled time of the layers
        from it up."""
        start, end = self.chunks[chunk]
        whole = sum(self.layer_s[start:end])
        done = sum(self.layer_s[layer:end]) / whole if whole else 1.0
        self._take(self.backward_s[chunk] * share * done, began)
