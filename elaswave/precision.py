"""Training numerics: which dtype layers compute in, what stays in float32, and the kernel
settings that make deterministic mode reproducible on CUDA.

``train.precision = bf16`` is mixed precision as Megatron's distributed optimizer and FSDP's
``MixedPrecision`` do it: layer parameters, activations and their gradients are bfloat16; each
gradient is added into a float32 sum (deterministic mode: into the fixed-point integer sum, as in
float32 training); the float32 master copy of the parameters and both Adam moments live only in
the ZeRO shard of each chunk's owner, so snapshots, disk checkpoints, exports and
``params_sha256`` hold float32 values, and the bfloat16 copies are re-derived from them after every
update, recovery, migration and join. ``fp32`` computes in float32 throughout. ``auto``: bf16 on a
CUDA device that supports it, fp32 on CPU (where bfloat16 kernels gain nothing on most CPUs).

Attention: fast mode runs ``scaled_dot_product_attention`` (flash or memory-efficient kernels on
GPU) where dropout is off; deterministic mode runs it written out, as Hugging Face's eager path
does: a fused kernel picks its algorithm by device and shape, and its dropout cannot draw from the
keyed streams that make every micro-batch's masks the same on whichever rank runs it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from elaswave.errors import ConfigError

if TYPE_CHECKING:
    import torch

PRECISIONS = ("auto", "fp32", "bf16")


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype layers hold and compute in on ``device``."""
    import torch  # here: the config edge imports this module and stays free of torch

    if precision not in PRECISIONS:
        raise ConfigError(f"train.precision={precision!r} is invalid: must be one of {', '.join(PRECISIONS)}")
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" and _native_bf16(device) else "fp32"
    if precision == "fp32":
        return torch.float32
    if device.type == "cuda" and not _native_bf16(device):
        raise ConfigError(f"train.precision=bf16 is invalid on {torch.cuda.get_device_name(device)}: it has no "
                             "bfloat16 support (compute capability 8.0 or newer has); use train.precision=fp32")
    return torch.bfloat16


def _native_bf16(device: torch.device) -> bool:
    """bfloat16 in hardware (compute capability 8.0+), not emulated: torch's is_bf16_supported()
    also says yes to emulation on older GPUs, which would train far slower than fp32."""
    import torch
    return torch.cuda.get_device_capability(device)[0] >= 8


def job_dtype(precision: str, backend: str) -> torch.dtype:
    """The dtype the job's ranks compute in, from the device they would run on (``parallel.backend``):
    the single-process reference, which always runs on CPU, trains in the same precision."""
    from elaswave.comm.backend import choose
    return compute_dtype(precision, choose(backend)[1])


def name(dtype: torch.dtype) -> str:
    """``fp32`` or ``bf16``, as records and summaries say it."""
    return "bf16" if str(dtype) == "torch.bfloat16" else "fp32"


def pin_kernels(deterministic: bool, device: torch.device) -> None:
    """Deterministic mode on CUDA: cuBLAS with a fixed workspace (its reductions otherwise depend on
    how many streams share it) and torch's deterministic algorithms, warning where an op has none.
    Called before the first CUDA kernel: cuBLAS reads the setting when it makes its handle."""
    import os

    import torch
    if deterministic and device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
