"""The multi-host entry point: the same worker under real torchrun (env:// rendezvous)."""
from tests.helpers.spawn import TINY, run_reference, run_torchrun


def test_worker_under_torchrun_matches_reference(tmp_path):
    steps = 6
    sets = [*TINY, "parallel.dp=2", "parallel.pp=2", f"train.steps={steps}", "train.num_micro_batches=4",
            "train.deterministic=true"]
    res = run_torchrun(["--standalone", "--nproc-per-node=4"], sets, tmp_path / "torchrun.jsonl", timeout_s=240)
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    ref = run_reference(tmp_path, steps, deterministic=True)
    assert res.losses == ref.losses
    assert res.summary["params_sha256"] == ref.summary["params_sha256"]
