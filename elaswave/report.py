"""``elaswave report RUN.jsonl [--against REF.jsonl]``: what happened in a run, as pictures and a page.

Reads the metrics a run wrote (``job``, ``step``, ``eval``, ``recovery``, ``join``, ``resume``, ``summary`` records) and,
optionally, a failure-free reference (``elaswave reference`` or a run without faults), and writes:

- ``loss.png``: loss per step and the held-out (eval) loss, failures marked where training resumed,
  the reference overlaid;
- ``throughput.png``: tokens per second over wall time;
- ``recoveries.png``: each recovery's time, split into its phases;
- ``membership.png``: live ranks and epoch per step;
- ``report.md``: the job, the recoveries and whether the run equals the reference bit for bit.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from elaswave.errors import ConfigError
from elaswave.runtime.metrics import read_jsonl

PHASES = ("detect", "agree", "communicator", "plan", "state", "first_step")


def _load(path: str) -> list[dict]:
    if not os.path.isfile(path):
        raise ConfigError(f"{path} is invalid: no such metrics file (write one with elaswave run --metrics-out)")
    try:
        records = read_jsonl(path)
    except ValueError as exc:
        raise ConfigError(f"{path} is invalid: not JSON lines ({exc})") from None
    if not any(r.get("event") == "step" for r in records):
        raise ConfigError(f"{path} is invalid: it has no step records")
    return records


def _events(records: list[dict], kind: str) -> list[dict]:
    return [r for r in records if r.get("event") == kind]


def _nan(loss: float | None) -> float:
    """A step without a trained token (loss None) as a gap in a curve."""
    return math.nan if loss is None else loss


def compare(run: list[dict], ref: list[dict]) -> dict:
    """Step by step against the reference: the largest |loss difference| over the steps both have,
    and whether every loss, every eval loss and the final parameters' hash are equal."""
    mine = {r["step"]: r["loss"] for r in _events(run, "step")}
    theirs = {r["step"]: r["loss"] for r in _events(ref, "step")}
    common = sorted(set(mine) & set(theirs))
    diffs = [abs(mine[s] - theirs[s]) for s in common if mine[s] is not None and theirs[s] is not None]
    # Held-out losses where both evaluated (a run with eval_every against one without is still compared).
    evals = [{r["step"]: r["eval_loss"] for r in _events(x, "eval")} for x in (run, ref)]
    both = set(evals[0]) & set(evals[1])
    same_evals = all(evals[0][s] == evals[1][s] for s in both)
    sha = [(_events(x, "summary") or [{}])[-1].get("params_sha256") for x in (run, ref)]
    same_losses = bool(common) and all(mine[s] == theirs[s] for s in common) and set(mine) == set(theirs)
    return {"steps_compared": len(common), "max_abs_dloss": max(diffs) if diffs else math.nan,
            "evals_compared": len(both), "same_evals": same_evals,
            "same_params": sha[0] is not None and sha[0] == sha[1],
            "bit_identical": same_losses and same_evals and sha[0] is not None and sha[0] == sha[1]}


def render(run_path: str, ref_path: str | None, out_dir: str) -> list[Path]:
    run = _load(run_path)
    ref = _load(ref_path) if ref_path else None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("elaswave report needs matplotlib (pip install matplotlib)") from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    steps = _events(run, "step")
    recoveries = _events(run, "recovery")
    written = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)

    fig, ax = plt.subplots(figsize=(8, 4))
    if ref is not None:
        ax.plot([r["step"] for r in _events(ref, "step")], [_nan(r["loss"]) for r in _events(ref, "step")],
                color="0.6", linewidth=3, label="failure-free reference")
    ax.plot([r["step"] for r in steps], [_nan(r["loss"]) for r in steps], color="tab:blue", linewidth=1.3, label="this run")
    if ref is not None and _events(ref, "eval"):
        ax.plot(*_eval_curve(ref), color="0.6", linewidth=3, marker="s", label="reference, held-out")
    if _events(run, "eval"):  # the state after `step` steps, drawn where step `step` begins
        ax.plot(*_eval_curve(run), color="tab:orange", linewidth=1.3, marker="o", label="this run, held-out (eval)")
    for rec in recoveries:
        ax.axvline(rec["resume_step"], color="tab:red", linestyle="--", linewidth=1)
        ax.annotate(f"lost {rec['lost_ranks']}", (rec["resume_step"], ax.get_ylim()[1]), fontsize=8,
                    color="tab:red", rotation=90, va="top", ha="right")
    for r in _events(run, "join"):
        ax.axvline(r["resume_step"], color="tab:green", linestyle="--", linewidth=1)
        ax.annotate(f"joined {r['joined_ranks']}", (r["resume_step"], ax.get_ylim()[1]), fontsize=8,
                    color="tab:green", rotation=90, va="top", ha="right")
    ax.set(xlabel="step", ylabel="loss", title="Loss")
    ax.legend(fontsize=8)
    save(fig, "loss.png")

    fig, ax = plt.subplots(figsize=(8, 4))
    t0 = steps[0]["wall_time"] if "wall_time" in steps[0] else 0.0
    ax.plot([r.get("wall_time", 0.0) - t0 for r in steps], [r.get("tokens_per_s", 0.0) for r in steps],
            marker=".", color="tab:blue")
    for rec in recoveries + _events(run, "join"):
        at = next((r.get("wall_time", 0.0) - t0 for r in steps if r["step"] == rec["resume_step"]), None)
        if at is not None:
            ax.axvline(at, color="tab:red" if rec["event"] == "recovery" else "tab:green", linestyle="--", linewidth=1)
    ax.set(xlabel="wall time (s)", ylabel="tokens / s", title="Throughput")
    ax.set_ylim(bottom=0)
    save(fig, "throughput.png")

    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.6 * max(1, len(recoveries))))
    for i, rec in enumerate(recoveries):
        left = 0.0
        for j, phase in enumerate(PHASES):
            width = rec["phases_s"].get(phase, 0.0)
            ax.barh(i, width, left=left, color=f"C{j}", label=phase if i == 0 else None)
            left += width
    ax.set_yticks(range(len(recoveries)), [f"epoch {r['epoch']}: lost {r['lost_ranks']}" for r in recoveries])
    ax.set(xlabel="seconds from the fault", title="Recoveries (MTTR by phase)")
    if recoveries:
        ax.legend(fontsize=7, ncol=3)
    save(fig, "recoveries.png")

    fig, ax = plt.subplots(figsize=(8, 3))
    ax.step([r["step"] for r in steps], [r["world_size"] for r in steps], where="post", label="live ranks")
    ax.step([r["step"] for r in steps], [r["epoch"] for r in steps], where="post", label="epoch", linestyle="--")
    ax.set(xlabel="step", title="Membership")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    save(fig, "membership.png")

    (out / "report.md").write_text(_page(run, ref, run_path, ref_path))
    written.append(out / "report.md")
    return written


