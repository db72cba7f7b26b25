"""Spares and the store's host, priced: the trace rewrite, the policies' answers, bad input."""
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from elaswave import cli
from elaswave.plan.plan import initial_plan
from elaswave.sim import policies, trace
from elaswave.sim.control import Control, ControlCosts, slot_events
from elaswave.sim.engine import simulate
from elaswave.sim.model import ClusterModel

# 16 devices on two hosts of 8: devices 0-7 share the store's host.
MODEL = ClusterModel(layer_forward_s=(0.01,) * 8, layer_param_bytes=(4e6,) * 8, step_overhead_s=0.05)
PLAN = initial_plan(16, 4, 4, [1.0] * 8, 64, [10**6] * 8, 1 << 16)


def _run(name, events, control=Control(), hours=1.0, model=MODEL):
    policy = policies.make(name, PLAN, 64, model, policies.BaselineCosts(), control)
    return simulate(events, policy, model, hours * 3600)


def test_the_pool_fills_failed_slots_and_takes_repaired_devices_back():
    events = [trace.Event(10.0, "fail", 3), trace.Event(20.0, "fail", 9),
              trace.Event(100.0, "join", 3), trace.Event(200.0, "join", 9), trace.Event(300.0, "fail", 5)]
    assert slot_events(events, 0, 0.3) == events  # no spares: the trace as it was
    # One spare: slot 3 is refilled 0.3 s later; slot 9 waits for a device back from repair --
    # the first one back (device 3's) fills it; device 9's repair refills the pool, which meets
    # the next failure.
    assert slot_events(events, 1, 0.3) == [trace.Event(10.0, "fail", 3), trace.Event(10.3, "spare", 3),
                                           trace.Event(20.0, "fail", 9), trace.Event(100.0, "join", 9),
                                           trace.Event(300.0, "fail", 5), trace.Event(300.3, "spare", 5)]
    many = trace.poisson(16, 2.0, 48, 12.0, seed=3)
    for spares in (0, 1, 4):
        slots = slot_events(many, spares, 0.3)
        down: set[int] = set()
        for e in slots:  # every failure is of a slot up, every arrival into a slot down
            assert (e.device not in down) if e.kind == "fail" else (e.device in down), (spares, e)
            (down.add if e.kind == "fail" else down.discard)(e.device)
        assert sum(e.kind == "fail" for e in slots) == sum(e.kind == "fail" for e in many)


def test_zero_spares_is_plain_elaswave():
    events = trace.poisson(16, 4.0, 12, 4.0, seed=1)
    plain = _run("elaswave", events, control=None, hours=12).to_doc()
    assert _run("elaswave", events, Control(spares=0), hours=12).to_doc() == plain


def test_spares_raise_the_ettr_when_failures_are_frequent_and_repairs_slow():
    events = trace.poisson(16, 4.0, 24, 12.0, seed=2)
    none = _run("elaswave", events, hours=24)
    warm = _run("elaswave", events, Control(spares=4), hours=24)
    cold = _run("elaswave", events, Control(spares=4, warm=False), hours=24)
    assert none.failures == warm.failures > 5
    assert warm.ettr > none.ettr + 0.01 and warm.ettr > cold.ettr
    # The spares are idle hardware: over every device held they are charged.
    assert warm.ettr_all_devices == pytest.approx(warm.ettr * 16 / 20)
    assert none.ettr_all_devices == none.ettr == none.goodput


def test_a_restart_takes_its_spare_into_the_restart_under_way():
    """With a pool that never runs dry, each failure costs a restart exactly one restart and the
    work since the checkpoint -- the spare's arrival no second one -- and never a smaller layout."""
    events, base = trace.poisson(16, 40.0, 24, 12.0, seed=2), policies.BaselineCosts()
    restart, spared = _run("restart", events, hours=24), _run("restart", events, Control(spares=16), hours=24)
    assert spared.failures == restart.failures > 5
    assert spared.productive_lost_per_failure_s == pytest.approx(base.restart_s + base.checkpoint_every_s / 2, rel=1e-3)
    assert spared.ettr > restart.ettr


