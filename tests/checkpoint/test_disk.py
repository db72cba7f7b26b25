"""Disk checkpoints (torch.distributed.checkpoint, per-rank, no collectives): round trip,
completeness, pruning, fences, and a clear error for a checkpoint from another model."""
import json
import shutil

import pytest
import torch

from elaswave.checkpoint.disk import (Checkpointer, CheckpointError, Fence, MANIFEST, at_step, complete_steps,
                                     latest, load_chunks, named, newest_fence, next_run, step_dir)

MODEL = {"d_model": 8, "num_blocks": 1}
OWNERS = ((0, 1), (1, 0, 1))  # layer 0 has 2 chunks, layer 1 has 3; ranks 0 and 1


def _save(root, gen, ranks=(0, 1), keep=2, fence=Fence(0, 0), mark=0.0):
    """Ranks 0 and 1 save generation ``gen``; returns the generations each writer left unwritten."""
    fenced = []
    for r in ranks:
        keys = [(l, c) for l, row in enumerate(OWNERS) for c, o in enumerate(row) if o == r]
        payload = torch.stack([torch.full((3, 4), mark + float(100 * gen + 10 * l + c)) for l, c in keys])
        ck = Checkpointer(str(root), r, every=5, keep=keep, model=MODEL, chunk_numel=4, run=fence.run)
        ck.save(gen, OWNERS, keys, payload, is_writer=r == 0, epoch=fence.epoch)
        payload.fill_(-1.0)  # training goes on: the save must have taken a copy
        ck.wait()
        fenced += ck.fenced_off
    return fenced


def test_round_trip_reads_each_chunk_from_its_owner(tmp_path):
    _save(tmp_path, 5)
    m = latest(tmp_path)
    assert m.step == 5 and m.is_complete()
    m.check_fits(MODEL, 4, OWNERS)
    got = load_chunks(m, [(1, 2), (0, 0), (1, 1)])
    assert {k: v[0, 0].item() for k, v in got.items()} == {(1, 2): 512.0, (0, 0): 500.0, (1, 1): 511.0}
    assert got[(1, 2)].shape == (3, 4)


def test_a_checkpoint_missing_a_ranks_part_is_not_complete(tmp_path):
    _save(tmp_path, 5)
    _save(tmp_path, 10, ranks=(0,))  # rank 1 died before its part was written
    assert [m.step for m in complete_steps(tmp_path)] == [5]
    assert latest(tmp_path).step == 5


def test_only_the_newest_complete_checkpoints_are_kept(tmp_path):
    for gen in (5, 10, 15):
        _save(tmp_path, gen)
    assert [m.step for m in complete_steps(tmp_path)] == [10, 15]
    assert not step_dir(tmp_path, 5).exists()


def test_a_checkpoint_from_another_model_is_refused_by_name(tmp_path):
    _save(tmp_path, 5)
    with pytest.raises(CheckpointError, match=r"another model: model.d_model=8 there, 16 here"):
        latest(tmp_path).check_fits({"d_model": 16, "num_blocks": 1}, 4, OWNERS)
    with pytest.raises(CheckpointError, match="chunk_numel=4; this job has 8"):
        latest(tmp_path).check_fits(MODEL, 8, OWNERS)


def test_a_checkpoint_from_before_adapters_existed_is_of_a_model_without_them(tmp_path):
    """Its manifest has no model.lora: it resumes into a job without adapters (it was refused as
    "model.lora=None there"), and a job with adapters is refused."""
    from elaswave import config
    _save(tmp_path, 5)
    plain, tuned = (config.load(None, sets).model_identity() for sets in ([], ["model.lora.rank=4"]))
    old = latest(tmp_path)
    assert "lora" not in old.model
    for identity in (plain, tuned):
        shaped = {**MODEL, "lora": identity["lora"]}
        if identity is plain:
            old.check_fits(shaped, 4, OWNERS)
        else:
            with pytest.raises(CheckpointError, match="model.lora=.*'rank': 0.* there, .*'rank': 4"):
                old.check_fits(shaped, 4, OWNERS)


def test_no_checkpoint_dir_means_nothing_to_resume(tmp_path):
    assert latest(tmp_path / "missing") is None


class _Payload:
    """What a planted pickle would run on load; here only a marker that it did."""

    def __reduce__(self):
        return (print, ("a planted pickle ran",))


