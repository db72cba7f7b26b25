"""Where a rank of a tensor-parallel job sits: founding devices by arithmetic, joined ones by the
table, and the plan of devices every slice maps alike."""
from dataclasses import replace

import pytest

from elaswave.plan.plan import initial_plan
from elaswave.tensor.layout import Devices, founding_slice


def _plan(devices: int, dp: int, pp: int):
    return initial_plan(devices, dp, pp, [1.0] * 6, 4, [64] * 6, 32)


def test_founding_devices_are_tp_consecutive_ranks():
    d = Devices.founding(8, 2)
    assert d.tensor_group(5) == (4, 5) and d.shard_of(5) == 1 and d.head_of(5) == 4
    assert d.on_shard_of(4, 1) == 5
    slice1 = founding_slice(_plan(4, 2, 2), 1, 2)
    assert slice1.pipelines == ((1, 3), (5, 7))
    # Any slice's plan maps to any other's, and shard 0's is the plan of devices.
    assert d.on_slice(slice1, 0).pipelines == ((0, 2), (4, 6))
    assert d.every_rank(slice1) == tuple(range(8))


def test_joined_ranks_make_whole_devices_in_admission_order():
    d = Devices.founding(4, 2).keeping([0, 1])  # device 2-3 lost a rank
    grown = d.joined([9, 7])
    assert grown.tensor_group(7) == (9, 7) and grown.shard_of(9) == 0 and grown.shard_of(7) == 1
    assert grown.head_of(7) == 9
    with pytest.raises(ValueError, match="whole devices of 2"):
        d.joined([9])
    # A slice's plan with the new device maps to the other slice by the table, not by arithmetic.
    plan = _plan(2, 2, 1)
    dev = founding_slice(plan, 0, 2)
    dev = replace(dev, pipelines=((0,), (9,)),
                  chunk_owners=tuple(tuple(9 if r == 2 else r for r in row) for row in dev.chunk_owners))
    assert grown.on_slice(dev, 1).pipelines == ((1,), (7,))
    assert grown.every_rank(dev) == (0, 1, 7, 9)


def test_a_device_missing_a_rank_is_not_whole():
    d = Devices.founding(6, 2).joined([10, 11])
    whole, orphans = d.whole([0, 1, 2, 5, 10, 11])
    assert whole == (0, 1, 10, 11) and orphans == (2, 5)
    assert d.keeping(whole).groups == ((0, 1), (10, 11))
    assert d.device_speeds({0: 2.0, 1: 1.0, 10: 3.0, 11: 4.0}) == {0: 1.0, 10: 3.0}


def test_degree_one_keeps_no_table():
    d = Devices.founding(4, 1)
    assert d.groups == () and d.shard_of(3) == 0 and d.head_of(3) == 3 and d.tensor_group(3) == (3,)
    assert d.whole([0, 3]) == ((0, 3), ()) and d.joined([7]) is d
    assert Devices.from_doc(2, Devices.founding(4, 2).to_doc()) == Devices.founding(4, 2)

