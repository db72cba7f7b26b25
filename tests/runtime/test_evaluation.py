"""Evaluation on the held-out split: on the job's own layout, through a kill in the middle of one,
written once, equal to the single-process reference bit for bit, in the metrics, TensorBoard and
the report."""
import json
import subprocess
import sys

import pytest

from elaswave.config import ConfigError, load
from elaswave.data.prepare import prepare
from elaswave.data.sampler import open_eval_sampler
from elaswave.model.config import ModelConfig
from elaswave.runtime.metrics import MetricsWriter, StepJournal, read_jsonl
from elaswave.runtime.recovery import Recovery
from tests.helpers.spawn import TINY, job_args, run_cli, run_job, run_reference

EVAL = ["train.eval_every=3", "train.eval_batches=2"]


def _prepared(tmp_path, eval_fraction=0.25):
    docs = tmp_path / "docs"
    docs.mkdir(exist_ok=True)
    for i in range(40):  # documents go to eval by a hash of their text: some will
        (docs / f"{i:02d}.txt").write_text(" ".join(f"word{(i * 31 + k * 7) % 97}" for k in range(300)))
    out = tmp_path / f"corpus-{eval_fraction}"
    prepare([str(docs)], str(out), "bytes", eval_fraction=eval_fraction, progress=False)
    return out


def _record(step, event, **more):
    return {"event": event, "step": step, **more}


def test_eval_records_are_committed_with_their_step_and_redone_after_a_rollback(tmp_path):
    path = tmp_path / "m.jsonl"
    writer, journal = MetricsWriter(str(path), show_progress=False), StepJournal()
    journal.add(_record(2, "step"))
    journal.add(_record(3, "eval", eval_loss=1.0))
    journal.commit_before(3, writer)  # step 2 is committed; the evaluation of the state after 3 steps not yet
    journal.discard_from(3)  # a failure: the job goes back to step 3, and the evaluation runs again
    journal.add(_record(3, "eval", eval_loss=1.5))
    journal.add(_record(3, "step"))
    journal.commit_before(4, writer)
    writer.close()
    again = MetricsWriter(str(path), show_progress=False, append=True)  # a new writer skips what is there
    journal.replay(again)
    again.close()
    assert [(r["event"], r["step"], r.get("eval_loss")) for r in read_jsonl(path)] == [
        ("step", 2, None), ("eval", 3, 1.5), ("step", 3, None)]


def test_a_step_the_writer_did_not_record_comes_from_the_members_that_did(tmp_path):
    # A disruption reached the writer in step 49's parameter gather, after every rank's update:
    # the job resumes at step 50, and only the other members recorded step 49 (a loaded run lost it).
    path = tmp_path / "m.jsonl"
    writer, journal, other = MetricsWriter(str(path), show_progress=False), StepJournal(), StepJournal()
    for j in (journal, other):
        j.add(_record(48, "step", loss=2.0))
        j.commit_before(49, writer if j is journal else None)
    other.add(_record(49, "step", loss=1.9))
    journal.fill(other.unwritten() + [_record(48, "step", loss=0.0)])  # (what it has stays its own)
    journal.discard_from(50)
    journal.commit_before(50, writer)
    writer.close()
    assert [(r["step"], r["loss"]) for r in read_jsonl(path)] == [(48, 2.0), (49, 1.9)]


def test_an_evaluation_before_a_recoverys_first_step_is_not_counted_in_its_mttr():
    r = Recovery(1, [3], 6, fault_wall=100.0, noticed_wall=100.1, phases_s={"state": 0.2})
    record = r.record(first_step_end_wall=101.5, first_step_s=0.4, evaluation_s=0.8)
    assert record["mttr_s"] == pytest.approx(0.7) and record["evaluation_s"] == 0.8
    assert sum(record["phases_s"].values()) == pytest.approx(record["mttr_s"])


