"""The health probe: the host's state as its agent keeps it (``elaswave run --health-file``) and
``elaswave health`` as an exec probe reads it -- folded from real workers' words, through a SIGKILL."""
import json
import subprocess
import sys
import threading
import time

from elaswave.control.health import DIR_ENV, HostHealth, RankReport, check
from tests.helpers.spawn import Running, job_args


def test_the_host_state_is_folded_from_its_ranks_words(tmp_path, monkeypatch):
    path = tmp_path / "health.json"
    host = HostHealth(str(path))
    assert json.loads(path.read_text())["state"] == "starting"
    monkeypatch.setenv(DIR_ENV, host.folder)
    RankReport(0)("training", 5, 0)
    RankReport(1)("training", 4, 0)
    host.update(force=True)
    doc = json.loads(path.read_text())
    assert (doc["state"], doc["step"], doc["ranks"]) == ("training", 5, {"0": "training", "1": "training"})
    assert check(str(path), 10.0) == (0, "training, step 5")
    one = RankReport(1)
    one("recovering", 5, 0)  # one rank in a change makes the host's state a change
    host.update(force=True)
    assert check(str(path), 10.0) == (0, "recovering, step 5")
    code, line = check(str(path), 10.0, max_step_age_s=0.0)  # recovering is not a hang
    assert code == 0
    one("training", 6, 1)
    host.update(force=True)
    assert json.loads(path.read_text())["state"] == "training"
    one("recovering", 6, 1)
    one("training", 7, 2)  # a change over before the agent read: still shown once
    host.update(force=True)
    assert json.loads(path.read_text())["state"] == "recovering"
    host.update(force=True)
    assert json.loads(path.read_text())["state"] == "training"
    time.sleep(0.05)
    code, line = check(str(path), 10.0, max_step_age_s=0.01)
    assert code == 1 and "no step ended for" in line and "hung" in line
    code, line = check(str(path), 0.01)
    assert code == 1 and "gone" in line
    RankReport(2)("recovering", 7, 1)  # a rank that left mid-change (its group broken) says no more
    host.update(force=True, live={0, 1})
    assert json.loads(path.read_text())["state"] == "training"
    host.stopped(4)
    assert check(str(path), 10.0) == (1, "stopped, exit code 4")
    assert check(str(tmp_path / "none.json"), 10.0)[0] == 1
    # A new agent on the same file starts from its own ranks' words only.
    HostHealth(str(path))
    assert json.loads(path.read_text())["state"] == "starting"


def test_a_probe_follows_a_real_job_through_a_kill(tmp_path):
    """dp=2 x pp=2, rank 3 SIGKILLed at step 4: the file says training, then recovering (the
    survivors' change), training again at a later step, and stopped with the job's exit code;
    `elaswave health` answers 0 while it trains and 1 once it stopped."""
    path = tmp_path / "health.json"
    args = job_args(2, 2, 80, True, ["elastic.inject=kill:rank=3,step=4"]) + ["--health-file", str(path)]
    seen, probes, done = [], [], threading.Event()

    def watch():
        while not done.is_set():
            try:
                doc = json.loads(path.read_text())
            except (OSError, ValueError):
                doc = None
            if doc and (not seen or (doc["state"], doc.get("step")) != seen[-1]):
                seen.append((doc["state"], doc.get("step")))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with Running(args, tmp_path / "m.jsonl") as job:
        job.wait_for(r"step\s+10/", 120)
        probes.append(subprocess.run([sys.executable, "-m", "elaswave.cli", "health", str(path)],
                                     capture_output=True, text=True, timeout=60))
        res = job.finish(120)
    time.sleep(0.05)
    done.set()
    watcher.join(timeout=5)
    assert res.returncode == 0, res.stderr
    states = [s for s, _ in seen]
    assert "training" in states and "recovering" in states and states[-1] == "stopped", seen
    first_recovery = states.index("recovering")
    assert "training" in states[first_recovery:], seen  # and it trained on after the change
    assert json.loads(path.read_text())["exit_code"] == 0
    assert probes[0].returncode == 0 and probes[0].stdout.startswith("training, step "), probes[0]
    after = subprocess.run([sys.executable, "-m", "elaswave.cli", "health", str(path)], capture_output=True,
                           text=True, timeout=60)
    assert after.returncode == 1 and after.stdout.strip() == "stopped, exit code 0"
