"""``elaswave bench``: bad input is one line; with TorchFT installed (the [bench] extra), a short
side-by-side run of the real peer (slow: benchmarks stay out of the default run)."""
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.parametrize("argv, needle", [(["bench", "speed"], "invalid choice: 'speed'"),
                                          (["bench", "mttr", "--runs", "0"], "--runs 0 is invalid")])
def test_bad_bench_input_is_one_line(argv, needle):
    proc = subprocess.run([sys.executable, "-m", "elaswave.cli", *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_torchft_replicas_lose_one_and_go_on_with_a_smaller_batch(monkeypatch):
    pytest.importorskip("torchft")
    sys.path.insert(0, str(BENCH))
    import peers

    monkeypatch.setattr(peers, "JOB", [*peers.JOB[:-2], "train.steps=16", "model.dropout=0"])
    free = peers.torchft_run(kill=False, timeout_s=200)
    hit = peers.torchft_run(kill=True, heartbeat_ms=1000, timeout_s=200)
    assert free["participants"] == [3] * 16
    assert hit["participants"][:peers.KILL_STEP] == [3] * peers.KILL_STEP
    assert set(hit["participants"][peers.KILL_STEP:]) == {2}  # the global batch shrank
    assert hit["losses"][:peers.KILL_STEP] == pytest.approx(free["losses"][:peers.KILL_STEP])
    assert 0 < hit["mttr_s"] < 30
