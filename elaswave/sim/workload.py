"""The modelled job: a model of a given shape on devices of a given speed, as a ClusterModel (pure).

Layer times come from the model contract's cost profile (the planner's: multiply-adds per token)
at an assumed sustained device throughput; communication from its activation and parameter
sizes. The named shapes are the model presets (``model.preset``): one source of truth.
"""
from __future__ import annotations

from dataclasses import dataclass

from elaswave.model.config import PRESETS, ModelConfig, preset
from elaswave.model.registry import family
from elaswave.sim.model import ClusterModel

MODELS: dict[str, ModelConfig] = {name: preset(name) for name in PRESETS}


@dataclass(frozen=True)
class Hardware:
    device_tflops: float = 300.0
    """Peak dense throughput of one device (bf16)."""
    efficiency: float = 0.4
    """Sustained share of the peak in a layer's forward and backward."""
    devices_per_node: int = 8
    intra_node_gb_s: float = 200.0
    inter_node_gb_s: float = 25.0
    activation_bytes_per_value: int = 2


def layer_numels(m: ModelConfig) -> list[int]:
    return [c.num_params for c in family(m).layer_costs()]


def cluster(m: ModelConfig, micro_batch_size: int = 1, hw: Hardware = Hardware()) -> ClusterModel:
    tokens = micro_batch_size * m.seq_len
    flops_s = hw.device_tflops * 1e12 * hw.efficiency
    costs = family(m).layer_costs()
    forward = tuple(2.0 * c.flops_per_token * tokens / flops_s for c in costs)
    return ClusterModel(
        layer_forward_s=forward, backward_factor=2.0,
        activation_bytes=float(tokens * m.d_model * hw.activation_bytes_per_value),
        layer_param_bytes=tuple(4.0 * c.num_params for c in costs),
        devices_per_node=hw.devices_per_node,
        intra_node_bytes_per_s=hw.intra_node_gb_s * 1e9, inter_node_bytes_per_s=hw.inter_node_gb_s * 1e9)


def choose_layout(devices: int, num_layers: int) -> tuple[int, int]:
    """(dp, pp): the deepest pipeline up to 16 stages (and the model's layers) that divides the
    devices and leaves at least two pipelines; one pipeline of every device if none does."""
    for pp in range(min(16, num_layers, devices // 2), 0, -1):
        if devices % pp == 0 and devices // pp >= 2:
            return devices // pp, pp
    return 1, min(devices, num_layers)
