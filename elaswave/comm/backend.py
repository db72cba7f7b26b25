"""The one module that knows the backend: gloo on CPU, NCCL on GPUs.

Every wait is bounded: the process group carries ``timeout_s`` and p2p receives wait with it.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def choose(backend: str) -> tuple[str, torch.device]:
    """(backend name, device) for this process; ``auto`` takes NCCL only where CUDA is present."""
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("parallel.backend=nccl needs CUDA, which this machine lacks; use gloo or auto")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return "nccl", torch.device("cuda", local)
    return "gloo", torch.device("cpu")


def init_world(backend: str, rank: int, world_size: int, store: dist.Store | None, timeout_s: float) -> None:
    """Join the world: over ``store`` when the launcher hosts one, else torchrun's ``env://``."""
    timeout = timedelta(seconds=timeout_s)
    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)


def new_group(ranks: tuple[int, ...], backend: str, timeout_s: float) -> dist.ProcessGroup:
    """A group over ``ranks``; every rank of the world must call this in the same order."""
    return dist.new_group(list(ranks), backend=backend, timeout=timedelta(seconds=timeout_s))


def wait(work: dist.Work, timeout_s: float, what: str) -> None:
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise TimeoutError(f"{what} did not complete within {timeout_s}s: {exc}") from exc


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# torch 2.13 renamed the flat collectives (*_single); older releases (>= 2.4) have the *_tensor names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_is_all_reduce(backend_name: str) -> bool:
    """gloo builds reduce-scatter from a full all-reduce plus a slice: calling all-reduce costs the
    same and leaves every holder the whole sum (NCCL's reduce-scatter really moves half the bytes)."""
    return backend_name == "gloo"


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """``out`` = this rank's 1/n slice of the sum of every rank's ``inp``."""
    _reduce_scatter(out, inp, op=dist.ReduceOp.SUM, group=group)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """``out`` = every rank's ``inp``, concatenated in group-rank order."""
    _all_gather(out, inp, group=group)
