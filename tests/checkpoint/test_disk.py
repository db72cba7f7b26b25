"""Disk checkpoints (torch.distributed.checkpoint, per-rank, no collectives): round trip,
completeness, pruning, and a clear error for a checkpoint from another model."""
import pytest
import torch

from elaswave.checkpoint.disk import Checkpointer, CheckpointError, complete_steps, latest, load_chunks, step_dir

MODEL = {"d_model": 8, "num_blocks": 1}
OWNERS = ((0, 1), (1, 0, 1))  # layer 0 has 2 chunks, layer 1 has 3; ranks 0 and 1


def _save(root, gen, ranks=(0, 1), keep=2):
    for r in ranks:
        keys = [(l, c) for l, row in enumerate(OWNERS) for c, o in enumerate(row) if o == r]
        payload = torch.stack([torch.full((3, 4), float(100 * gen + 10 * l + c)) for l, c in keys])
        ck = Checkpointer(str(root), r, every=5, keep=keep, model=MODEL, chunk_numel=4)
        ck.save(gen, OWNERS, keys, payload, is_writer=r == 0)
        payload.fill_(-1.0)  # training goes on: the save must have taken a copy
        ck.wait()


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


def test_no_checkpoint_dir_means_nothing_to_resume(tmp_path):
    assert latest(tmp_path / "missing") is None


class _Payload:
    """What a planted pickle would run on load; here only a marker that it did."""

    def __reduce__(self):
        return (print, ("a planted pickle ran",))


def test_metadata_that_would_run_code_is_refused(tmp_path, capsys):
    import pickle

    _save(tmp_path, 5)
    meta = step_dir(tmp_path, 5) / "rank_1" / ".metadata"
    assert meta.exists()
    meta.write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(CheckpointError, match="asks to load builtins.print"):
        load_chunks(latest(tmp_path), [(1, 0)])
    assert "a planted pickle ran" not in capsys.readouterr().out
