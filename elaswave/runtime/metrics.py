"""Structured metrics (JSON lines) and the live progress line."""
from __future__ import annotations

import json
import sys
from typing import IO


class MetricsWriter:
    def __init__(self, path: str | None, show_progress: bool = True, total_steps: int = 0):
        self.fh: IO[str] | None = open(path, "w") if path else None
        self.show_progress = show_progress
        self.total_steps = total_steps

    def write(self, record: dict) -> None:
        if self.fh is not None:
            self.fh.write(json.dumps(record) + "\n")
            self.fh.flush()
        if self.show_progress and record.get("event") == "step":
            print(f"step {record['step'] + 1:>4}/{self.total_steps}  loss {record['loss']:.4f}  "
                  f"tok/s {record.get('tokens_per_s', 0):>8.0f}  world {record['world_size']}  "
                  f"epoch {record['epoch']}", flush=True)
        elif self.show_progress and record.get("event") == "summary":
            print(f"done: {record['steps']} steps, final loss {record['final_loss']:.4f}, "
                  f"params_sha256 {record['params_sha256'][:16]}...", flush=True)

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None


def read_jsonl(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def print_error(message: str) -> None:
    print(f"elaswave: error: {message}", file=sys.stderr, flush=True)
