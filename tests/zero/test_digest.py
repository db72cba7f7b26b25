"""The state digest and the replica check (pure)."""
import pytest

from elaswave.zero.digest import StateMismatch, check_replicas, replica_mismatches, shard_mismatches, state_sha256


def test_the_state_digest_is_the_same_however_the_chunks_are_owned():
    sums = [3, 1 << 255, (1 << 256) - 5, 7]
    one_owner = state_sha256(12, [sum(sums) % (1 << 256)])
    assert state_sha256(12, sums) == one_owner == state_sha256(12, list(reversed(sums)))
    assert state_sha256(13, sums) != one_owner  # the step counter is part of the state
    assert state_sha256(12, sums[:-1] + [8]) != one_owner


def test_holders_that_disagree_are_named():
    held = {0: {"0": "aa", "1": "bb"}, 2: {"0": "aa", "1": "cc"}, 4: {"1": "bb"}}
    (line,) = replica_mismatches(held)
    assert line.startswith("layer 1: its holders disagree") and "ranks [0, 4] hold bb" in line and "ranks [2] hold cc" in line
    assert replica_mismatches({0: {"0": "aa"}, 1: {"0": "aa"}}) == []


def test_shards_whose_replicas_disagree_are_named_by_layer_tensor_and_shard():
    # Two devices of two shards (ranks 0,1 and 2,3): device 2's shard 1 drifted in layer 3's norm.
    device_of, shard_of = (lambda r: r - r % 2), (lambda r: r % 2)
    held = {r: {"3/norm.weight": "aa", "3/k_proj.weight (key-value heads 0..0)": "kk"} for r in range(4)}
    assert shard_mismatches(held, device_of, shard_of) == []
    held[3] = {**held[3], "3/norm.weight": "bb"}
    (line,) = shard_mismatches(held, device_of, shard_of)
    assert line == ("layer 3 norm.weight: the tensor-parallel shards of device 2 disagree: "
                    "shards [0] (ranks [2]) hold aa; shards [1] (ranks [3]) hold bb")
    doc = {"master_problems": [], "layer_copies": {"3": "ll"}, "step_counter": 5}
    parts = {r: {**doc, "shard_replicas": held[r]} for r in range(4)}
    with pytest.raises(StateMismatch, match="layer 3 norm.weight"):
        check_replicas(parts, device_of, shard_of)
    parts[3]["shard_replicas"] = held[2]
    for r in (1, 3):  # a layer's shards differ: only each shard's holders are compared
        parts[r]["layer_copies"] = {"3": "mm"}
    check_replicas(parts, device_of, shard_of)
