"""A data trace: each rank that reads a micro-batch appends its window ids to ``DIR/rank-R.jsonl``
(``ELASWAVE_DATA_TRACE=DIR``). What the exactly-once test reads, and what to look at when a rank's
data is in doubt; ``elaswave data batches`` says the same from the config alone."""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

import numpy as np

DATA_TRACE_ENV = "ELASWAVE_DATA_TRACE"


class DataTrace:
    def __init__(self, folder: str, rank: int, plan_epoch: Callable[[], int]):
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, f"rank-{rank}.jsonl")
        self.rank, self.plan_epoch = rank, plan_epoch

    def __call__(self, step: int, index: int, windows: np.ndarray) -> None:
        record = {"rank": self.rank, "pid": os.getpid(), "plan_epoch": self.plan_epoch(), "step": step,
                  "micro_batch": index, "windows": windows.tolist(), "wall_time": time.time()}
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
