"""Writing a Hugging Face folder: what a finish installs, and where an export may go (no job: the
functions over real files)."""
import json

import pytest
import torch
from safetensors import safe_open

from elaswave.checkpoint import hf_folder
from elaswave.checkpoint.target import ExportError, check_target


def test_finish_installs_only_the_parts_posted_and_joins_neighbours(tmp_path):
    out = tmp_path / "out"
    parts = [hf_folder.write_part(out, f"r{r}", first, {f"t{first}": torch.full((4,), float(first))})
             for r, first in ((0, 0), (1, 1), (2, 2))]
    # A part of an attempt that a failure cut short (a rank died in the final barrier): never posted.
    hf_folder.write_part(out, "r9", 0, {"stale": torch.zeros(4)})
    done = hf_folder.finish(out, parts, {"architectures": ["LlamaForCausalLM"]}, hf_folder.Source(), False,
                            max_shard_bytes=2 ** 20)
    assert sorted(f.name for f in done.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(str(done / "model.safetensors"), framework="pt") as fh:
        assert sorted(fh.keys()) == ["t0", "t1", "t2"]
    assert json.loads((done / "config.json").read_text()) == {"architectures": ["LlamaForCausalLM"]}
    # Under a limit of two parts' bytes: two shards and their index, in the order posted.
    again = hf_folder.finish(tmp_path / "two", [hf_folder.write_part(tmp_path / "two", f"r{i}", i, {f"t{i}": torch.ones(4)})
                                                for i in range(3)], {}, hf_folder.Source(), False, max_shard_bytes=32)
    index = json.loads((again / "model.safetensors.index.json").read_text())["weight_map"]
    assert index == {"t0": "model-00001-of-00002.safetensors", "t1": "model-00001-of-00002.safetensors",
                     "t2": "model-00002-of-00002.safetensors"}


def test_a_target_holding_what_the_job_reads_is_refused_even_with_overwrite(tmp_path):
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    with pytest.raises(ExportError, match="it is or holds data.mix="):
        check_target(str(root), True, keep={"data.mix": [str(root / "a"), str(tmp_path / "b")]})
    with pytest.raises(ExportError, match="exists and is not empty"):
        check_target(str(root), False)
    check_target(str(root), True, keep={"data.mix": [str(tmp_path / "b")]})


def test_overwrite_replaces_the_model_and_keeps_the_folders_other_files(tmp_path):
    """A folder holding an earlier export in three shards, an adapter config, a README and the
    user's notes: overwritten by a one-file export, the weights, index and configs of the old one
    are gone (none left to be read with the new ones) and the README and notes are where they were.
    Overwrite deleted them."""
    out = tmp_path / "out"
    old = hf_folder.finish(out, [hf_folder.write_part(out, f"r{i}", i, {f"old{i}": torch.ones(4)}) for i in range(3)],
                           {"old": True}, hf_folder.Source(), False, max_shard_bytes=16)
    assert len(list(old.glob("*.safetensors"))) == 3
    (out / "adapter_config.json").write_text("{}")
    (out / "README.md").write_text("my model card")
    (out / "notes").mkdir()
    (out / "notes" / "eval.txt").write_text("0.91")
    new = hf_folder.finish(out, [hf_folder.write_part(out, "r0", 0, {"t0": torch.zeros(4)})], {"new": True},
                           hf_folder.Source(), True, max_shard_bytes=2 ** 20)
    assert sorted(f.name for f in new.iterdir()) == ["README.md", "config.json", "model.safetensors", "notes"]
    assert (new / "README.md").read_text() == "my model card" and (new / "notes" / "eval.txt").read_text() == "0.91"
    assert json.loads((new / "config.json").read_text()) == {"new": True}
    assert not list(tmp_path.glob(".out.*"))
