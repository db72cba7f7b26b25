"""Evaluation: the loss on held-out data, computed on the job's own dp x pp layout.

An evaluation due after step ``s`` (``train.eval_every``) runs before step ``s + 1``, on whatever
layout will run that step: every pipeline runs the forwards of its own step schedule (its
micro-batches, detours included) on held-out micro-batches, and the last stages' summed token
losses travel in one float64 all-reduce in which each entry has one contributor. That sum is exact,
so in deterministic mode the eval loss has the same bits on every layout, through any failure, and
in the single-process reference. A failure during an evaluation is recovered as any other: the job
resumes at some step ``r <= s + 1`` and the evaluation, due again when the loop reaches ``s + 1``,
runs again; its record goes through the step journal, so it is written once.
"""
from __future__ import annotations

import math
import time
from typing import Callable

import torch

from elaswave.data.sampler import Sampler, open_eval_sampler
from elaswave.pipeline.schedule import Action
from elaswave.runtime.rank import RankState


class Evaluation:
    def __init__(self, cfg, model):
        self.cfg, self.model = cfg, model
        # Opened on every rank at start (memory maps: cheap): a missing or short eval split is one
        # line before training, not an error of the first and last stages at the first evaluation.
        self.sampler: Sampler | None = open_eval_sampler(cfg, model) if cfg.train.eval_every else None

    def run(self, st: RankState, step: int, before: Callable[[int, Action], None] | None = None) -> dict:
        """Evaluate the state after ``step`` steps; every rank of the epoch takes part and gets the
        record. ``before(batch, action)`` runs before each action (faults, giving up in a broken epoch)."""
        t = self.cfg.train
        began = time.perf_counter()
        M = t.num_micro_batches * st.plan.units_per_micro_batch  # one entry per unit (reshaped) or micro-batch
        reads = st.stage.is_first or st.stage.is_last or self.cfg.masks_documents
        sampler = self.sampler if reads else None
        # Each micro-batch's loss sum, then its loss-token count: one contributor per entry.
        sums = torch.zeros(2 * t.eval_batches * M, dtype=torch.float64)
        for j in range(t.eval_batches):
            hook = (lambda a, j=j: before(j, a)) if before is not None else None
            for mb, (loss_sum, count) in st.executor.evaluate(st.schedule, sampler, j, hook).items():
                sums[j * M + mb] = loss_sum
                sums[(t.eval_batches + j) * M + mb] = count
        sums = sums.to(st.device)
        st.world.all_reduce(sums, "eval loss exchange")
        sums = sums.cpu().tolist()
        tokens = int(sum(sums[t.eval_batches * M:]))
        return {"event": "eval", "step": step, "eval_loss": math.fsum(sums[:t.eval_batches * M]) / tokens if tokens else None,
                "eval_tokens": tokens, "eval_s": time.perf_counter() - began,
                "world_size": len(st.plan.ranks) * self.cfg.parallel.tp,
                "epoch": st.epoch, "wall_time": time.time()}
