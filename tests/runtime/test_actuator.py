"""Frequency actuators: the one interface, and clear refusals where clocks cannot be set."""
import pytest
import torch

from elaswave import config
from elaswave.config import ConfigError
from elaswave.runtime import actuator


def test_auto_resolves_to_emulated_only_under_emulation():
    assert config.load(None, []).actuator == "none"
    assert config.load(None, ["emulate.enabled=true"]).actuator == "emulated"
    assert config.load(None, ["frequency.actuator=nvml"]).actuator == "nvml"


def test_none_keeps_nominal_and_emulated_takes_the_level():
    none = actuator.make("none", torch.device("cpu"))
    assert none.apply(1.2) == 1.0 and none.level == 1.0
    emulated = actuator.make("emulated", torch.device("cpu"))
    assert emulated.apply(0.7) == 0.7 and emulated.level == 0.7


def test_nvml_on_a_cpu_rank_is_refused_with_what_to_use_instead():
    with pytest.raises(actuator.ActuatorError, match="needs a CUDA device.*frequency.actuator=none"):
        actuator.make("nvml", torch.device("cpu"))


@pytest.mark.parametrize("sets,needle", [
    (["frequency.actuator=emulated"], "needs emulate.enabled=true"),
    (["frequency.actuator=turbo"], "must be one of auto, none, emulated, nvml"),
    (["frequency.power_cap_w=-1"], "must be >= 0"),
    (["emulate.block_forward_ms=0"], "must be > 0"),
    (["emulate.link_gbps=-1"], r"emulate.link_gbps=-1.0 is invalid: must be >= 0"),
])
def test_bad_frequency_and_emulation_settings_are_one_line_errors(sets, needle):
    with pytest.raises(ConfigError, match=needle):
        config.load(None, sets)
