"""Emulated compute: modelled times follow the cost profile and the frequency level."""
import time

import pytest

from elaswave import config
from elaswave.pipeline.emulate import EmulatedCompute, layer_forward_s
from elaswave.runtime.actuator import EmulatedActuator


def test_layer_times_follow_the_planner_cost_profile():
    cfg = config.load(None, ["emulate.block_forward_ms=10"])
    times = layer_forward_s(cfg)
    assert len(times) == cfg.model.num_layers
    assert times[1:-1] == [pytest.approx(0.010)] * cfg.model.num_blocks
    assert 0 < times[0] < times[1]  # the embedding is cheap


def test_a_lower_level_takes_longer():
    act = EmulatedActuator()
    compute = EmulatedCompute([0.02, 0.02], 2.0, [(0, 2)], act)
    took = {}
    for level in (1.0, 0.5):
        act.apply(level)
        began = time.perf_counter()
        compute.forward(began)
        compute.backward(time.perf_counter())
        took[level] = time.perf_counter() - began
    # forward 40 ms + backward 80 ms at nominal; sleeps never end early.
    assert took[1.0] >= 0.12 and took[0.5] >= 0.24
