"""The state digest and the replica check (pure)."""
from elaswave.zero.digest import replica_mismatches, state_sha256


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
