"""TensorBoard scalars, when asked for, carry what the JSONL metrics say."""
import pytest

from tests.helpers.spawn import run_job

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def test_tensorboard_scalars_are_the_runs_losses_and_its_recovery(tmp_path):
    logdir = tmp_path / "tb"
    res = run_job(tmp_path, 2, 1, 8, False, extra=["elastic.inject=kill:rank=1,step=4"],
                  cli=["--tensorboard", str(logdir)])
    acc = event_accumulator.EventAccumulator(str(logdir))
    acc.Reload()
    losses = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert [s for s, _ in losses] == list(range(8))
    assert [v for _, v in losses] == pytest.approx(res.losses, rel=1e-6)  # stored as float32
    assert [e.value for e in acc.Scalars("train/world_size")][-1] == 1
    recovery = next(r for r in res.records if r["event"] == "recovery")
    (mttr,) = acc.Scalars("elastic/recovery_s")
    assert mttr.step == recovery["resume_step"] and mttr.value == pytest.approx(recovery["mttr_s"], rel=1e-6)


def test_tensorboard_without_metrics_is_one_line(tmp_path):
    """Its scalars come from the metrics writer: without --metrics-out it would write nothing."""
    import subprocess
    import sys
    res = subprocess.run([sys.executable, "-m", "elaswave.cli", "run", "--tensorboard", str(tmp_path / "tb")],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "--metrics-out" in lines[0], res.stderr
