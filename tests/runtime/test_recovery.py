"""The recovery record (pure): a change cut short before its first step is carried into the next."""
import pytest

from elaswave.runtime.recovery import Recovery


def test_a_change_cut_short_is_in_the_next_record():
    first = Recovery(1, [1], 12, fault_wall=100.0, noticed_wall=100.05, phases_s={"agree": 0.01, "state": 0.02},
                     evidence={1: "was killed by SIGKILL"}, lost_hosts={1: "node 0 (n1)"})
    second = Recovery(2, [3, 4], 12, fault_wall=100.4, noticed_wall=100.45, phases_s={"agree": 0.02, "state": 0.03},
                      evidence={3: "refused connections (probed by rank 0)"}, lost_hosts={3: "node 1 (n2)", 4: "node 1 (n2)"})
    rec = second.absorb(first).record(first_step_end_wall=100.6, first_step_s=0.1)
    assert rec["lost_ranks"] == [1, 3, 4] and rec["num_changes"] == 2
    assert rec["lost_hosts"] == {"node 0 (n1)": [1], "node 1 (n2)": [3, 4]}  # where each lost rank ran
    assert rec["evidence"] == {"1": "was killed by SIGKILL", "3": "refused connections (probed by rank 0)"}
    assert rec["mttr_s"] == pytest.approx(0.6)  # from the first fault
    assert rec["phases_s"]["interrupted"] == pytest.approx(0.4)  # the first change, until the second fault
    assert rec["phases_s"]["detect"] == pytest.approx(0.05)


def test_three_changes_in_a_row_are_timed_from_the_first():
    a = Recovery(1, [1], 5, fault_wall=10.0, noticed_wall=10.1)
    b = Recovery(2, [2], 5, fault_wall=11.0, noticed_wall=11.1).absorb(a)
    c = Recovery(3, [4], 5, fault_wall=None, noticed_wall=12.0).absorb(b)
    rec = c.record(first_step_end_wall=12.5, first_step_s=0.3)
    assert rec["lost_ranks"] == [1, 2, 4] and rec["num_changes"] == 3
    assert rec["mttr_s"] == pytest.approx(2.5) and rec["phases_s"]["interrupted"] == pytest.approx(2.0)