def _eval_curve(records: list[dict]) -> tuple[list[int], list[float]]:
    evals = sorted(_events(records, "eval"), key=lambda r: r["step"])
    return [r["step"] for r in evals], [r["eval_loss"] for r in evals]


def _page(run: list[dict], ref: list[dict] | None, run_path: str, ref_path: str | None) -> str:
    job = (_events(run, "job") or [{}])[0].get("config", {})
    par, train = job.get("parallel", {}), job.get("train", {})
    steps, recoveries = _events(run, "step"), _events(run, "recovery")
    summary = (_events(run, "summary") or [{}])[-1]
    lines = [f"# Run report: {run_path}", ""]
    if par:
        lines.append(f"dp={par.get('dp')} x pp={par.get('pp')}, {train.get('num_micro_batches')} micro-batches of "
                     f"{train.get('micro_batch_size')} per step, {'deterministic' if train.get('deterministic') else 'fast'} "
                     f"mode, policy {job.get('elastic', {}).get('policy')}.")
    final = "n/a" if steps[-1]["loss"] is None else f"{steps[-1]['loss']:.4f}"
    lines += [f"Steps {len(steps)}; final loss {final}; final world {steps[-1]['world_size']} ranks"
              + (f"; params_sha256 {summary['params_sha256'][:16]}..." if "params_sha256" in summary else "") + ".", ""]
    if recoveries:
        lines += ["| epoch | lost ranks | resumed at step | MTTR s | " + " | ".join(PHASES) + " |",
                  "| --- | --- | --- | --- | " + " | ".join("---" for _ in PHASES) + " |"]
        for r in recoveries:
            lines.append(f"| {r['epoch']} | {r['lost_ranks']} | {r['resume_step']} | {r['mttr_s']:.3f} | "
                         + " | ".join(f"{r['phases_s'].get(p, 0.0):.3f}" for p in PHASES) + " |")
        lines.append("")
    joins = _events(run, "join")
    if joins:
        lines += ["| epoch | joined ranks | at step | from process start s | from request s | state s | first step s |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in joins:
            lines.append(f"| {r['epoch']} | {r['joined_ranks']} | {r['resume_step']} | {r['time_to_first_step_s']:.3f} | "
                         f"{r['since_request_s']:.3f} | {r['phases_s']['state']:.3f} | {r['phases_s']['first_step']:.3f} |")
        lines.append("")
    evals = sorted(_events(run, "eval"), key=lambda r: r["step"])
    if evals:
        ref_evals = {r["step"]: r["eval_loss"] for r in _events(ref or [], "eval")}
        lines += ["| after steps | held-out loss | tokens | ranks | seconds |" + (" reference |" if ref_evals else ""),
                  "| --- | --- | --- | --- | --- |" + (" --- |" if ref_evals else "")]
        for r in evals:
            lines.append(f"| {r['step']} | {_nan(r['eval_loss']):.4f} | {r.get('eval_tokens', '')} | {r['world_size']} | "
                         f"{r.get('eval_s', 0.0):.3f} |"
                         + (f" {_nan(ref_evals[r['step']]):.4f} |" if r["step"] in ref_evals else (" - |" if ref_evals else "")))
        lines.append("")
    for r in _events(run, "resume"):
        lines.append(f"Resumed from the disk checkpoint {r['checkpoint']} at step {r['step']}.")
    if ref is not None:
        c = compare(run, ref)
        verdict = "**bit-identical** to" if c["bit_identical"] else "**not** bit-identical to"
        lines += ["", f"Against {ref_path}: {verdict} the reference over {c['steps_compared']} steps "
                      f"(max |loss difference| {c['max_abs_dloss']:.3g}; "
                      + (f"held-out losses {'equal' if c['same_evals'] else 'differ'} at {c['evals_compared']} "
                         f"evaluations; " if c["evals_compared"] else "")
                      + f"final parameters {'equal' if c['same_params'] else 'differ'})."]
    lines += ["", "![loss](loss.png)", "![throughput](throughput.png)", "![recoveries](recoveries.png)",
              "![membership](membership.png)", ""]
    return "\n".join(lines)
