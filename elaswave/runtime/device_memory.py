"""The device memory a job plans within (``parallel.stage_memory_mb``): configured, or -- ``auto``
-- the smallest GPU's of the founding ranks less a reserve, agreed through the store.

One value for the whole job: ranks with different cards that each planned within their own
memory would compute different plans, and every rank must compute the same one. The founding
ranks post what their device holds; the first rank takes the smallest, publishes it, and every
rank plans within it. The plan carries it from then on (``Plan.stage_memory_limit``): re-plans
after a loss and the plans a joiner takes keep the founding value, and a joiner whose own device
is smaller says so.

CPU ranks share their host's memory and have no device memory of their own: ``auto`` plans
without a limit there, and says so in the job's first record.
"""
from __future__ import annotations

import sys
from datetime import timedelta

import torch

from elaswave.control.link import StoreLost
from elaswave.control.seal import PREFIX
from elaswave.errors import ConfigError

MIB = 2 ** 20
POSTED = PREFIX + "device_mib/"
"""``POSTED + <rank>``: a founding rank's device memory in MiB."""
AGREED = PREFIX + "device_mib"
"""The smallest of them, as the first rank read them."""


def own_mib(device: torch.device) -> float | None:
    """This rank's device memory in MiB; None for a CPU rank (none of its own)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory / MIB


def plans_within_a_limit(cfg, device: torch.device) -> bool:
    """Whether this job's plans keep within a memory limit: a configured one, or ``auto`` on GPUs."""
    configured = cfg.parallel.stage_memory_limit_mb
    return bool(configured) if configured is not None else device.type == "cuda"


def agree(store, rank: int, world_size: int, mine: float, timeout_s: float) -> float:
    """Every founding rank posts ``mine``; rank 0 publishes the smallest; all return it. Rank 0
    reads ``world_size`` records, every other rank one."""
    store.set(f"{POSTED}{rank}", repr(mine))
    within = timedelta(seconds=timeout_s)
    if rank == 0:
        names = [f"{POSTED}{r}" for r in range(world_size)]
        try:
            store.wait(names, within)
        except StoreLost:
            raise
        except Exception:  # the store's timeout: say who is missing, in one line
            missing = [r for r, name in enumerate(names) if not store.check([name])]
            raise TimeoutError(f"rank 0 waited {timeout_s:g} s (parallel.timeout_s) for every founding rank's "
                               f"device memory; ranks {missing} never posted theirs (dead, or never started)") from None
        store.set(AGREED, repr(min(float(v) for v in store.multi_get(names))))
    try:
        store.wait([AGREED], within)
    except StoreLost:
        raise
    except Exception:
        raise TimeoutError(f"rank {rank} waited {timeout_s:g} s (parallel.timeout_s) for the device memory every "
                           "founding rank agrees on, which rank 0 publishes once all have posted theirs") from None
    return float(store.get(AGREED))


def stage_limit_mb(cfg, store, rank: int, world_size: int, mine: float | None) -> tuple[float, dict]:
    """The founding plan's memory limit in MiB (0: none), and a record of where it came from;
    ``mine``: this rank's device memory (``own_mib``)."""
    p = cfg.parallel
    configured = p.stage_memory_limit_mb
    if configured is not None:
        return configured, {"source": "configured" if configured else "off", "limit_mb": configured}
    if mine is None:  # every rank of a job has the same backend, so every rank ends here
        return 0.0, {"source": "auto", "limit_mb": 0.0, "why": "CPU ranks have no device memory of their own"}
    smallest = agree(store, rank, world_size, mine, p.timeout_s)
    if smallest <= p.memory_reserve_mb:
        raise ConfigError(f"parallel.memory_reserve_mb={p.memory_reserve_mb:g} is invalid: the smallest GPU of the "
                          f"job holds {smallest:.0f} MiB; keep the reserve below it, or set parallel.stage_memory_mb")
    limit = smallest - p.memory_reserve_mb
    if rank == 0:
        print(f"elaswave: stages are planned within {limit:.0f} MiB a rank: the smallest GPU's {smallest:.0f} MiB "
              f"less parallel.memory_reserve_mb={p.memory_reserve_mb:g} (parallel.stage_memory_mb=off plans "
              "without a limit)", file=sys.stderr, flush=True)
    return limit, {"source": "auto", "limit_mb": limit, "smallest_device_mb": smallest,
                   "reserve_mb": p.memory_reserve_mb}


def unfit(cfg, agreed: dict, model, memory) -> ConfigError:
    """The error for a layout the agreed memory cannot hold, naming the least it needs (``model``,
    ``memory``: the job's model and its MemoryModel)."""
    p = cfg.parallel
    from elaswave.runtime.memory import least_mb  # late: it imports the model registry

    least = least_mb(cfg, model, memory, p.pp, p.dp)
    return ConfigError(f"parallel.stage_memory_mb=auto is invalid for this layout: no partition of the model into "
                       f"{p.pp} stages at dp={p.dp} fits the {agreed['limit_mb']:.0f} MiB a rank the job's GPUs "
                       f"leave (the smallest's {agreed['smallest_device_mb']:.0f} MiB less parallel.memory_reserve_mb); "
                       f"the least any needs is {least:.0f} MiB: use more stages, a smaller micro-batch or activation "
                       "checkpointing")


def check_joiner(cfg, rank: int, device: torch.device, limit_mb: float) -> None:
    """A joiner plans within the job's limit, whatever its own card; one that is smaller says so."""
    mine = own_mib(device)
    if mine is None or not limit_mb or cfg.parallel.stage_memory_limit_mb is not None:
        return
    if mine - cfg.parallel.memory_reserve_mb < limit_mb:
        print(f"elaswave: WARNING: rank {rank}'s GPU holds {mine:.0f} MiB, less than the job's {limit_mb:.0f} MiB a "
              f"rank plus parallel.memory_reserve_mb={cfg.parallel.memory_reserve_mb:g}, which the founding ranks "
              "agreed: a stage planned for them may not fit here", file=sys.stderr, flush=True)