def test_metadata_that_would_run_code_is_refused(tmp_path, capsys):
    import pickle

    _save(tmp_path, 5)
    meta = latest(tmp_path).part(1) / ".metadata"
    assert meta.exists()
    meta.write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(CheckpointError, match="asks to load builtins.print"):
        load_chunks(latest(tmp_path), [(1, 0)])
    assert "a planted pickle ran" not in capsys.readouterr().out


def test_a_save_under_an_older_fence_is_not_written_and_never_wins(tmp_path):
    """A rank left out in epoch 1 comes back and saves: the job, in epoch 2, already wrote. Its save
    adds nothing; what it wrote before the job's (its own fence's folder) loses to the newer fence,
    even at a higher step."""
    _save(tmp_path, 10, fence=Fence(0, 2))
    fenced = _save(tmp_path, 12, fence=Fence(0, 1))
    assert [(g, f, n) for g, f, n in fenced] == [(12, Fence(0, 1), Fence(0, 2))] * 2
    assert not step_dir(tmp_path, 12).exists()
    assert newest_fence(tmp_path) == Fence(0, 2)
    # A stale save that got its part and manifest down before the job's newer one began:
    stale = tmp_path / "stale"
    _save(stale, 12, fence=Fence(0, 1), mark=0.5)
    _save(stale, 10, fence=Fence(0, 2))
    assert [(m.fence, m.step) for m in complete_steps(stale)] == [(Fence(0, 1), 12), (Fence(0, 2), 10)]
    assert latest(stale).step == 10 and latest(stale).fence == Fence(0, 2)


def test_a_step_saved_under_two_fences_reads_the_newer_and_keeps_both_parts_apart(tmp_path):
    _save(tmp_path, 10, fence=Fence(0, 1), mark=0.5)
    _save(tmp_path, 10, fence=Fence(0, 3), keep=3)
    m = at_step(tmp_path, 10)
    assert m.fence == Fence(0, 3) and m.path == step_dir(tmp_path, 10) / "run0-epoch3"
    assert load_chunks(m, [(0, 0)])[(0, 0)][0, 0].item() == 1000.0  # not epoch 1's 1000.5
    assert named(step_dir(tmp_path, 10)) == m and named(tmp_path) == m
    assert named(step_dir(tmp_path, 10) / "run0-epoch1").fence == Fence(0, 1)


def test_each_start_in_a_directory_is_the_next_run_and_its_fences_are_newer(tmp_path):
    assert next_run(tmp_path) == 0
    _save(tmp_path, 10, fence=Fence(0, 7))
    assert next_run(tmp_path) == 1
    _save(tmp_path, 5, fence=Fence(1, 0))  # a rerun that went back (resume off): its epoch 0 is newest
    assert latest(tmp_path).fence == Fence(1, 0) and latest(tmp_path).step == 5


def test_pruning_goes_by_fence_then_step(tmp_path):
    _save(tmp_path, 12, fence=Fence(0, 1))
    _save(tmp_path, 8, fence=Fence(0, 2))  # a return to an older step in a newer epoch
    _save(tmp_path, 10, fence=Fence(0, 2))
    assert [(m.fence.epoch, m.step) for m in complete_steps(tmp_path)] == [(2, 8), (2, 10)]
    assert not step_dir(tmp_path, 12).exists()


def test_an_unfenced_checkpoint_still_loads_as_older_than_any_fenced_one(tmp_path):
    """Written before fences: the manifest in the step's folder, parts beside it."""
    _save(tmp_path, 5)
    fenced = step_dir(tmp_path, 5) / "run0-epoch0"
    for part in fenced.iterdir():
        shutil.move(str(part), step_dir(tmp_path, 5))
    doc = json.loads((step_dir(tmp_path, 5) / MANIFEST).read_text())
    del doc["fence"]
    (step_dir(tmp_path, 5) / MANIFEST).write_text(json.dumps(doc))
    fenced.rmdir()
    old = latest(tmp_path)
    assert old.step == 5 and old.path == step_dir(tmp_path, 5)
    assert load_chunks(old, [(1, 2)])[(1, 2)][0, 0].item() == 512.0
    _save(tmp_path, 3, fence=Fence(0, 0))
    assert latest(tmp_path).step == 3
