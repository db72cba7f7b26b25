"""One rank of :func:`tests.helpers.spawn.run_group`: joins a gloo group of real processes and runs
a test's function in it (``python -m tests.helpers.group_rank MODULE:FUNCTION RANK SIZE PORT OUT ARGS``)."""
import importlib
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from elaswave.comm.backend import make_process_group
from elaswave.comm.groups import Group
from elaswave.interrupt import Interrupt


def main() -> None:
    target, rank, size, port, out, args = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5], json.loads(sys.argv[6])
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=timedelta(seconds=60))
    pg = make_process_group(store, "test", rank, size, "gloo", 60.0, torch.device("cpu"), bind="127.0.0.1")
    module, function = target.split(":")
    result = getattr(importlib.import_module(module), function)(Group(pg, range(size), rank, 0, 60.0, Interrupt()),
                                                                 **args)
    torch.save(result, out)
    # Out without tearing the group and the store down: a gloo group destroyed at interpreter exit,
    # its peer still connected, can abort the process ("terminate called without an active
    # exception", exit -6: 1 run of ~1,300 tests in session 46) after the result was written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
