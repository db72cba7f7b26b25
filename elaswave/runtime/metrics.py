"""Structured metrics (JSON lines), the live progress line, TensorBoard scalars, and the step journal.

A step's record is written only once the step is *committed* -- when the next step's exchange
proved every snapshot of its result verified -- so a step redone after a failure is written once;
an evaluation's record (``eval``, of the state after ``step`` steps) is committed with step ``step``.
The writer is the lowest rank of the epoch; a new writer appends to the same file and skips
steps already there.
"""
from __future__ import annotations

import json
import os
import sys
from typing import IO

TENSORBOARD_ENV = "ELASWAVE_TENSORBOARD"
"""A folder: the writer also logs TensorBoard scalars there (``elaswave run --tensorboard DIR``)."""


class _Scalars:
    """The step and change records as TensorBoard scalars (needs the ``tensorboard`` package)."""

    STEP_KEYS = ("loss", "tokens_per_s", "step_time_s", "world_size", "epoch", "grad_norm", "lr")

    def __init__(self, logdir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(logdir)

    def add(self, record: dict) -> None:
        event = record.get("event")
        if event == "step":
            for key in self.STEP_KEYS:
                if record.get(key) is not None:
                    self.tb.add_scalar(f"train/{key}", record[key], record["step"])
        elif event == "eval":
            if record["eval_loss"] is not None:
                self.tb.add_scalar("eval/loss", record["eval_loss"], record["step"])
        elif event in ("recovery", "join", "rebalance"):
            took = record.get("mttr_s", record.get("time_to_first_step_s"))
            if took is not None:
                self.tb.add_scalar(f"elastic/{event}_s", took, record["resume_step"])
        self.tb.flush()

    def close(self) -> None:
        self.tb.close()


def _loss(value: float | None, of: str = "no trained token in the batch") -> str:
    """A loss on the progress line; None: there was no target to count (all masked)."""
    return f"{value:.4f}" if value is not None else f"n/a ({of})"


def _scalars(path: str | None) -> _Scalars | None:
    logdir = os.environ.get(TENSORBOARD_ENV)
    if not (path and logdir):
        return None
    try:
        return _Scalars(logdir)
    except ImportError:
        print(f"elaswave: no TensorBoard scalars in {logdir}: the tensorboard package is not installed "
              "(pip install tensorboard); the JSONL metrics are written as always", file=sys.stderr, flush=True)
        return None


class MetricsWriter:
    def __init__(self, path: str | None, show_progress: bool = True, total_steps: int = 0, append: bool = False):
        self.written: set[tuple[int, str]] = set()
        """(step, event) of the step and eval records in the file: a new writer appends to it."""
        self.continues = bool(path and append and os.path.exists(path))
        """This writer goes on with a file an earlier run (or writer) of the job wrote."""
        if self.continues:
            self.written = {(r["step"], r["event"]) for r in read_jsonl(path) if r.get("event") in _JOURNALED}
        self.fh: IO[str] | None = open(path, "a" if append else "w") if path else None
        self.show_progress = show_progress
        self.last_event = ""
        """The latest recovery or resume, shown on every progress line after it."""
        self.total_steps = total_steps
        self.scalars = _scalars(path)

    def write(self, record: dict) -> None:
        if record.get("event") in _JOURNALED:
            if (record["step"], record["event"]) in self.written:
                return
            self.written.add((record["step"], record["event"]))
        if self.fh is not None:
            self.fh.write(json.dumps(record) + "\n")
            self.fh.flush()
        if self.scalars is not None:
            self.scalars.add(record)
        if record.get("event") == "recovery":
            self.last_event = f"recovered from losing {record['lost_ranks']} at step {record['resume_step']}"
        elif record.get("event") == "resume":
            self.last_event = f"resumed from the checkpoint of step {record['step']}"
        elif record.get("event") == "join":
            self.last_event = f"ranks {record['joined_ranks']} joined at step {record['resume_step']}"
        elif record.get("event") == "rebalance":
            self.last_event = f"re-planned by measured speeds at step {record['resume_step']}"
        if self.show_progress and record.get("event") == "step":
            last = f"  last: {self.last_event}" if self.last_event else ""
            print(f"step {record['step'] + 1:>4}/{self.total_steps}  loss {_loss(record['loss'])}  "
                  f"tok/s {record.get('tokens_per_s', 0):>8.0f}  world {record['world_size']}  "
                  f"epoch {record['epoch']}{last}", flush=True)
        elif self.show_progress and record.get("event") == "eval":
            print(f"eval after {record['step']} steps: loss {_loss(record['eval_loss'], 'no held-out target to score')}  "
                  f"({record['eval_tokens']} held-out tokens, {record['eval_s']:.2f}s)", flush=True)
        elif self.show_progress and record.get("event") == "recovery":
            hosts = record.get("lost_hosts") or {}
            where = f" on {', '.join(hosts)}" if hosts else ""
            print(f"recovered: epoch {record['epoch']}, lost ranks {record['lost_ranks']}{where}, "
                  f"resumed at step {record['resume_step']}, mttr {record['mttr_s']:.3f}s; the job goes on "
                  "(nothing for a scheduler to do)", flush=True)
        elif self.show_progress and record.get("event") in ("join", "rebalance"):
            print(f"{self.last_event}: epoch {record['epoch']}, pipelines {record['plan']['pipelines']}", flush=True)
        elif self.show_progress and record.get("event") == "summary":
            loss = (f"final loss {_loss(record['final_loss'])}" if record["steps"] else
                    "no step trained (train.steps=0: the model as loaded)")
            print(f"done: {record['steps']} steps, {loss}, params_sha256 {record['params_sha256'][:16]}...", flush=True)

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None
        if self.scalars is not None:
            self.scalars.close()
            self.scalars = None


_JOURNALED = ("eval", "step")


def _key(record: dict) -> tuple[int, int]:
    """Records in the order they happened: the evaluation before step s (of the state after s
    steps), then step s."""
    return record["step"], 0 if record["event"] == "eval" else 1


class StepJournal:
    """Holds step and eval records until they are committed; every rank keeps one so any can take
    over writing.

    Committed records stay a few steps more: a writer that dies (or hangs) after a step's exchange
    but before writing the step it committed leaves that record only with the others, and whoever
    writes next replays them (the writer skips steps its file already has)."""

    KEEP = 8

    def __init__(self) -> None:
        self.pending: dict[tuple[int, int], dict] = {}
        self.committed: dict[tuple[int, int], dict] = {}

    def add(self, record: dict) -> None:
        self.pending[_key(record)] = record

    def commit_before(self, step: int, writer: MetricsWriter | None) -> None:
        """Steps below ``step`` are committed: write them (if we write) and keep the last few."""
        for k in sorted(k for k in self.pending if k[0] < step):
            record = self.pending.pop(k)
            if writer is not None:
                writer.write(record)
            self.committed[k] = record
        for k in sorted(self.committed)[:-self.KEEP]:
            del self.committed[k]

    def replay(self, writer: MetricsWriter) -> None:
        """Write the recently committed records a previous writer may not have written."""
        for k in sorted(self.committed):
            writer.write(self.committed[k])

    def unwritten(self) -> list[dict]:
        """The records not committed yet: a change shares them among the members (:meth:`fill`)."""
        return list(self.pending.values())

    def fill(self, records: list[dict]) -> None:
        """Records the other members made and this rank did not: a disruption that reached it after
        a step's update but before its record (in the parameter gather) left that step done on
        every rank and recorded only elsewhere, and the writer lost it."""
        for record in records:
            if _key(record) not in self.pending and _key(record) not in self.committed:
                self.pending[_key(record)] = record

    def discard_from(self, step: int) -> None:
        """Steps from ``step`` on will be redone."""
        for part in (self.pending, self.committed):
            for k in [k for k in part if k[0] >= step]:
                del part[k]


def read_jsonl(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def print_error(message: str) -> None:
    print(f"elaswave: error: {message}", file=sys.stderr, flush=True)
