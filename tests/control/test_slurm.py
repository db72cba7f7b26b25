"""elaswave under Slurm (issue 56): a real cluster -- slurmctld, three slurmd nodes, each a network
namespace host -- runs the project's own batch script, and a node dies while it trains."""
import json
import sys
import time
from pathlib import Path

import pytest

from elaswave.control import slurm
from elaswave.errors import ConfigError
from tests.helpers import slurm as cluster
from tests.helpers.spawn import TINY, Result, assert_same_run, run_cli, run_reference

SBATCH = Path(__file__).resolve().parents[2] / "examples" / "slurm" / "train.sbatch"
STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NODEID": "1", "SLURM_STEP_NUM_NODES": "3",
        "SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_NODELIST": "n1", "SLURMD_NODENAME": "n2"}


def test_a_slurm_step_names_the_hosts_the_job_id_and_the_stores_node():
    step = slurm.step(STEP)
    assert (step.nnodes, step.node_rank, step.rdzv_id) == (3, 1, "slurm-4242")
    assert step.endpoint == f"n1:{slurm.PORT_BASE + 4242 % slurm.PORT_SPAN}"
    assert slurm.in_step(STEP) and not slurm.in_step({"SLURM_JOB_ID": "4242"})  # an allocation, not a step


@pytest.mark.parametrize("change, says", [
    ({"SLURM_NODEID": None}, "SLURM_NODEID missing: run `elaswave run` under srun"),
    ({"SLURM_STEP_NUM_TASKS": "6"}, "srun started 6 tasks on 3 nodes: elaswave runs one agent per node"),
    ({"SLURM_STEP_NUM_NODES": "three"}, "SLURM_STEP_NUM_NODES='three'"),
])
def test_a_step_that_cannot_place_this_host_is_one_line(change, says):
    env = {k: v for k, v in {**STEP, **change}.items() if v is not None}
    with pytest.raises(ConfigError) as err:
        slurm.step(env)
    assert says in str(err.value), err.value


def test_launcher_slurm_outside_a_step_and_flags_that_disagree_are_refused(tmp_path):
    outside = run_cli(["run", *[x for s in TINY for x in ("--set", s)], "--launcher", "slurm"], tmp_path, timeout_s=60,
                      env={k: "" for k in slurm.NEEDED})
    assert outside.returncode == 2 and "--launcher slurm needs the environment of a Slurm job step" in outside.stderr, \
        outside.stderr
    uneven = run_cli(["run", *[x for s in TINY for x in ("--set", s)]], tmp_path, timeout_s=60,
                     env={**STEP, "ELASWAVE_TOKEN": "t"})  # the default job's 4 ranks on 3 nodes
    assert uneven.returncode == 2 and "the Slurm step's 3 nodes cannot share the job's 4 ranks" in uneven.stderr, \
        uneven.stderr
    disagree = run_cli(["run", *[x for s in TINY for x in ("--set", s)], "--node-rank", "2"], tmp_path, timeout_s=60,
                       env={**STEP, "SLURM_STEP_NODELIST": "n1", "ELASWAVE_TOKEN": "t"})
    assert disagree.returncode == 2 and "--node-rank=2 disagree with the Slurm step (node 1 of 3)" in disagree.stderr, \
        disagree.stderr


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _steps(path: Path, at_least: int = 0, world: int | None = None) -> list[dict]:
    return [r for r in _records(path) if r["event"] == "step" and r["step"] >= at_least
            and (world is None or r["world_size"] == world)]


def test_a_node_lost_under_slurm_leaves_the_job_running_and_a_replacement_node_joins_bit_identical(tmp_path):
    """sbatch of examples/slurm/train.sbatch on nodes n1-n3, two ranks each (dp=3 x pp=2). Node n3
    -- its slurmd, the agent srun started there and its two workers -- is SIGKILLed at step 5. Slurm
    marks n3 down and keeps the job running; the agents on n1 and n2 train on as two pipelines. Then
    examples/slurm/join.sbatch, a second allocation on n4, adds two ranks: a third pipeline again.
    Both jobs end COMPLETED with exit 0, and the run is bit-identical to the reference."""
    reason = cluster.unavailable()
    if reason:
        pytest.skip(reason)
    steps = 120
    sets = [*TINY, "parallel.dp=3", "parallel.pp=2", f"train.steps={steps}", "train.num_micro_batches=6",
            "train.deterministic=true", "elastic.respawn_after_s=-1", "parallel.timeout_s=30",
            "emulate.enabled=true", "emulate.block_forward_ms=10"]  # steps of sleeps: the joiners start in ~20 s
    args = [x for s in sets for x in ("--set", s)] + ["--metrics-out", str(tmp_path / "m-%n.jsonl")]
    env = {"ELASWAVE": f"{sys.executable} -m elaswave.cli", "ELASWAVE_TOKEN": "slurm-test", "OMP_NUM_THREADS": "1",
           "TORCH_CPP_LOG_LEVEL": "ERROR"}
    node0, out = tmp_path / "m-0.jsonl", tmp_path / "job.out"
    with cluster.SlurmCluster(tmp_path / "cluster", nodes=4) as c:
        c.env.update(env)
        job = c.sbatch(SBATCH, "--nodes=3", "--nodelist=n[1-3]", f"--output={out}", args=args)
        deadline = time.monotonic() + 180
        while not _steps(node0, 5):
            assert time.monotonic() < deadline and c.job(job)["JobState"] in ("PENDING", "RUNNING"), \
                (c.job(job), out.read_text() if out.exists() else "")
            time.sleep(0.2)
        c.kill_node("n3")
        lost_at = time.time()
        while not _steps(node0, world=4):
            assert time.time() - lost_at < 90, "no step after the node's loss"
            time.sleep(0.1)
        running = c.job(job)["JobState"]  # while the survivors train
        joiner = c.sbatch(SBATCH.with_name("join.sbatch"), "--nodes=1", "--nodelist=n4", "--ntasks-per-node=2",
                          f"--output={tmp_path / 'join.out'}", args=[str(job)])
        final, joiners = c.wait_job(job, 240), c.wait_job(joiner, 60)
        nodes = c.run("sinfo", "--noheader", "--Node", "--format=%N %t")
    text = out.read_text()
    assert running == "RUNNING", running
    assert (final["JobState"], final["ExitCode"]) == ("COMPLETED", "0:0"), (final, text[-3000:])
    assert (joiners["JobState"], joiners["ExitCode"]) == ("COMPLETED", "0:0"), \
        (joiners, (tmp_path / "join.out").read_text()[-3000:])
    assert "n3 down" in nodes, nodes
    assert "Slurm job" in text and "node 0 of 3 (n1)" in text, text[-3000:]
    assert "lost ranks [4, 5] on node 2 (n3)" in text and "nothing for a scheduler to do" in text, text[-3000:]
    records = _records(node0)
    res = Result(0, text, "", records)
    [rec] = [r for r in records if r["event"] == "recovery"]
    assert rec["lost_ranks"] == [4, 5] and not rec["is_fallback"], rec
    joined = sorted(r for rec in records if rec["event"] == "join" for r in rec["joined_ranks"])
    assert joined == [6, 7], (joined, "the training ended before the joiners came: give it more steps")
    first_after = min(r["wall_time"] for r in res.steps if r["world_size"] == 4)
    assert first_after - lost_at < 30, first_after - lost_at
    worlds = [r["world_size"] for r in res.steps]
    assert worlds[0] == 6 and 4 in worlds and worlds[-1] == 6, worlds
    assert_same_run(res, run_reference(tmp_path, steps, deterministic=True, num_micro_batches=6), steps)
