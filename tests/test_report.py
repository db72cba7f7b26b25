"""``elaswave report``: a real run with a failure, against the reference, as pictures and a page."""
import re
import subprocess
import sys

import pytest

from tests.helpers.spawn import run_job, run_reference

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # the default run keeps a faster case of the same path; `pytest -m slow` runs it
def test_report_of_a_run_with_a_failure_against_the_reference(tmp_path):
    run = run_job(tmp_path, 2, 1, 8, True, extra=["elastic.inject=kill:rank=1,step=4,phase=backward"])
    ref = run_reference(tmp_path, 8, deterministic=True)
    run_file, ref_file = sorted(tmp_path.glob("metrics-*.jsonl"))
    assert [r["event"] for r in run.records][0] == "job" and ref.records
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "elaswave.cli", "report", str(run_file), "--against", str(ref_file),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in ("loss.png", "throughput.png", "recoveries.png", "membership.png"):
        assert (out / name).read_bytes()[:8] == PNG
    page = (out / "report.md").read_text()
    assert "**bit-identical** to the reference over 8 steps" in page
    assert "| 1 | [1] |" in page  # the recovery: epoch 1 lost rank 1


def test_report_of_a_missing_or_empty_file_is_one_line(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for path, needle in ((tmp_path / "none.jsonl", "no such metrics file"), (empty, "has no step records")):
        proc = subprocess.run([sys.executable, "-m", "elaswave.cli", "report", str(path)], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr


def test_demo_says_plainly_that_the_run_with_kills_and_replacements_equals_the_reference(tmp_path):
    from tests.helpers.spawn import TINY

    sets = [x for s in [*TINY, "train.steps=9"] for x in ("--set", s)]
    proc = subprocess.run([sys.executable, "-m", "elaswave.cli", "demo", "--out", str(tmp_path / "demo"), *sets],
                          capture_output=True, text=True, timeout=240, start_new_session=True)
    assert proc.returncode == 0, proc.stderr
    # Whether a replacement makes it in before the ninth step depends on this box's start-up time.
    # (Exactly one of the two forms: a list of joined ranks, or "no rank before the end".)
    assert re.search(r"The run that lost rank 3 \(step 1\) and rank 1 \(step 6\), and took in "
                     r"(rank \d+ \(step \d+\)(, rank \d+ \(step \d+\))*|no rank before the end)"
                     r" is bit-identical to the failure-free run: all 9 losses", proc.stdout), proc.stdout
    assert (tmp_path / "demo" / "report" / "loss.png").read_bytes()[:8] == PNG


def test_a_report_takes_losses_that_are_none(tmp_path):
    """A step or evaluation without a target to count records loss None (not 0.0): the report
    draws it as a gap and writes n/a-free tables, against a reference with the same gaps."""
    import json

    from elaswave.report import compare, render
    records = [{"event": "job", "config": {"parallel": {"dp": 1, "pp": 1}, "train": {}, "elastic": {}}},
               *({"event": "step", "step": s, "loss": None if s == 1 else 1.0, "world_size": 1, "epoch": 0,
                  "wall_time": float(s), "step_time_s": 0.1} for s in range(3)),
               {"event": "eval", "step": 3, "eval_loss": None, "eval_tokens": 0, "world_size": 1, "eval_s": 0.1},
               {"event": "summary", "steps": 3, "final_loss": 1.0, "params_sha256": "ab" * 32}]
    run = tmp_path / "run.jsonl"
    run.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert compare(records, records)["bit_identical"]
    written = render(str(run), str(run), str(tmp_path / "out"))
    assert any(p.name == "report.md" for p in written)
