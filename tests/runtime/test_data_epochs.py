"""Exactly-once epochs through failures: a job on a prepared corpus whose epoch is exactly its
steps is killed in a rank (SIGKILL), grows back by a join, loses every process at once and is
resumed from its disk checkpoint by a second run. The windows the ranks actually read, in the
steps that counted, cover the epoch once each; and the run equals the failure-free reference bit
for bit."""
import json
import os
import signal
from collections import Counter

import pytest

from elaswave.data.prepare import prepare
from tests.helpers.spawn import Running, job_args, run_cli, run_reference

STEPS, MBS, B, SEQ = 200, 4, 2, 32  # TINY's micro-batch size and sequence length
WINDOWS = STEPS * MBS * B  # one epoch is the whole run


def _trace(folder, run: int) -> list[dict]:
    records = []
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), encoding="utf-8") as fh:
            lines = fh.read().splitlines()
        for i, line in enumerate(lines):
            try:
                records.append(dict(json.loads(line), run=run))
            except ValueError:  # the last line of a process killed as it wrote it
                assert run == 0 and i == len(lines) - 1, f"{name}:{i + 1} is not a trace record: {line!r}"
    return records


def _counted(records: list[dict]) -> dict[int, list[dict]]:
    """Per step, the reads of its last attempt (later run, then later plan epoch): the one that counted."""
    last = {}
    for r in records:
        last[r["step"]] = max(last.get(r["step"], (-1, -1)), (r["run"], r["plan_epoch"]))
    counted: dict[int, list[dict]] = {}
    for r in records:
        if (r["run"], r["plan_epoch"]) == last[r["step"]]:
            counted.setdefault(r["step"], []).append(r)
    return counted


@pytest.mark.slow  # the default run keeps a faster case of the same path; `pytest -m slow` runs it
def test_one_epoch_reads_every_window_once_through_a_kill_a_join_and_a_resume(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_bytes(bytes(97 + (i * 7919 + i // 13) % 26 for i in range(WINDOWS * SEQ)))  # + EOD: N windows exactly
    corpus = tmp_path / "prepared"
    prepare([str(text)], str(corpus), "bytes", progress=False)
    data = [f"data.path={corpus}", f"train.num_micro_batches={MBS}", f"checkpoint.dir={tmp_path / 'ckpt'}",
            "checkpoint.every_steps=10", "parallel.timeout_s=60"]
    metrics = tmp_path / "run.jsonl"
    faulty = job_args(2, 1, STEPS, True, [*data, "elastic.inject=kill:rank=1,step=5;join:step=6,count=1"])
    with Running(faulty, metrics, env={"ELASWAVE_DATA_TRACE": str(tmp_path / "trace0")}) as job:
        joined = int(job.wait_for(r"ranks \[2\] joined at step (\d+)", 240).group(1))
        saved = (joined // 10 + 1) * 10  # the first checkpoint of the grown job, then a few steps more
        assert saved + 5 < STEPS, f"the join came too late to be checkpointed (step {joined})"
        job.wait_for(rf"^step +{saved + 5}/", 120)
        os.killpg(job.proc.pid, signal.SIGKILL)  # every process at once: only the disk checkpoint is left
    resumed = run_cli(job_args(2, 1, STEPS, True, data), tmp_path, metrics=metrics,
                      env={"ELASWAVE_DATA_TRACE": str(tmp_path / "trace1")})
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming at step" in resumed.stdout

    counted = _counted(_trace(tmp_path / "trace0", 0) + _trace(tmp_path / "trace1", 1))
    assert sorted(counted) == list(range(STEPS))
    readers = {(r["run"], r["rank"]) for reads in counted.values() for r in reads}
    assert {(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)} <= readers  # the killed rank and the joiner read steps that counted
    for step, reads in counted.items():  # each micro-batch read once, by one pipeline (pp=1)
        assert sorted(r["micro_batch"] for r in reads) == list(range(MBS)), f"step {step}: {reads}"
    seen = Counter(w for reads in counted.values() for r in reads for w in r["windows"])
    assert sorted(seen) == list(range(WINDOWS)) and set(seen.values()) == {1}

    steps = [r["step"] for r in resumed.records if r["event"] == "step"]
    assert steps == list(range(STEPS)), "a step was lost or counted twice"
    reference = run_reference(tmp_path, STEPS, True, MBS, [f"data.path={corpus}"])
    assert resumed.summary["params_sha256"] == reference.summary["params_sha256"]
    assert [r["loss"] for r in resumed.records if r["event"] == "step"] == reference.losses


def test_a_job_on_a_mixture_reports_each_sources_tokens(tmp_path):
    corpora = []
    for name, letter in (("prose", "a"), ("code", "b")):
        text = tmp_path / f"{name}.txt"
        text.write_text((letter * 7 + " ") * 2000)
        prepare([str(text)], str(tmp_path / name), "bytes", progress=False)
        corpora.append(str(tmp_path / name))
    mix = f"data.mix={corpora[0]}=0.75;{corpora[1]}=0.25"
    res = run_cli(job_args(1, 1, 3, False, [mix, "train.num_micro_batches=4"]), tmp_path)
    assert res.returncode == 0, res.stderr
    per_step = MBS * B * SEQ
    for record in res.steps:  # 1000-sample blocks hold 750 and 250: 8 samples a step follow them closely
        counts = record["tokens_per_source"]
        assert sum(counts.values()) == per_step and set(counts) == set(corpora)
    total = {c: sum(r["tokens_per_source"][c] for r in res.steps) for c in corpora}
    assert total[corpora[0]] > total[corpora[1]]
    batches = run_cli(["data", "batches", "--steps", "0:3", "--text", "--set", mix, "--set", "train.num_micro_batches=4",
                       "--set", f"model.seq_len={SEQ}", "--set", f"train.micro_batch_size={B}"], tmp_path)
    samples = [s for line in batches.stdout.splitlines() for s in json.loads(line)["samples"]]
    for s in samples:  # the decoded window is the source's own text
        assert set(s["text"].replace(" ", "").replace("\0", "")) == {"a" if s["source"] == corpora[0] else "b"}
    assert sum(SEQ for s in samples if s["source"] == corpora[0]) == total[corpora[0]]
    bad = run_cli(job_args(1, 1, 3, False, [mix, f"data.path={corpora[0]}"]), tmp_path)
    assert bad.returncode == 2 and "has no effect with data.mix" in bad.stderr
