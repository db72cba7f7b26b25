"""Real ranks joining a running job: a replacement after a SIGKILL, extra capacity, and ranks from
another shell with and without the job's token. Every run equals the failure-free reference bit
for bit (deterministic mode)."""
import pytest

from elaswave.runtime.join import whole_devices
from tests.helpers.memory import limit_between
from tests.helpers.spawn import Running, assert_same_run, job_args, reference_fixture, run_job, slowed

# Long enough for a joiner's start-up: forked by the launcher's fork server it is in within a second
# or so (a new Python process importing torch took seconds on 2 cores; the steps were 200).
STEPS = 100
MBS = 6
EXTRA = [f"train.num_micro_batches={MBS}", "parallel.timeout_s=60"]


reference = reference_fixture(STEPS, MBS)


def _assert_same_run(res, reference):
    assert_same_run(res, reference, STEPS)


def _events(res, kind):
    return [r for r in res.records if r["event"] == kind]


def test_a_warm_spare_fills_a_death_at_the_next_step_boundary(tmp_path, reference):
    # The spare started with the job and stands by, started up; promoted when rank 3 dies, it is
    # in within a few steps (a cold replacement spends seconds -- tens of these steps -- starting),
    # and a new spare stands by in its place.
    res = run_job(tmp_path, 2, 2, STEPS, True, extra=[*EXTRA, "elastic.inject=kill:rank=3,step=5", "elastic.spares=1"])
    _assert_same_run(res, reference)
    (rec,) = _events(res, "recovery")
    (join,) = _events(res, "join")
    assert rec["lost_ranks"] == [3] and join["joined_ranks"] == [4], (rec, join)
    assert "spare rank 4 replaces rank 3" in res.stderr
    assert join["resume_step"] - rec["resume_step"] <= 10, (rec["resume_step"], join["resume_step"])
    assert join["spares_standing"] == 1 and rec["spares_standing"] == 1
    assert res.summary["ranks"] == [0, 1, 2, 4]
    assert res.left_behind == 0  # the spare that was never needed went with the job


def test_a_replacement_joins_and_the_job_is_back_to_full_size(tmp_path, reference):
    res = run_job(tmp_path, 2, 2, STEPS, True, extra=[*EXTRA, "elastic.inject=kill:rank=3,step=5"],
                  cli=["--respawn-after", "0.2"])
    _assert_same_run(res, reference)
    (rec,) = _events(res, "recovery")
    (join,) = _events(res, "join")
    assert rec["lost_ranks"] == [3] and join["joined_ranks"] == [4] and join["epoch"] == rec["epoch"] + 1
    assert join["plan"]["pipelines"] == [[0, 1], [2, 4]]
    assert join["plan"]["layer_ranges"][0] == join["plan"]["layer_ranges"][1]  # the whole layout again
    assert set(join["phases_s"]) == {"start_up", "admission", "boundary", "agree", "communicator", "plan",
                                     "state", "first_step"}
    assert 0 < join["since_request_s"] < join["time_to_first_step_s"] < 120
    assert all(r["world_size"] == 4 for r in res.steps if r["step"] >= join["resume_step"])
    assert res.summary["ranks"] == [0, 1, 2, 4]
    # The joiner holds the share of the optimizer state that the rank it replaced held, received
    # from its peers: the same as the same stage's rank in the other pipeline (the last stages also
    # hold the tied embedding's chunks, so the stages' shares differ).
    state = dict(zip(res.summary["ranks"], res.summary["optimizer_state_bytes_per_rank"]))
    assert state[4] == state[1] and state[2] == state[0]


def test_a_joiner_that_hangs_after_it_asked_is_waited_for_once_not_at_every_step(tmp_path, reference):
    # Rank 4, started by the launcher at step 2, stops (SIGSTOP: its agent sees no exit to report)
    # just after it asked in. The leader admits it, the members wait parallel.timeout_s for it
    # once, then it is recorded gone and refused. Before, it was admitted again at every step,
    # and every step waited the timeout for it (a store-move run hung so under load).
    res = run_job(tmp_path, 2, 2, STEPS, True, extra=[f"train.num_micro_batches={MBS}", "parallel.timeout_s=10",
                                                      "elastic.inject=join:step=2;stop:rank=4,step=0,phase=admission"])
    _assert_same_run(res, reference)
    changes = [r for r in res.records if r["event"] in ("recovery", "join", "rebalance")]
    assert len(changes) == 1, changes
    assert changes[0]["evidence"] == {"4": f"was admitted into epoch {changes[0]['epoch']} and did not check in "
                                           "within 10 s"}, changes[0]
    assert "rank 4 was admitted into epoch" in res.stderr and "it is not admitted again" in res.stderr, res.stderr
    assert res.summary["ranks"] == [0, 1, 2, 3]
    assert res.left_behind == 0  # the stopped joiner went with the job


