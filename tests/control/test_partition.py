"""A partition among live ranks: the pure cut, the reachability probe on real sockets, and the
decision through a real TCPStore."""
import json
import socket
import time
from datetime import timedelta

import torch.distributed as dist

from elaswave.control import partition
from elaswave.control.liveness import Prober, probe_all
from tests.helpers.threads import at_once
from elaswave.control.membership import Membership, decide


def test_one_rank_cut_off_from_everyone_is_the_one_left_out():
    reports = {0: [3], 1: [3], 2: [3], 3: [0, 1, 2]}
    assert partition.cut([0, 1, 2, 3], reports) == {3: (0, 1, 2)}
    # Reported by one side only (a one-way partition) still counts.
    assert partition.cut([0, 1, 2, 3], {3: [0, 1, 2]}) == {3: (0, 1, 2)}
    assert partition.cut([0, 1, 2, 3], {1: [3], 2: [3]}) == {3: (1, 2)}


def test_a_split_keeps_the_side_with_rank_0_and_nothing_is_cut_without_reports():
    cross = {a: [b for b in range(4) if (a < 2) != (b < 2)] for a in range(4)}
    assert set(partition.cut([0, 1, 2, 3], cross)) == {2, 3}
    assert partition.cut([0, 1], {0: [1], 1: [0]}) == {1: (0,)}
    assert partition.cut([0, 1, 2], {0: [], 1: [], 2: []}) == {}
    # Ranks not live (dead, never checked in) are not in the graph: their silence is not a partition.
    assert partition.cut([0, 1, 2], {0: [5], 1: [5]}) == {}


def test_decide_leaves_out_the_cut_rank_once_settled():
    reports = {0: [3], 1: [3], 2: [3], 3: [0, 1, 2]}
    assert decide([0, 1, 2, 3], reports, set(), 0.1, 1.0, unreachable=reports) == (0, 1, 2)
    assert decide([0, 1, 2, 3], {0: [3], 1: [3]}, set(), 0.1, 1.0, unreachable={0: [3], 1: [3]}) is None


def test_a_pending_report_holds_the_decision_for_at_most_the_probe_timeout():
    # The side cut off checks in first (its probes fail at once); the others' reports are pending.
    # Deciding on the check-ins alone would keep rank 3 -- or, had the others checked in only
    # after probing, leave them out after the agree timeout and keep rank 3 alone.
    reports = {0: None, 1: None, 2: None, 3: [0, 1, 2]}
    assert decide([0, 1, 2, 3], reports, set(), 0.1, 1.0, unreachable=reports) is None
    assert decide([0, 1, 2, 3], reports, set(), 1.2, 1.0, unreachable=reports) is None
    assert decide([0, 1, 2, 3], reports, set(), 1.0 + partition.REACH_TIMEOUT_S, 1.0,
                  unreachable=reports) == (0, 1, 2)  # one-sided evidence still cuts rank 3
    assert decide([0, 1, 2, 3], {**reports, 0: [3], 1: [3], 2: [3]}, set(), 0.1, 1.0,
                  unreachable={**reports, 0: [3], 1: [3], 2: [3]}) == (0, 1, 2)


def test_probe_all_tells_answered_refused_and_silent_apart_within_one_timeout():
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen(8)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    refused_port = closed.getsockname()[1]
    closed.close()
    answers = probe_all({0: f"127.0.0.1:{listening.getsockname()[1]}", 1: f"127.0.0.1:{refused_port}",
                         2: "no-such-host.invalid:1"}, timeout_s=0.5)
    listening.close()
    assert answers == {0: True, 1: False, 2: None}


def test_check_ins_carry_reachability_and_the_cut_is_recorded():
    server = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    clients = {r: Membership(dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                           timeout=timedelta(seconds=10)), r) for r in range(4)}
    reports = {0: [3], 1: [], 2: [3], 3: [0, 1, 2]}
    def run(r):
        clients[r].check_in_reporting(1, lambda: (time.sleep(0.3 * (r != 3)), reports[r])[1])
        return clients[r].agree([0, 1, 2, 3], 1, agree_timeout_s=5.0, timeout_s=10.0)

    results = at_once(run, clients)
    assert results == {r: (0, 1, 2) for r in range(4)}
    assert json.loads(server.get("ew/ep/1/members")) == [0, 1, 2]
    assert clients[0].cut_off(1) == {3: [0, 1, 2]}
    assert "cut off from ranks [0, 1, 2]" in clients[1].death_evidence([3], 1)[3]


def test_a_prober_reports_only_silent_ranks_as_unreachable():
    server = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    live = socket.socket()
    live.bind(("127.0.0.1", 0))
    live.listen(8)
    gone = socket.socket()
    gone.bind(("127.0.0.1", 0))
    server.set("ew/live/0", f"127.0.0.1:{live.getsockname()[1]}")
    server.set("ew/live/1", f"127.0.0.1:{gone.getsockname()[1]}")
    gone.close()  # refuses: dead, not unreachable
    server.set("ew/live/2", "no-such-host.invalid:1")  # no route
    prober = Prober()
    # Rank 4 never registered; rank 2's address never worked: nothing is said of either.
    assert prober.unreachable([0, 1, 2, 4], server) == []
    assert prober.unreachable([0, 1, 2, 4], server, reached_only=False) == [2]
    live.close()  # reached before, now silent? A closed port refuses: still not unreachable
    assert prober.unreachable([0], server) == []
