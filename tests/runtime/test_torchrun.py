"""The multi-host entry point: the same worker under real torchrun (env:// rendezvous)."""
import os
import signal
import subprocess
import sys

from elaswave.runtime.metrics import read_jsonl
from tests.helpers.spawn import TINY, run_reference


def test_worker_under_torchrun_matches_reference(tmp_path):
    steps = 6
    metrics = tmp_path / "torchrun.jsonl"
    sets = [*TINY, "parallel.dp=2", "parallel.pp=2", f"train.steps={steps}", "train.num_micro_batches=4",
            "train.deterministic=true"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           "-m", "elaswave.runtime.worker", "--metrics-out", str(metrics)] + [x for s in sets for x in ("--set", s)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"{out}\n{err}"
    records = read_jsonl(str(metrics))
    ref = run_reference(tmp_path, steps, deterministic=True)
    assert [r["loss"] for r in records if r["event"] == "step"] == ref.losses
    assert records[-1]["params_sha256"] == ref.summary["params_sha256"]
