"""The baseline for bench/training/llama.py: transformers' LlamaForCausalLM in a plain PyTorch DDP loop, run
by torchrun (gloo), on the same micro-batches, loss scale, clipping and AdamW as elaswave's step.
Writes {"step_times_s": [...]} from rank 0 to --out."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import baseline_args, decay_groups  # noqa: E402
from elaswave.data.sampler import open_sampler  # noqa: E402
from elaswave.model.config import to_hf_config  # noqa: E402


def main():
    args, cfg = baseline_args(__doc__.splitlines()[0])
    import transformers

    t, m = cfg.train, cfg.model
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, dp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(t.seed)
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in to_hf_config(m).items() if k not in ("architectures",)})
    model = DDP(transformers.LlamaForCausalLM(hf_cfg).train())
    sampler = open_sampler(cfg, m)
    per = t.num_micro_batches // dp
    mbs = list(range(rank * per, (rank + 1) * per))
    global_tokens = t.num_micro_batches * t.micro_batch_size * m.seq_len
    params = list(model.parameters())
    opt = torch.optim.AdamW(decay_groups(params, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    times = []
    dist.barrier()
    for step in range(t.steps):
        started = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for i, mb in enumerate(mbs):
            b = sampler.micro_batch(step, mb)
            ctx = model.no_sync() if i < len(mbs) - 1 else torch.enable_grad()
            with ctx:
                logits = model(b.inputs).logits
                loss = F.cross_entropy(logits.reshape(-1, m.vocab_size), b.targets.reshape(-1), reduction="sum")
                (loss * dp / global_tokens).backward()  # DDP averages over replicas
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        opt.step()
        times.append(time.perf_counter() - started)
    if rank == 0:
        with open(args.out, "w") as fh:
            json.dump({"step_times_s": times}, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
