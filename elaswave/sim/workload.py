"""The modelled job: a GPT of a given shape on devices of a given speed, as a ClusterModel (pure).

Layer times come from the model's cost profile (the planner's, :func:`layer_flops`: multiply-adds
per token) at an assumed sustained device throughput; communication from its activation and
parameter sizes. The named shapes are the usual GPT-3 family sizes.
"""
from __future__ import annotations

from dataclasses import dataclass

from elaswave.config import ModelConfig
from elaswave.model.gpt import layer_flops
from elaswave.sim.model import ClusterModel

MODELS = {
    "gpt-1.3b": ModelConfig(vocab_size=50257, seq_len=2048, d_model=2048, num_heads=16, num_blocks=24, dropout=0.0),
    "gpt-13b": ModelConfig(vocab_size=50257, seq_len=2048, d_model=5120, num_heads=40, num_blocks=40, dropout=0.0),
    "gpt-175b": ModelConfig(vocab_size=50257, seq_len=2048, d_model=12288, num_heads=96, num_blocks=96, dropout=0.0),
}


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


def layer_numel(m: ModelConfig, index: int) -> int:
    d = m.d_model
    if index == 0:
        return m.vocab_size * d + m.seq_len * d
    if index == m.num_layers - 1:
        return 2 * d + d * m.vocab_size + m.vocab_size
    return 12 * d * d + 13 * d


def gpt_cluster(m: ModelConfig, micro_batch_size: int = 1, hw: Hardware = Hardware()) -> ClusterModel:
    tokens = micro_batch_size * m.seq_len
    flops_s = hw.device_tflops * 1e12 * hw.efficiency
    forward = tuple(2.0 * layer_flops(m, i) * tokens / flops_s for i in range(m.num_layers))
    return ClusterModel(
        layer_forward_s=forward, backward_factor=2.0,
        activation_bytes=float(tokens * m.d_model * hw.activation_bytes_per_value),
        layer_param_bytes=tuple(4.0 * layer_numel(m, i) for i in range(m.num_layers)),
        devices_per_node=hw.devices_per_node,
        intra_node_bytes_per_s=hw.intra_node_gb_s * 1e9, inter_node_bytes_per_s=hw.inter_node_gb_s * 1e9)


def choose_layout(devices: int, num_layers: int) -> tuple[int, int]:
    """(dp, pp): the deepest pipeline up to 16 stages (and the model's layers) that divides the
    devices and leaves at least two pipelines; one pipeline of every device if none does."""
    for pp in range(min(16, num_layers, devices // 2), 0, -1):
        if devices % pp == 0 and devices // pp >= 2:
            return devices // pp, pp
    return 1, min(devices, num_layers)
