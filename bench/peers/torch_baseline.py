"""Baseline trainer from PyTorch's own parts, same model/data/layout as elaswave, run by torchrun.

dp-only: DistributedDataParallel + torch.optim.AdamW. dp x pp: torch.distributed.pipelining
(PipelineStage + Schedule1F1B) per pipeline, gradients all-reduced across the stage's replicas, and
torch.optim.AdamW. Writes {"step_times_s": [...], "optimizer_state_bytes": ...} per rank 0 to --out.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import baseline_args, require_gpt  # noqa: E402
from elaswave import rng  # noqa: E402
from elaswave.data.sampler import open_sampler  # noqa: E402
from elaswave.model.gpt import build_layer, layer_flops, token_loss_sum  # noqa: E402
from elaswave.plan.partition import partition  # noqa: E402


class Layers(nn.Module):
    """A contiguous range of elaswave's layers as a plain module (dropout stream per call)."""

    def __init__(self, cfg, start, end):
        super().__init__()
        self.seed = cfg.train.seed
        self.blocks = nn.ModuleList(build_layer(cfg.model, i, cfg.train.seed) for i in range(start, end))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        for i, layer in enumerate(self.blocks):
            x = layer(x, rng.generator(self.seed, rng.DROPOUT, self.calls, i))
        return x


def state_bytes(opt):
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)


def main():
    args, cfg = baseline_args(__doc__.splitlines()[0])
    require_gpt(cfg, "torch_baseline.py")
    t, m = cfg.train, cfg.model
    dp, pp = cfg.parallel.dp, cfg.parallel.pp
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    d, s = divmod(rank, pp)
    sampler = open_sampler(cfg, m)
    per_pipe = t.num_micro_batches // dp
    mbs = list(range(d * per_pipe, (d + 1) * per_pipe))
    global_tokens = t.num_micro_batches * t.micro_batch_size * m.seq_len
    ranges = partition([layer_flops(m, i) for i in range(m.num_layers)], pp)
    module = Layers(cfg, *ranges[s])
    # Every rank creates every group in the same order.
    pipe_groups = [dist.new_group([dd * pp + ss for ss in range(pp)]) for dd in range(dp)]
    dp_groups = [dist.new_group([dd * pp + ss for dd in range(dp)]) for ss in range(pp)]
    if pp == 1:
        model = DDP(module)
        params = list(model.parameters())
    else:
        stage = PipelineStage(module, s, pp, torch.device("cpu"), group=pipe_groups[d])
        loss_fn = lambda out, tgt: token_loss_sum(out, tgt) * per_pipe / global_tokens  # noqa: E731
        schedule = Schedule1F1B(stage, per_pipe, loss_fn=loss_fn)
        params = list(module.parameters())
    opt = torch.optim.AdamW(params, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=t.weight_decay)
    times = []
    dist.barrier()
    for step in range(t.steps):
        started = time.perf_counter()
        batches = [sampler.micro_batch(step, mb) for mb in mbs]
        opt.zero_grad(set_to_none=True)
        if pp == 1:
            for i, b in enumerate(batches):
                ctx = model.no_sync() if i < len(batches) - 1 else torch.enable_grad()
                with ctx:
                    (token_loss_sum(model(b.inputs), b.targets) * dp / global_tokens).backward()
        else:
            inputs = torch.cat([b.inputs for b in batches])
            targets = torch.cat([b.targets for b in batches])
            if s == 0:
                schedule.step(inputs)
            elif s == pp - 1:
                schedule.step(target=targets, losses=[])
            else:
                schedule.step()
            if dp > 1:
                flat = torch.cat([p.grad.reshape(-1) for p in params])
                dist.all_reduce(flat, group=dp_groups[s])
                flat /= dp
                off = 0
                for p in params:
                    p.grad.copy_(flat[off:off + p.numel()].view_as(p.grad))
                    off += p.numel()
        sumsq = torch.stack([p.grad.double().pow(2).sum() for p in params]).sum().reshape(1)
        if pp > 1:
            dist.all_reduce(sumsq)  # global norm over the stages
        coef = min(1.0, t.grad_clip / (float(sumsq.sqrt()) + 1e-6))
        for p in params:
            p.grad.mul_(coef)
        opt.step()
        times.append(time.perf_counter() - started)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, state_bytes(opt))
    if rank == 0:
        with open(args.out, "w") as fh:
            json.dump({"step_times_s": times, "optimizer_state_bytes_per_rank": gathered}, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
