"""``elaswave bench``: bad input is one line; a peer's failed run is counted and the results are still
written (no TorchFT needed: the runs are stand-ins); with TorchFT installed (the [bench] extra), a
short side-by-side run of the real peer (slow: benchmarks stay out of the default run)."""
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = "RuntimeError: a TorchFT replica failed: TimeoutError: [/torchft/manager.py] Timeout expired"


@pytest.mark.parametrize("argv, needle", [(["bench", "speed"], "invalid choice: 'speed'"),
                                          (["bench", "mttr", "--runs", "0"], "--runs 0 is invalid")])
def test_bad_bench_input_is_one_line(argv, needle):
    proc = subprocess.run([sys.executable, "-m", "elaswave.cli", *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr


@pytest.fixture
def peers(monkeypatch, tmp_path):
    """bench/peers/peers.py writing into ``tmp_path``, as if TorchFT were installed."""
    monkeypatch.syspath_prepend(str(ROOT))
    from bench.peers import peers

    monkeypatch.setattr(peers, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(peers, "BENCHMARKS", tmp_path / "BENCHMARKS.md")
    monkeypatch.setattr(peers, "torchft_installed", lambda: True)
    return peers


def _timed_out(*args, **kwargs):
    raise RuntimeError(TIMEOUT[len("RuntimeError: "):] + "\nTraceback (most recent call last): ...")


def _written(peers, tmp_path, claim: str) -> tuple[dict, str, str]:
    assert peers.main([claim, "--runs", "2"]) == 0
    res = json.loads((tmp_path / "results" / f"peers_{claim}.json").read_text())["result"]
    return res, (tmp_path / "results" / f"peers_{claim}.md").read_text(), (tmp_path / "BENCHMARKS.md").read_text()


def test_a_failed_mttr_run_is_counted_and_the_results_are_written(peers, tmp_path, monkeypatch):
    calls = []

    def torchft(kill, heartbeat_ms=None, **kwargs):
        calls.append(heartbeat_ms)
        if heartbeat_ms is None and len(calls) == 1:  # the default heartbeat's first run: its quorum timed out
            _timed_out()
        return {"mttr_s": 1.0 if heartbeat_ms else 5.0}

    monkeypatch.setattr(peers, "run_job", lambda sets: [{"event": "recovery", "mttr_s": 0.1}])
    monkeypatch.setattr(peers, "restart_run", lambda *args: {"mttr_s": 3.0})
    monkeypatch.setattr(peers, "torchft_run", torchft)
    res, md, page = _written(peers, tmp_path, "mttr")
    assert res["num_failed"] == {"elaswave": 0, "torchrun_restart": 0, "torchft_default": 1, "torchft_1s": 0}
    assert res["failed"]["torchft_default"] == [{"run": "run 0", "error": TIMEOUT}]
    assert res["runs"]["torchft_default"] == [5.0] and res["median_s"]["torchft_default"] == 5.0  # left out
    assert res["over_elaswave"]["torchft_1s"] == pytest.approx(10.0)
    row = next(line for line in md.splitlines() if line.startswith("| TorchFT, default"))
    assert row.endswith("| 1 |") and "failed runs" in md.splitlines()[0]
    assert f"TorchFT, default lighthouse heartbeat timeout, run 0: `{TIMEOUT}`" in md
    assert "## Time to recover from a SIGKILL (MTTR)" in page and TIMEOUT in page


def test_every_failed_overhead_run_leaves_that_system_without_a_figure(peers, tmp_path, monkeypatch):
    steps = [{"event": "step", "step_time_s": 0.07}] * 30
    monkeypatch.setattr(peers, "run_job", lambda sets: steps)
    monkeypatch.setattr(peers, "torchft_run", _timed_out)
    monkeypatch.setattr(peers, "plain_ddp_step_s", lambda: 0.06)
    res, md, page = _written(peers, tmp_path, "overhead")
    assert res["num_failed"] == {"elaswave_on": 0, "elaswave_off": 0, "torchft": 2, "plain_ddp": 0}
    assert res["median_ratio"] == {"elaswave": 1.0, "torchft": None} and res["pair_ratios"]["torchft"] == []
    assert "| TorchFT / plain DDP | -x | - | 0.0600 | 2 |" in md and "Failed runs (counted; not in the medians): 2" in md
    assert "## Steady-state cost of fault tolerance when nothing fails" in page


def test_a_peer_whose_failure_free_run_fails_is_reported_not_compared(peers, tmp_path, monkeypatch):
    steps = 30
    cfg = SimpleNamespace(train=SimpleNamespace(steps=steps, eval_batches=4, num_micro_batches=12, micro_batch_size=4))

    def corpus(out: Path) -> Path:
        out.mkdir(parents=True)
        (out / "manifest.json").write_text(json.dumps({"inputs": ["json"], "eval_fraction": 0.1, "splits": {
            "train": {"tokens": 1000}, "eval": {"tokens": 100}}}))
        return out

    def elaswave(sets, scorer):
        killed = peers.KILL in sets
        return {"heldout": [2.0 + (0.01 if killed and s >= peers.KILL_STEP else 0) for s in range(steps)],
                "losses": [2.5] * steps, "builtin_eval": [2.0] * steps, "builtin_eval_tokens": [12288] * steps,
                "resume_step": peers.KILL_STEP if killed else None}

    monkeypatch.setattr(peers, "prepare_corpus", corpus)
    monkeypatch.setattr(peers, "_config", lambda sets: cfg)
    monkeypatch.setattr(peers, "Scorer", lambda c: SimpleNamespace(cfg=c, tokens=12288))
    monkeypatch.setattr(peers, "elaswave_heldout_run", elaswave)
    monkeypatch.setattr(peers, "torchft_run", _timed_out)
    res, md, page = _written(peers, tmp_path, "deviation")
    assert res["num_failed"] == {"elaswave": 0, "drop_replica": 0, "torchft": 3}  # its baseline, and 2 not run
    assert res["failed"]["torchft"][0]["error"] == f"RuntimeError: failed 3 times; the last: {TIMEOUT}"
    assert len(res["failures"]) == 3 and res["median"]["torchft"] is None
    assert res["median"]["elaswave"]["heldout_max"] == pytest.approx(0.01)
    assert res["sanity"]["elaswave_vs_torchft_failure_free_heldout_max_abs"] is None
    assert "| TorchFT, heartbeat timeout 1 s | - | - | - / - | - | 3 |" in md and "not run: no failure-free run" in md
    assert "## Parameters after the failure" in page


@pytest.mark.slow
def test_torchft_replicas_lose_one_and_go_on_with_a_smaller_batch(monkeypatch):
    pytest.importorskip("torchft")
    monkeypatch.syspath_prepend(str(ROOT))
    from bench.peers import torchft_job as peers

    monkeypatch.setattr(peers, "JOB", [*peers.JOB[:-2], "train.steps=16", "model.dropout=0"])
    free = peers.torchft_run(kill=False, timeout_s=200)
    hit = peers.torchft_run(kill=True, heartbeat_ms=1000, timeout_s=200)
    assert free["participants"] == [3] * 16
    assert hit["participants"][:peers.KILL_STEP] == [3] * peers.KILL_STEP
    assert set(hit["participants"][peers.KILL_STEP:]) == {2}  # the global batch shrank
    assert hit["losses"][:peers.KILL_STEP] == pytest.approx(free["losses"][:peers.KILL_STEP])
    assert 0 < hit["mttr_s"] < 30
