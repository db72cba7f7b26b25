"""The process holding the control store SIGKILLed without a failover (``elastic.store_failover``
off; with it on the store moves, tests/control/test_failover.py): every rank notices within the
heartbeat timeout, saves the state of the last step it trained, stops with the reason, and the
same command run again continues with no step lost -- bit-identical to the failure-free run."""
import re

from elaswave.checkpoint import disk
from tests.helpers.spawn import Running, assert_same_run, job_args, reference_fixture, run_cli, sigkill_launcher, \
    wait_gone

STEPS, MBS = 40, 4
reference = reference_fixture(STEPS, MBS)


def test_the_store_holder_sigkilled_every_rank_saves_and_a_rerun_loses_no_step(tmp_path, reference):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "run.jsonl"
    args = job_args(2, 2, STEPS, True, [f"checkpoint.dir={ckpt}", "parallel.timeout_s=20", "elastic.store_failover=false"])
    with Running(args, metrics) as job:
        workers, killed_at, _ = sigkill_launcher(job, 8)  # `elaswave run` hosts the store
        assert not wait_gone(workers, 30), "workers outlived their store by 30 s"
        first = job.finish(10)
    saved = int(re.search(r"the job is at step (\d+)", first.stderr).group(1))
    assert first.stderr.count("saved its part of step") == 3, first.stderr
    trained = [r["step"] for r in first.steps]
    assert trained == list(range(saved)), "the state saved is not the one after the last step trained"
    [lost] = [r for r in first.records if r["event"] == "store_lost"]
    assert lost["noticed_wall"] - killed_at < 2.0 + 1.5  # the heartbeat timeout (2 s), and slack
    assert disk.latest(ckpt).step == saved

    again = run_cli(args, tmp_path, metrics=metrics)  # the same command
    assert again.returncode == 0, again.stderr
    assert f"resuming at step {saved}" in again.stdout
    assert_same_run(again, reference, STEPS)