def test_the_held_out_windows_and_what_bad_eval_settings_say(tmp_path):
    corpus = _prepared(tmp_path)
    model = ModelConfig(vocab_size=256, seq_len=32)
    cfg = load(None, [*TINY, f"data.path={corpus}", "train.num_micro_batches=4", *EVAL])
    s = open_eval_sampler(cfg, model)
    draws = [s.draw(j, m) for j in range(2) for m in range(4)]
    windows = [w for d in draws for w in d.windows.tolist()]
    assert len(set(windows)) == len(windows) == 16 and all((d.epochs == 0).all() for d in draws)
    manifest = json.loads((corpus / "manifest.json").read_text())
    assert s.num_windows == [(manifest["splits"]["eval"]["tokens"] - 1) // 32]  # the eval split, not train
    with pytest.raises(ConfigError, match=r"train.eval_batches=1000 is invalid: .*holds \d+; use at most \d+"):
        open_eval_sampler(load(None, [*TINY, f"data.path={corpus}", "train.eval_batches=1000"]), model)
    no_eval = _prepared(tmp_path, eval_fraction=0.0)
    with pytest.raises(ConfigError, match="eval split has 0 tokens.*--eval-fraction"):
        open_eval_sampler(load(None, [*TINY, f"data.path={no_eval}", *EVAL]), model)
    with pytest.raises(ConfigError, match="train.eval_every=3 is invalid: .*data.source=stdlib has none"):
        load(None, EVAL)
    with pytest.raises(ConfigError, match=r"phase=eval' is invalid: no evaluation runs before step 5 "
                                          r"\(train.eval_every=3, train.steps=8\)"):
        load(None, [f"data.path={corpus}", *EVAL, "train.steps=8", "elastic.inject=kill:rank=0,step=5,phase=eval"])
    load(None, [f"data.path={corpus}", *EVAL, "train.steps=8", "elastic.inject=kill:rank=0,step=8,phase=eval"])
    for bad, needle in (("train.eval_every=-1", "must be >= 0"), ("train.eval_batches=0", "must be >= 1")):
        with pytest.raises(ConfigError, match=needle):
            load(None, [f"data.path={corpus}", bad])


def test_a_kill_during_an_evaluation_is_recovered_and_every_held_out_loss_equals_the_reference(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    sets = [f"data.path={_prepared(tmp_path)}", *EVAL]
    logdir = tmp_path / "tb"
    # Rank 0 writes the metrics and runs the first stage: it dies with the evaluation half done.
    run = run_job(tmp_path, 2, 2, 8, True, [*sets, "elastic.inject=kill:rank=0,step=6,phase=eval"],
                  cli=["--tensorboard", str(logdir)])
    assert "injecting kill into rank 0 at step 6 (eval)" in run.stderr
    evals = [r for r in run.records if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [3, 6, 8]  # every 3 steps and after the last, each written once
    assert [r["world_size"] for r in evals] == [4, 3, 3]  # the one killed ran again on the survivors
    ref = run_reference(tmp_path, 8, True, 4, sets)
    assert [r["eval_loss"] for r in evals] == [r["eval_loss"] for r in ref.records if r["event"] == "eval"]
    assert run.losses == ref.losses

    acc = event_accumulator.EventAccumulator(str(logdir))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("eval/loss")] == [
        (r["step"], pytest.approx(r["eval_loss"], rel=1e-6)) for r in evals]

    run_file, ref_file = sorted(tmp_path.glob("metrics-*.jsonl"))
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "elaswave.cli", "report", str(run_file), "--against", str(ref_file),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    page = (out / "report.md").read_text()
    assert "**bit-identical** to the reference over 8 steps" in page and "held-out losses equal at 3 evaluations" in page
    assert f"| 6 | {evals[1]['eval_loss']:.4f} | 512 | 3 |" in page
    assert (out / "loss.png").stat().st_size > 0


def test_a_corpus_without_an_eval_split_is_one_line_before_any_training(tmp_path):
    no_eval = _prepared(tmp_path, eval_fraction=0.0)
    res = run_cli(job_args(1, 2, 8, False, [f"data.path={no_eval}", *EVAL]), tmp_path, timeout_s=60)
    assert res.returncode == 2 and "eval split has 0 tokens" in res.stderr and "--eval-fraction" in res.stderr
    assert not res.steps and res.stderr.count("error") == 1, res.stderr
