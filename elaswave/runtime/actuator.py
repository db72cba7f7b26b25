"""Frequency actuators: how a planned frequency level reaches the device, behind one interface.

A level is relative to the device's nominal clock (1.0). ``none`` leaves clocks alone (CPU, or a
cluster where clocks are not ours to set), ``emulated`` is read by emulated compute, and ``nvml``
sets GPU application clocks -- which needs administrator rights on most machines, so it is never
chosen unless asked for.
"""
from __future__ import annotations

import torch


class ActuatorError(RuntimeError):
    """The actuator cannot set clocks here; the message says why and what to use instead."""


class Actuator:
    name = "none"
    level = 1.0
    """The level in effect."""

    def apply(self, level: float) -> float:
        """Ask for ``level``; returns the level now in effect (1.0 when clocks cannot change)."""
        return self.level

    def close(self) -> None:
        """Give the device its default clocks back."""


class EmulatedActuator(Actuator):
    name = "emulated"

    def apply(self, level: float) -> float:
        self.level = float(level)
        return self.level


class NvmlActuator(Actuator):
    """NVML application clocks: the graphics clock nearest below ``level`` x the default one."""

    name = "nvml"

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ActuatorError(f"frequency.actuator=nvml needs a CUDA device, this rank runs on {device}; "
                                "use frequency.actuator=none")
        try:
            import pynvml
        except ImportError:
            raise ActuatorError("frequency.actuator=nvml needs the nvidia-ml-py package "
                                "(pip install nvidia-ml-py), or use frequency.actuator=none") from None
        self.nvml = pynvml
        try:
            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            self.mem_clock = pynvml.nvmlDeviceGetDefaultApplicationsClock(self.handle, pynvml.NVML_CLOCK_MEM)
            self.nominal = pynvml.nvmlDeviceGetDefaultApplicationsClock(self.handle, pynvml.NVML_CLOCK_GRAPHICS)
            self.clocks = sorted(pynvml.nvmlDeviceGetSupportedGraphicsClocks(self.handle, self.mem_clock))
        except pynvml.NVMLError as exc:
            raise ActuatorError(f"frequency.actuator=nvml: NVML cannot read this GPU's clocks ({exc}); "
                                "use frequency.actuator=none") from None

    def apply(self, level: float) -> float:
        wanted = self.nominal * level
        clock = max((c for c in self.clocks if c <= wanted), default=self.clocks[0])
        try:
            self.nvml.nvmlDeviceSetApplicationsClocks(self.handle, self.mem_clock, clock)
        except self.nvml.NVMLError as exc:
            raise ActuatorError(f"frequency.actuator=nvml: setting {clock} MHz was refused ({exc}); setting "
                                "application clocks usually needs root (nvidia-smi -acp UNRESTRICTED), or use "
                                "frequency.actuator=none") from None
        self.level = clock / self.nominal
        return self.level

    def close(self) -> None:
        try:
            self.nvml.nvmlDeviceResetApplicationsClocks(self.handle)
        except self.nvml.NVMLError:
            pass


def make(name: str, device: torch.device) -> Actuator:
    """``name``: a resolved actuator (none, emulated or nvml; see JobConfig.actuator)."""
    if name == "emulated":
        return EmulatedActuator()
    if name == "nvml":
        return NvmlActuator(device)
    return Actuator()
