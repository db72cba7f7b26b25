"""What the benchmarks share: where the repository, its results and BENCHMARKS.md are; the one way a
bench runs a job (``elaswave run`` in a subprocess, its metrics read back) or a torchrun baseline;
step records and interleaved pairs; the results files; BENCHMARKS.md's sections.

Every bench runs as a script from the repository's root, ``python bench/GROUP/NAME.py``; a script
cannot import this module before the root is on ``sys.path``, so its first lines are

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
    from bench.common import ...  # noqa: E402

Nothing here imports torch: the simulator's and planner's benches stay pure Python.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BENCHMARKS = ROOT / "BENCHMARKS.md"


# -- running jobs ------------------------------------------------------------------------------------
def set_flags(sets: Iterable[str]) -> list[str]:
    """``--set`` before each item: the command line of ``elaswave`` and of the baseline trainers."""
    return [x for s in sets for x in ("--set", s)]


def cli_argv(command: str, sets: Iterable[str], metrics: Path | str, deterministic: bool = False) -> list[str]:
    """``python -m elaswave.cli COMMAND --metrics-out METRICS --set S... [--deterministic]``."""
    return ([sys.executable, "-m", "elaswave.cli", command, "--metrics-out", str(metrics)] + set_flags(sets)
            + (["--deterministic"] if deterministic else []))


def torchrun_argv(nproc: int, *args: str, max_restarts: int | None = None) -> list[str]:
    """A standalone (one-host) torchrun of ``nproc`` processes running ``args`` (a script or ``-m module``)."""
    restarts = [] if max_restarts is None else [f"--max-restarts={max_restarts}"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *restarts,
            *args]


def free_port() -> int:
    """A TCP port nobody listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_job(sets: list[str], metrics: Path | None = None, deterministic: bool = False,
            timeout_s: float = 900, extra_argv: Sequence[str] = ()) -> list[dict]:
    """``elaswave run --set S... [EXTRA_ARGV]``; the metrics go to ``metrics`` (kept) or a temporary
    file. Raises ``RuntimeError`` with the command and its stderr's tail when it fails."""
    from elaswave.runtime.metrics import read_jsonl

    with tempfile.TemporaryDirectory() as tmp:
        out = metrics or Path(tmp) / "m.jsonl"
        cmd = cli_argv("run", sets, out, deterministic) + list(extra_argv)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        return read_jsonl(str(out))


def try_job(command: str, sets: list[str], deterministic: bool, timeout_s: float = 150) -> dict:
    """``python -m elaswave.cli COMMAND`` with this checkout on PYTHONPATH (the launcher hands its
    environment to the workers), a failure kept as a finding: every step record, the losses, the
    summary's ``params_sha256`` (``sha``), the exit code and, if it failed, its error in a line."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        cmd = cli_argv(command, sets, metrics, deterministic)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        began = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
            code, err = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as exc:
            code, err = 124, f"timed out after {timeout_s} s: " + (exc.stderr or b"").decode(errors="replace")
        records = [json.loads(line) for line in open(metrics)] if os.path.exists(metrics) else []
    steps = step_records(records)
    return {"exit_code": code, "wall_s": time.perf_counter() - began, "steps": steps, "losses": [r["loss"] for r in steps],
            "sha": next((r["params_sha256"] for r in records if r.get("event") == "summary"), None),
            "memory": next(({k: r[k] for k in ("memory_measured_per_rank", "memory_predicted_per_rank") if r.get(k)}
                            for r in records if r.get("event") == "summary"), None),
            "error": error_tail(err) if code else None}


def short_error(exc: BaseException) -> str:
    """An exception in one line: its type and its message's first line."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def error_tail(text: str) -> str:
    """The first two lines that name an error, and the last line (progress bars and warnings left out)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and "%|" not in ln and "Warning" not in ln]
    errors = [ln for ln in lines if "error" in ln.lower()][:2]
    return " | ".join(errors + [ln for ln in lines[-1:] if ln not in errors])[-600:]


def decay_groups(params: Iterable, weight_decay: float) -> list[dict]:
    """AdamW parameter groups as elaswave's optimizer decays: matrices only (embeddings, linear weights)."""
    params = list(params)
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def baseline_args(description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None):
    """A baseline trainer's command line (``--set`` items, ``--out``, and what ``extra`` adds) and
    the job's config from its ``--set`` items."""
    from elaswave import config

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--out", required=True)
    if extra is not None:
        extra(ap)
    args = ap.parse_args()
    return args, config.load(None, args.overrides)


def require_gpt(cfg, script: str) -> None:
    """The baselines are plain modules of elaswave's GPT layers (no ties)."""
    if cfg.model.arch != "gpt":
        raise SystemExit(f"{script}: model.arch={cfg.model.arch!r} is invalid here: set model.arch=gpt")