def test_a_store_host_loss_costs_the_floor_a_restart_and_failover_less():
    costs, base = ControlCosts(), policies.BaselineCosts()
    step_s = 64 / _run("elaswave", []).throughput_before
    on_host = trace.single_failure(5, 600.0)  # device 5 shares host 0 with the store
    ordinary = _run("elaswave", on_host)  # store dedicated: its host is outside the trace
    floor = _run("elaswave", on_host, Control(store="floor"))
    failover = _run("elaswave", on_host, Control(store="failover"))
    assert (ordinary.store_losses, floor.store_losses, failover.store_losses) == (0, 1, 1)
    # The floor: heartbeat timeout + checkpoint write + restart; only the interrupted step redone.
    assert floor.time_lost_per_failure_s == pytest.approx(
        costs.store_detect_s + costs.checkpoint_write_s + base.restart_s + step_s / 2)
    assert failover.time_lost_per_failure_s == pytest.approx(
        ordinary.time_lost_per_failure_s + costs.store_detect_s + costs.store_move_s)
    assert ordinary.time_lost_per_failure_s < failover.time_lost_per_failure_s < floor.time_lost_per_failure_s
    assert floor.time_lost_per_failure_s < _run("restart", on_host).time_lost_per_failure_s
    # A spare's arrival in the lost device's place is a join, not a second loss of the store.
    spared = _run("elaswave", on_host, Control(spares=1, store="floor"))
    assert spared.store_losses == 1 and spared.joins == 1
    policy = policies.make("elaswave", PLAN, 64, MODEL, base, Control(spares=1, store="floor"))
    arrival = policy.respond(policy.layout([r for r in range(16) if r != 5]), list(range(16)),
                             trace.Event(600.3, "spare", 5), step_s)
    assert not arrival.store_lost and arrival.downtime_s < 1.0
    # A failure on the other host leaves the store alone.
    assert _run("elaswave", trace.single_failure(13, 600.0), Control(store="floor")).store_losses == 0


def test_the_defaults_are_the_measured_figures_they_cite():
    from elaswave.control.config import ElasticConfig
    assert ControlCosts().store_detect_s == ElasticConfig().heartbeat_timeout_s
    joins = (Path(__file__).parents[2] / "bench" / "results" / "join.md").read_text()
    spare = re.search(r"^\| spare \| ([0-9.]+) s", joins, re.M)
    cold = re.search(r"^\| replacement \| ([0-9.]+) s", joins, re.M)
    assert (float(spare[1]), float(cold[1])) == (ControlCosts().warm_join_s, ControlCosts().cold_join_s)


@pytest.mark.parametrize("kwargs,needle", [
    ({"spares": -1}, "spares=-1 is invalid"), ({"spares": 2.5}, "spares=2.5 is invalid"),
    ({"store": "raft"}, "store='raft' is invalid: choose from dedicated, floor, failover"),
    ({"costs": replace(ControlCosts(), store_move_s=-1.0)}, "costs.store_move_s=-1.0 is invalid"),
])
def test_bad_control_options_name_the_value(kwargs, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        Control(**kwargs)


def test_only_elaswave_models_the_store():
    with pytest.raises(ValueError, match="store='floor' is invalid for policy restart"):
        policies.make("restart", PLAN, 64, MODEL, policies.BaselineCosts(), Control(store="floor"))


SMALL = ["simulate", "--devices", "16", "--dp", "4", "--pp", "4", "--model", "gpt-1.3b",
         "--mtbf-h", "20", "--hours", "12"]


def test_simulate_prices_spares_and_the_store(capsys):
    assert cli.main([*SMALL, "--spares", "2", "--store", "failover", "--policies", "elaswave,restart", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["config"]["spares"], doc["config"]["store"]) == (2, "failover")
    for p in doc["policies"].values():
        assert p["spares"] == 2 and p["ettr_all_devices"] == pytest.approx(p["ettr"] * 16 / 18)
    assert doc["policies"]["restart"]["store_losses"] == 0


@pytest.mark.parametrize("argv,needle", [
    (["--spares", "-1"], "--spares=-1 is invalid"),
    (["--store", "raft"], "--store=raft is invalid: choose from dedicated, floor, failover"),
    (["--cold-spares"], "--cold-spares is invalid with --spares=0"),
    (["--store", "floor", "--policies", "restart"], "--store=floor is invalid with --policies=restart"),
])
def test_bad_spares_and_store_flags_are_one_line(argv, needle, capsys):
    assert cli.main([*SMALL, *argv]) == 2
    assert needle in capsys.readouterr().err
