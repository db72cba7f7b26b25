"""One TorchFT replica group (one process) training elaswave's model on elaswave's data: the real
peer that ``bench/peers/peers.py`` runs side by side with elaswave.

torchft's ``Manager`` (quorum through a lighthouse that ``torchft_job.py`` starts), its
``DistributedDataParallel`` (gradients averaged over the replicas of each step's quorum) and its
``OptimizerWrapper`` (the update is committed only when every replica of the quorum finished the
step), over torchft's ``ProcessGroupGloo``. Replica ``r`` of ``n`` trains micro-batches
``r*M/n .. (r+1)*M/n - 1`` of every step, with the learning-rate schedule, AdamW settings and
clipping of the job (weight decay on matrices only, as elaswave's optimizer); a lost replica's micro-batches are skipped (the global batch shrinks, as
TorchFT does). ``--plain`` trains the same loop under ``torchrun`` with torch's own DDP: the
no-fault-tolerance baseline of the overhead comparison.

Every bind stays on loopback: torchft's manager server binds all interfaces (``[::]``) and its
checkpoint server the IPv6 wildcard, so both are pointed at 127.0.0.1 here; gloo goes through
``GLOO_SOCKET_IFNAME=lo`` (set by ``torchft_job.py``).

One JSON line per committed step to ``OUT.REPLICA.jsonl`` (``--out OUT``): step, the replica's token-loss sum and token count,
participants, wall time, step time; a ``kill`` line (with its wall time) just before
``--kill-at-step`` SIGKILLs this process during that step's backward. With ``--heldout``, replica 0
adds ``heldout_loss``: its parameters after the committed step (every replica of the quorum holds
the same) scored on the job's held-out windows as elaswave's evaluation scores them
(``bench/peers/heldout.py``; ``train.eval_batches`` batches of the prepared corpus's eval split), after
the step's timing is taken.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from datetime import timedelta
from http.server import ThreadingHTTPServer
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import baseline_args, decay_groups, require_gpt  # noqa: E402
from bench.peers.heldout import Scorer  # noqa: E402
from elaswave.data.sampler import open_sampler  # noqa: E402
from elaswave.model.gpt import build_layer, token_loss_sum  # noqa: E402
from elaswave.zero.optimizer import lr_at  # noqa: E402


class Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.ModuleList(build_layer(cfg.model, i, cfg.train.seed) for i in range(cfg.model.num_layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x, None)
        return x


class _LoopbackHTTPServer(ThreadingHTTPServer):
    address_family = socket.AF_INET

    def __init__(self, _address, handler):
        super().__init__(("127.0.0.1", 0), handler)


def _keep_torchft_on_loopback() -> None:
    import torchft.checkpointing.http_transport as http_transport
    import torchft.manager as manager_mod

    server = manager_mod.ManagerServer
    manager_mod.ManagerServer = lambda **kw: server(**{**kw, "bind": "127.0.0.1:0", "hostname": "127.0.0.1"})
    http_transport._IPv6HTTPServer = _LoopbackHTTPServer
    # The address it hands to a healing peer (torchft builds it from the host's name).
    http_transport.HTTPTransport.address = (
        lambda self: f"http://127.0.0.1:{self._server.socket.getsockname()[1]}/checkpoint/")


def _options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--replica", type=int, default=0)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--lighthouse", help="http://127.0.0.1:PORT (torchft mode)")
    ap.add_argument("--ready", help="127.0.0.1:PORT of a store where replicas meet before they start")
    ap.add_argument("--plain", action="store_true", help="torch's DDP under torchrun, no fault tolerance")
    ap.add_argument("--kill-at-step", type=int, default=-1)
    ap.add_argument("--heldout", action="store_true",
                    help="replica 0 scores its parameters on the held-out windows after every committed step")


def main() -> None:
    args, cfg = baseline_args(__doc__.splitlines()[0], _options)
    require_gpt(cfg, "torchft_replica.py")
    t, m = cfg.train, cfg.model
    torch.set_num_threads(1)
    torch.manual_seed(t.seed)
    model = Model(cfg)
    sampler = open_sampler(cfg, m)

    if args.plain:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo")
        replica, replicas = dist.get_rank(), dist.get_world_size()
        ddp = DistributedDataParallel(model)
        opt = torch.optim.AdamW(decay_groups(model.parameters(), t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
        manager = None
    else:
        _keep_torchft_on_loopback()
        from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

        replica, replicas = args.replica, args.replicas
        store = torch.distributed.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
        if args.ready:  # start together, so the first quorum holds every replica
            host, port = args.ready.rsplit(":", 1)
            meet = torch.distributed.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
            meet.add("ready", 1)
            meet.wait(["go"], timedelta(seconds=60))
        manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=30)), min_replica_size=1,
                          load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), opt.load_state_dict(sd["opt"])),
                          state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict()},
                          replica_id=f"replica{replica}", store_addr="127.0.0.1", store_port=store.port, rank=0,
                          world_size=1, lighthouse_addr=args.lighthouse, hostname="127.0.0.1",
                          timeout=timedelta(seconds=30), quorum_timeout=timedelta(seconds=30),
                          # Every replica builds the same initial model from the job's seed, so no
                          # step-0 sync (torchft's advice): with it, replicas 1.. heal at step 0 and
                          # end that step with parameters of their own, never equal to replica 0's again.
                          init_sync=False)
        ddp = DistributedDataParallel(manager, model)
        opt = Optimizer(manager, torch.optim.AdamW(decay_groups(model.parameters(), t.weight_decay), lr=t.lr,
                                                    betas=(t.beta1, t.beta2), eps=t.eps))

    scorer = Scorer(cfg) if args.heldout and replica == 0 else None
    per = t.num_micro_batches // replicas
    mbs = range(replica * per, (replica + 1) * per)
    local_tokens = per * t.micro_batch_size * m.seq_len
    out = open(f"{args.out}.{replica}.jsonl", "a")
    step = 0
    while step < t.steps:
        started = time.perf_counter()
        opt.zero_grad(set_to_none=True)  # torchft: starts this step's quorum
        loss_sum = 0.0
        for i, mb in enumerate(mbs):
            b = sampler.micro_batch(step, mb)
            with ddp.no_sync() if i < len(mbs) - 1 else torch.enable_grad():
                loss = token_loss_sum(ddp(b.inputs), b.targets)
                if step == args.kill_at_step and i == len(mbs) - 1:
                    out.write(json.dumps({"event": "kill", "step": step, "wall_time": time.time()}) + "\n")
                    out.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                (loss / local_tokens).backward()
            loss_sum += loss.item()
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.stack([p.grad.double().pow(2).sum() for p in params]).sum().sqrt().item()
        coef = min(1.0, t.grad_clip / (norm + 1e-6))
        for p in params:
            p.grad.mul_(coef)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, t)
        opt.step()  # torchft: only if every replica of the quorum finished the step
        committed = manager is None or manager.current_step() > step
        if committed:
            rec = {"event": "step", "step": step, "replica": replica, "loss_sum": loss_sum,
                   "tokens": local_tokens, "step_time_s": time.perf_counter() - started, "wall_time": time.time(),
                   "participants": replicas if manager is None else manager.num_participants()}
            if scorer is not None:
                rec["heldout_loss"] = scorer(model.layers)
            out.write(json.dumps(rec) + "\n")
            out.flush()
            step = step + 1 if manager is None else manager.current_step()
    out.close()
    if manager is not None:
        manager.shutdown(wait=False)
    else:  # left to the interpreter's exit, gloo's threads can abort the process (std::terminate)
        import torch.distributed as dist
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
