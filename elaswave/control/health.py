"""The health probe a cluster manager reads: one JSON file per host (``elaswave run --health-file
FILE``), rewritten by the host's agent every :data:`EVERY_S` from what its workers report, and
``elaswave health FILE`` for an exec probe (Kubernetes' ``exec`` liveness probe, a Slurm
``HealthCheckProgram``, a script).

States, for the host: ``starting`` (the agent is up; none of its ranks has ended a step yet),
``training`` (its ranks' last word was a step that ended), ``recovering`` (a rank of this host is in
a change of the job: agreement, re-plan, state transfer, its first step -- the job goes on at the
next step; shown at least once for every change, however short),
``stopped`` (the agent has finished; ``exit_code`` is its exit code, docs/cluster.md's table).
Besides the state: the newest step ended here, when, and each rank's own word. A hang shows as a
``step_wall_time`` that stops moving while the state stays ``training``: ``--max-step-age-s``.

Files are replaced whole (written beside, then renamed): a reader never sees half of one.
"""
from __future__ import annotations

import json
import os
import time

DIR_ENV = "ELASWAVE_HEALTH_DIR"
"""Where an agent's workers write their own word (set by the agent for its workers)."""
EVERY_S = 0.1
STATES = ("starting", "training", "recovering", "stopped")


def _write(path: str, doc: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(doc, fh)
    os.replace(tmp, path)


class RankReport:
    """A worker's word: its state, the step it is at, the epoch (nothing without an agent's DIR_ENV)."""

    def __init__(self, rank: int):
        folder = os.environ.get(DIR_ENV)
        self.path = os.path.join(folder, f"rank-{rank}.json") if folder else None
        self.rank = rank
        self.changes = 0
        """Changes of the job this rank has entered: a change shorter than the agent's reading
        interval is still seen."""

    def __call__(self, state: str, step: int, epoch: int) -> None:
        if self.path is None:
            return
        self.changes += state == "recovering"
        try:
            _write(self.path, {"rank": self.rank, "state": state, "step": step, "epoch": epoch,
                               "changes": self.changes, "wall_time": time.time()})
        except OSError:  # a full or vanished disk must not stop the training the probe watches
            pass


class HostHealth:
    """The agent's side: what its workers said, folded into the host's state in ``path``."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.folder = self.path + ".ranks"
        os.makedirs(self.folder, exist_ok=True)
        for name in os.listdir(self.folder):  # an earlier run's words are not this one's
            os.unlink(os.path.join(self.folder, name))
        self.started = time.time()
        self._last = 0.0
        self._shown = 0  # the most changes a rank had entered when "recovering" was last written
        self.update(force=True)

    @property
    def env(self) -> dict[str, str]:
        return {DIR_ENV: self.folder}

    def _ranks(self) -> list[dict]:
        out = []
        for name in sorted(os.listdir(self.folder)):
            if name.startswith("rank-") and name.endswith(".json"):
                try:
                    with open(os.path.join(self.folder, name)) as fh:
                        out.append(json.load(fh))
                except (OSError, ValueError):  # replaced while read: its next word comes soon
                    continue
        return out

    def update(self, force: bool = False, live: set[int] | None = None) -> None:
        """``live``: the ranks the agent still runs; the words of the others are left out (a rank
        that left mid-change, with its tensor-parallel group, would say "recovering" for ever)."""
        now = time.time()
        if not force and now - self._last < EVERY_S:
            return
        self._last = now
        ranks = [r for r in self._ranks() if live is None or r["rank"] in live]
        trained = [r for r in ranks if r["state"] == "training"]
        changes = max((r.get("changes", 0) for r in ranks), default=0)
        state = ("recovering" if changes > self._shown or any(r["state"] == "recovering" for r in ranks) else
                 "training" if trained else "starting")
        if state == "recovering":
            self._shown = changes
        self._write({"state": state, "step": max((r["step"] for r in trained), default=None),
                     "step_wall_time": max((r["wall_time"] for r in trained), default=None), "changes": changes,
                     "ranks": {str(r["rank"]): r["state"] for r in ranks}})

    def stopped(self, code: int) -> None:
        self._write({"state": "stopped", "exit_code": code, "ranks": {}})

    def _write(self, doc: dict) -> None:
        try:
            _write(self.path, {**doc, "pid": os.getpid(), "started": self.started, "updated": time.time()})
        except OSError:
            pass


def check(path: str, max_age_s: float, max_step_age_s: float | None = None) -> tuple[int, str]:
    """(exit code, one line) for ``elaswave health``: 0 while the host's agent lives and keeps the
    file fresh (starting, training, recovering); 1 when it stopped, went silent for ``max_age_s``,
    or -- with ``max_step_age_s`` -- trains but ended no step for that long (a hang)."""
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except FileNotFoundError:
        return 1, f"no health file at {path}: the agent has not started, or writes another (--health-file)"
    except (OSError, ValueError) as exc:
        return 1, f"{path}: unreadable ({exc})"
    now, state = time.time(), doc.get("state")
    if state == "stopped":
        return 1, f"stopped, exit code {doc.get('exit_code')}"
    age = now - float(doc.get("updated", 0))
    if age > max_age_s:
        return 1, f"{state}, but the agent last wrote {age:.1f} s ago (more than --max-age-s={max_age_s:g}): gone"
    line = f"{state}" + (f", step {doc['step']}" if doc.get("step") is not None else "")
    if max_step_age_s is not None and state == "training" and doc.get("step_wall_time") is not None:
        since = now - float(doc["step_wall_time"])
        if since > max_step_age_s:
            return 1, f"{line}, but no step ended for {since:.1f} s (more than --max-step-age-s={max_step_age_s:g}): hung"
    return 0, line


def add_arguments(ap) -> None:
    """``elaswave health``'s options (an argparse parser)."""
    ap.add_argument("file", metavar="FILE")
    ap.add_argument("--max-age-s", type=float, default=10.0, help="the agent rewrites FILE every 0.1 s: older than "
                                                                  "this (default 10) is a dead agent")
    ap.add_argument("--max-step-age-s", type=float, default=None,
                    help="also unhealthy while training with no step ended for this long (a hang; set it above "
                         "parallel.timeout_s)")


def probe(args) -> int:
    """``elaswave health``: the state in one line; the exit code :func:`check` gives."""
    code, line = check(args.file, args.max_age_s, args.max_step_age_s)
    print(line)
    return code
