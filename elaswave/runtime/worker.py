"""The worker entry point: one rank of a job.

Started by ``elaswave run`` (which hosts the TCPStore and passes ``ELASWAVE_STORE=host:port``) or by
``torchrun`` (``env://`` rendezvous), with the same arguments either way:
``python -m elaswave.runtime.worker [--config F] [--set key=value]...``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from elaswave import config
from elaswave.comm import backend
from elaswave.config import ConfigError, JobConfig
from elaswave.data.corpus import load_corpus
from elaswave.model.gpt import layer_flops
from elaswave.plan.plan import initial_plan
from elaswave.runtime.metrics import MetricsWriter, print_error
from elaswave.runtime.rank import build_rank
from elaswave.runtime.step import train_step
from elaswave.zero.flat import params_sha256


def _store(timeout_s: float) -> dist.Store | None:
    addr = os.environ.get("ELASWAVE_STORE")
    if not addr:
        return None
    host, port = addr.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))


def run(cfg: JobConfig, rank: int, world_size: int, metrics_out: str | None) -> None:
    t, m = cfg.train, cfg.model
    torch.set_num_threads(1)  # many ranks share a few cores; one thread each also fixes kernel order
    if cfg.world_size != world_size:
        raise ConfigError(f"parallel.dp={cfg.parallel.dp} x parallel.pp={cfg.parallel.pp} = {cfg.world_size} "
                          f"is invalid: the job has {world_size} ranks")
    name, device = backend.choose(cfg.parallel.backend)
    backend.init_world(name, rank, world_size, _store(cfg.parallel.timeout_s), cfg.parallel.timeout_s)
    plan = initial_plan(world_size, cfg.parallel.dp, cfg.parallel.pp,
                        [layer_flops(m, i) for i in range(m.num_layers)], t.num_micro_batches)
    start, end = plan.layers_of(rank)
    needs_data = start == 0 or end == m.num_layers  # first stages read inputs, last stages targets
    tokens = load_corpus(cfg.data, m.vocab_size, m.seq_len + 1) if needs_data else None
    st = build_rank(cfg, plan, rank, tokens, name, device)
    writer = MetricsWriter(metrics_out if rank == 0 else None, show_progress=rank == 0, total_steps=t.steps)
    samples = t.num_micro_batches * t.micro_batch_size
    dist.barrier()
    began = time.perf_counter()
    result = None
    for step in range(t.steps):
        started = time.perf_counter()
        result = train_step(st, cfg, step)
        took = time.perf_counter() - started
        writer.write({"event": "step", "step": step, "loss": result.loss, "grad_norm": result.grad_norm,
                      "lr": result.lr, "num_samples": samples, "world_size": world_size,
                      "epoch": plan.epoch, "step_time_s": took, "tokens_per_s": samples * m.seq_len / took,
                      "phases_s": result.phases_s})
    wall = time.perf_counter() - began

    # params_sha256 over every layer in canonical order, each digested by its first holder.
    mine = {l.index: l.digest() for l in st.stage.layers if plan.holders(l.index)[0] == rank}
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, (mine, st.optimizer.state_bytes()))
    if rank == 0:
        digests = {i: h for part, _ in gathered for i, h in part.items()}
        writer.write({"event": "summary", "steps": t.steps, "final_loss": result.loss if result else float("nan"),
                      "params_sha256": params_sha256([digests[i] for i in range(m.num_layers)]),
                      "wall_s": wall, "world_size": world_size, "dp": cfg.parallel.dp, "pp": cfg.parallel.pp,
                      "deterministic": t.deterministic,
                      "optimizer_state_bytes_per_rank": [b for _, b in gathered]})
    writer.close()
    backend.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="elaswave-worker")
    ap.add_argument("--config")
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--metrics-out")
    args = ap.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = config.load(args.config, args.overrides)
        run(cfg, rank, world_size, args.metrics_out)
    except ConfigError as exc:
        print_error(str(exc))
        return 2
    except Exception as exc:  # one line for the user; the traceback goes with ELASWAVE_DEBUG=1
        if os.environ.get("ELASWAVE_DEBUG"):
            raise
        print_error(f"rank {rank}: {type(exc).__name__}: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