@pytest.mark.slow  # the default run keeps a faster case of the same path; `pytest -m slow` runs it
def test_extra_ranks_join_as_a_new_pipeline(tmp_path, reference):
    res = run_job(tmp_path, 2, 2, STEPS, True, extra=[*EXTRA, "elastic.inject=join:step=2,count=2"])
    _assert_same_run(res, reference)
    joins = _events(res, "join")
    assert sorted(r for j in joins for r in j["joined_ranks"]) == [4, 5]
    assert joins[-1]["plan"]["pipelines"][:2] == [[0, 1], [2, 3]] and len(joins[-1]["plan"]["pipelines"]) == 3
    assert res.summary["ranks"] == [0, 1, 2, 3, 4, 5]
    assert not _events(res, "recovery")


def test_only_a_rank_with_the_jobs_token_is_admitted(tmp_path, reference):
    secret = {"ELASWAVE_TOKEN": "the-job-secret"}
    # Every rank's compute three times as slow (a sleep, so it scales with the machine's load as the
    # friend's start-up does): under load the friend, two new processes importing torch, was once
    # still starting when the job's 100 steps ended. Equal speeds: nothing is re-planned for it.
    with Running(job_args(2, 2, STEPS, True, [*EXTRA, f"elastic.inject={slowed(4)}"]), tmp_path / "run.jsonl", env=secret) as job:
        store = job.wait_for(r"store at (\S+);", 60).group(1)
        # Both ask at once, as soon as the job is up: the friend's way in does not wait behind the
        # stranger's start-up, so it asks early in the run whatever the machine's load.
        with Running(["join", "--store", store], tmp_path / "joiner.jsonl", env=secret) as friend, \
                Running(["join", "--store", store], tmp_path / "stranger.jsonl", env={"ELASWAVE_TOKEN": "a-guess"}) as stranger:
            friend_rank = int(friend.wait_for(r"as rank (\d+)", 120).group(1))
            # Without the token the stranger cannot open the job's record: it stops before it asks.
            refused = stranger.finish(120)
            res = job.finish(240)
            # Each waits on the job's events (a verdict, the job's end), not on fixed margins.
            friend.finish(60)
    assert refused.returncode == 2
    assert "ELASWAVE_TOKEN differs from the job's" in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    assert "as rank" not in refused.stdout
    _assert_same_run(res, reference)
    assert res.summary["ranks"] == [0, 1, 2, 3, friend_rank]


@pytest.mark.slow  # the default run keeps a faster case of the same path; `pytest -m slow` runs it
def test_survivors_that_cannot_hold_the_model_stand_by_until_a_replacement_joins(tmp_path, reference):
    # A limit between what a stage of two needs and what the whole model on one rank needs: rank 0
    # cannot take pipeline 0 alone. (With detours on, the planner may send its micro-batches through
    # rank 3 instead; that is tested elsewhere.)
    limit = limit_between(EXTRA, 2, deterministic=True)
    res = run_job(tmp_path, 2, 2, STEPS, True, extra=[*EXTRA, f"parallel.stage_memory_mb={limit}", "elastic.detours=false",
                                                      "elastic.inject=kill:rank=1,step=5"],
                  cli=["--respawn-after", "0.2"])
    _assert_same_run(res, reference)
    (rec,) = _events(res, "recovery")
    assert rec["plan"]["micro_batches"] == [0, MBS] and rec["plan"]["layer_ranges"][0] == [[0, 3]]
    assert f"ranks [0] cannot hold the whole model within parallel.stage_memory_mb={limit}" in res.stderr
    (join,) = _events(res, "join")
    assert join["plan"]["pipelines"] == [[0, 4], [2, 3]] and all(join["plan"]["micro_batches"])


def test_joiners_make_devices_of_one_host_each():
    hosts = {8: "node 0", 9: "node 1", 10: "node 0", 11: "node 1", 12: "node 1"}
    # Each host's joiners pair among themselves; node 1's third waits for a partner.
    assert whole_devices([8, 9, 10, 11, 12], hosts, 2) == [8, 10, 9, 11]
    assert whole_devices([8, 9], hosts, 2) == []