# -- step records and pairs --------------------------------------------------------------------------
def step_records(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("event") == "step"]


def median_step_s(records: list[dict], warmup: int) -> float:
    """The median ``step_time_s`` of the step records after the first ``warmup``."""
    return statistics.median(r["step_time_s"] for r in step_records(records)[warmup:])


def in_turn(i: int, items: Sequence) -> list:
    """Round ``i``'s order of interleaved runs: as given on even rounds, reversed on odd ones (the box's
    speed drifts by more than the effects measured over minutes)."""
    return list(items) if i % 2 == 0 else list(reversed(items))


def runs_in_turn(rounds: int, cases: Sequence, sets_of: Callable, failed: list[str], timeout_s: float,
                 deterministic: bool = True, label: Callable = str):
    """``rounds`` ``run`` jobs of each case (``sets_of(case)``: its --set items), the cases in turn
    (:func:`in_turn`): yields (round, case, :func:`try_job`'s result) for each run that ended well;
    one that failed is printed and added to ``failed`` -- a finding, left out of the medians."""
    for k in range(rounds):
        for case in in_turn(k, cases):
            run = try_job("run", sets_of(case), deterministic=deterministic, timeout_s=timeout_s)
            if run["exit_code"]:
                failed.append(f"{label(case)}: {run['error']}")
                print(f"  round {k}: {label(case)}: FAILED {run['error']}", flush=True)
                continue
            yield k, case, run


# -- results files -----------------------------------------------------------------------------------
def bench_args(doc: str, out: str | None = None, runs: int | None = None,
               parts: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """A bench's parser: its docstring's first line; where given, the part to run (one of ``parts``
    or ``all``), ``--runs`` (default ``runs``) and ``--out`` (default ``bench/results/OUT``, the
    results' path without its suffix)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    if parts is not None:
        ap.add_argument("what", choices=[*parts, "all"])
    if runs is not None:
        ap.add_argument("--runs", type=int, default=runs)
    if out is not None:
        ap.add_argument("--out", default=str(RESULTS / out))
    return ap


def write_json(path: Path | str, doc, indent: int = 1, end: str = "") -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=indent) + end)


def write_results(base: Path | str, doc, lines: list[str]) -> None:
    """``BASE.json`` (the raw results) and ``BASE.md`` (``lines``, also printed)."""
    write_json(f"{base}.json", doc)
    Path(f"{base}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def write_named(what: str, parts: dict[str, Callable[[], dict]], prefix: str, indent: int = 1, end: str = "",
                in_all: Sequence[str] | None = None) -> None:
    """``bench/results/PREFIX_NAME.json`` from each part ``what`` names (``all``: those in ``in_all``,
    by default every part)."""
    for name, fn in parts.items():
        if what == name or (what == "all" and name in (parts if in_all is None else in_all)):
            path = RESULTS / f"{prefix}_{name}.json"
            write_json(path, fn(), indent, end)
            print(f"wrote {path}")


def run_parts(doc: dict, parts: dict, results: Path | None) -> None:
    """Run each part (``name -> zero-argument function``) into ``doc[name]``: its result, or its error
    in one line (one part's failure is a finding; the rest still run). ``results`` is rewritten after
    every part, so a run cut off (a lent machine's lease) keeps what it had."""
    for name, fn in parts.items():
        try:
            doc[name] = fn()
        except Exception as exc:  # noqa: BLE001
            doc[name] = {"error": short_error(exc)}
        print(name, json.dumps(doc[name], indent=1), flush=True)
        if results is not None:
            write_json(results, doc)


# -- BENCHMARKS.md -----------------------------------------------------------------------------------
def page_blocks(text: str) -> list[list[str]]:
    """``text`` cut before each level-2 heading (outside code fences); the first block is what precedes them."""
    blocks: list[list[str]] = [[]]
    fenced = False
    for line in text.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
        if line.startswith("## ") and not fenced:
            blocks.append([])
        blocks[-1].append(line)
    return blocks


def put_section(blocks: list[list[str]], lines: list[str], is_heading: Callable[[str], bool],
                missing_at: int | None = None) -> int:
    """Replace the section whose heading ``is_heading`` accepts by ``lines`` (a heading, its text, a
    blank line); with none, insert it at block ``missing_at`` (None: at the end, after one blank
    line). Returns its index."""
    at = next((i for i, b in enumerate(blocks) if i and is_heading(b[0])), None)
    if at is None:
        if missing_at is None:
            while len(blocks[-1]) > 1 and not blocks[-1][-1].strip():
                blocks[-1].pop()
            blocks[-1].append("")
            missing_at = len(blocks)
        blocks.insert(missing_at, [])
        at = missing_at
    blocks[at] = lines
    return at


def write_page(blocks: list[list[str]], target: Path = BENCHMARKS) -> Path:
    target.write_text("\n".join(line for b in blocks for line in b))
    return target
