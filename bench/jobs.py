"""The one way the benchmarks run a job: ``elaswave run`` in a subprocess, its metrics read back."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from elaswave.runtime.metrics import read_jsonl


def run_job(sets: list[str], metrics: Path | None = None, deterministic: bool = False,
            timeout_s: float = 900) -> list[dict]:
    """``elaswave run --set S...``; the metrics go to ``metrics`` (kept) or a temporary file."""
    with tempfile.TemporaryDirectory() as tmp:
        out = metrics or Path(tmp) / "m.jsonl"
        cmd = [sys.executable, "-m", "elaswave.cli", "run", "--metrics-out", str(out)]
        cmd += [x for s in sets for x in ("--set", s)] + (["--deterministic"] if deterministic else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        return read_jsonl(str(out))
