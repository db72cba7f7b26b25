"""Two seeds of the chaos schedule (``pytest -m slow``; ``bench/faults/chaos.py`` runs twenty): kills, a
kill during a recovery, a double kill, a hang and joins in one 100-step run of six ranks, which
must end equal to the failure-free run, with every step written once and no process left behind;
and signals at seeded instants, one seed of which is in the default run."""
import pytest

from elaswave.control.chaos import schedule
from tests.helpers.spawn import assert_same_run, run_job, run_reference

STEPS, DP, PP, MBS = 100, 3, 2, 6
EXTRA = [f"train.num_micro_batches={MBS}", "parallel.timeout_s=60", "elastic.heartbeat_timeout_s=1.0",
         "elastic.heartbeat_interval_s=0.1", "checkpoint.every_steps=10"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_reference(tmp_path_factory.mktemp("ref"), STEPS, deterministic=True, num_micro_batches=MBS)


# Seed 0: two ranks join, a kill during a recovery, a double kill. Seed 5: a kill during a
# recovery, a SIGSTOP hang, a join.
# Seed 0 is 15-24 s of the default run, so both are behind the slow marker (pytest -m slow); the
# default run keeps the any-instant case below, which kills, stops and joins with the same checks.
@pytest.mark.parametrize("seed", [pytest.param(0, marks=pytest.mark.slow),
                                  pytest.param(5, marks=pytest.mark.slow)])  # more: bench/faults/chaos.py
def test_a_chaos_run_ends_equal_to_the_failure_free_run(tmp_path, reference, seed):
    faults = schedule(seed, DP * PP, STEPS)
    res = run_job(tmp_path, DP, PP, STEPS, True,
                  extra=[*EXTRA, f"checkpoint.dir={tmp_path / 'ckpt'}", "elastic.inject=" + ";".join(faults)])
    assert_same_run(res, reference, STEPS)
    assert res.left_behind == 0
    killed = {int(f.split("rank=")[1].split(",")[0]) for f in faults if not f.startswith("join")}
    assert killed.isdisjoint(res.summary["ranks"])


ANY_STEPS = 40


@pytest.fixture(scope="module")
def any_reference(tmp_path_factory):
    return run_reference(tmp_path_factory.mktemp("ref"), ANY_STEPS, deterministic=True, num_micro_batches=MBS)


@pytest.mark.parametrize("seed", [1, pytest.param(3, marks=pytest.mark.slow)])  # bench/faults/chaos.py --any-instant runs fifty and more
def test_signals_at_any_instant_end_equal_or_fall_back_loudly(tmp_path, any_reference, seed):
    """A thread outside the job SIGKILLs or SIGSTOPs workers at seeded instants (mid-collective,
    mid-snapshot, mid-recovery, mid-join: wherever they are); replacements join. The run must
    end bit-identical to the reference, directly or after a loud return to a disk checkpoint."""
    from tests.helpers.spawn import job_args
    from tests.helpers.striker import strike_run

    args = job_args(DP, PP, ANY_STEPS, True, [*EXTRA, f"checkpoint.dir={tmp_path / 'ckpt'}"]) + ["--respawn-after", "0"]
    out = strike_run(seed, args, tmp_path / "run.jsonl", any_reference, ANY_STEPS)
    assert out.verdict in ("equal", "fallback_equal"), out
    assert out.fired, out  # the strikes happened
    assert out.left_behind == 0
