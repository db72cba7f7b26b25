"""The modelled job: a model of a given shape on devices of a given speed, as a ClusterModel (pure).

Layer times come from the model contract's cost profile (the planner's: multiply-adds per token)
at an assumed sustained device throughput; communication from its activation and parameter
sizes. The named shapes are the model presets (``model.preset``): one source of truth.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from elaswave.config import TrainConfig
from elaswave.model.config import PRESETS, ModelConfig, preset
from elaswave.model.registry import family
from elaswave.model.units import Units, units_of
from elaswave.sim.model import ClusterModel, ring_s

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


HARDWARE: dict[str, Hardware] = {
    "generic": Hardware(),
    # H100 SXM 80 GB from published measurements, none fitted to a training run's throughput:
    # - 989 TFLOP/s: the dense bf16 peak.
    # - efficiency 0.75: cuBLAS bf16 GEMMs on an H100 SXM reach 741 TFLOP/s at 6144^3 and 798 at
    #   8192^3 (github.com/pranjalssh/fast.cu, README, kernel 0 = cuBLAS); FlashAttention-3 reaches
    #   661 TFLOP/s forward at head dim 128 (arXiv:2407.08608, table 2; "80-90 %" for GEMMs, §1).
    #   One share for a layer's matrix products and attention alike: 0.75, between the two.
    # - 370 GB/s in a node: NCCL's effective ring bandwidth over NVLink 4 (450 GB/s line rate a
    #   direction, ~20 % protocol overhead; NCCL's maintainer in NVIDIA/nccl-tests issue 212).
    # - 50 GB/s between nodes: 400 Gb/s a GPU (Llama 3's RoCE and InfiniBand clusters,
    #   arXiv:2407.21783 §3.3.1), at line rate -- no achieved figure was found published.
    "h100": Hardware(device_tflops=989.0, efficiency=0.75, intra_node_gb_s=370.0, inter_node_gb_s=50.0),
}
"""``elaswave simulate --hardware``: the device and links every layer time and transfer is priced on."""


def model_flops_per_micro_batch(m: ModelConfig, micro_batch_size: int) -> float:
    """A micro-batch's forward and backward floating-point operations as MFU counts them (two per
    multiply-add, the backward twice the forward; attention over the whole sequence)."""
    return 6.0 * sum(c.flops_per_token for c in family(m).layer_costs()) * micro_batch_size * m.seq_len


def layer_numels(m: ModelConfig) -> list[int]:
    return [c.num_params for c in family(m).layer_costs()]


_UNITS: dict[str, Units] = {}


def model_units(m: ModelConfig) -> Units:
    """The model's units (model/units.py: a mixture of experts' experts each its own; a dense
    model's are its layers), counted once per shape (a 235B model's 12,032 experts: seconds)."""
    key = repr(m)  # (a config is not hashable; its repr names every field)
    if key not in _UNITS:
        _UNITS[key] = units_of(family(m))
    return _UNITS[key]


def cluster(m: ModelConfig, micro_batch_size: int = 1, hw: Hardware = Hardware(), tp: int = 1,
            schedule: str = "1f1b", checkpointing: str = "none", ep: int = 1) -> ClusterModel:
    """The job on ``hw``, its pipelines running ``schedule`` (``parallel.schedule``); with ``tp`` > 1
    each device of the plan is a tensor-parallel group of ``tp`` GPUs in one node
    (:func:`tp_all_reduces`): Megatron's split with sequence parallelism, so a layer's compute,
    parameters, gradients and the activation sent between stages are each GPU's ``1/tp`` share,
    the groups' shards sum their gradients over data parallelism side by side, and a node holds
    ``devices_per_node / tp`` groups. ``checkpointing`` (``train.activation_checkpointing``) prices
    what recomputation runs again in each layer's backward (:func:`recompute_s`). A mixture of
    experts: each unit's parameters (an expert held by its owners alone, plan/experts.py) and, with
    ``ep`` > 1, each MoE layer's all-to-all (:attr:`ClusterModel.layer_exchange_bytes`); its
    compute is its top-k experts' on a balanced router's share."""
    if tp < 1 or hw.devices_per_node % tp:
        raise ValueError(f"tp={tp} is invalid: a TP group is GPUs of one node, so it must divide "
                         f"the {hw.devices_per_node} GPUs per node")
    tokens = micro_batch_size * m.seq_len
    flops_s = hw.device_tflops * 1e12 * hw.efficiency
    costs = family(m).layer_costs()
    forward = tuple(2.0 * c.flops_per_token * tokens / flops_s / tp for c in costs)
    activation = float(tokens * m.d_model * hw.activation_bytes_per_value)
    model = ClusterModel(
        layer_forward_s=forward, backward_factor=2.0, activation_bytes=activation / tp,
        layer_param_bytes=tuple(4.0 * n / tp for n in model_units(m).numels),
        devices_per_node=hw.devices_per_node // tp,
        intra_node_bytes_per_s=hw.intra_node_gb_s * 1e9, inter_node_bytes_per_s=hw.inter_node_gb_s * 1e9,
        pipeline_schedule=schedule)
    if ep > 1:  # a rank's rows to their experts' owners and back, each a d_model-wide row per top-k pick
        moe = set(model_units(m).expert_layers)
        rows = tokens * m.experts_per_token * m.d_model * hw.activation_bytes_per_value
        # Dispatch and combine in the forward and the backward, and again in a recomputed block's forward.
        train = TrainConfig(activation_checkpointing=checkpointing)
        again = [checkpointing != "selective" and checkpointing != "none" and train.checkpointed(i, len(costs))
                 for i in range(len(costs))]
        model = replace(model, layer_exchange_bytes=tuple(
            2.0 * rows * (2 + model.recompute_runs * again[i]) if i in moe else 0.0 for i in range(len(costs))),
            # (each expert a token's share: a balanced router's, the layer's top-k expert MLPs over its flops)
            layer_expert_share=tuple(m.experts_per_token * 3 * m.d_model * m.expert_ffn_width / costs[i].flops_per_token
                                     if i in moe else 0.0 for i in range(len(costs))),
            layer_expert_again=tuple(float(model.recompute_runs * again[i]) for i in range(len(costs))))
    if tp > 1:
        # An all-reduce is a ring reduce-scatter and a ring all-gather.
        ring = 2 * ring_s(tp, activation, model.intra_node_latency_s, model.intra_node_bytes_per_s)
        model = replace(model, layer_tp_s=tuple(ring * n for n in tp_all_reduces(len(costs))))
    core = tuple(2.0 * c.core_flops_per_token * tokens / flops_s / tp for c in costs)
    again, again_tp = recompute_s(checkpointing, forward, core, model.layer_tp_s)
    if checkpointing != "selective" and model.recompute_runs > 1:  # ZB-H1 runs a recomputed block twice
        again, again_tp = (tuple(model.recompute_runs * x for x in t) for t in (again, again_tp))
    return replace(model, layer_recompute_s=again, layer_recompute_tp_s=again_tp)


def recompute_s(checkpointing: str, forward: tuple[float, ...], core: tuple[float, ...],
                tp_s: tuple[float, ...] = ()) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """What each layer runs again in its backward under ``checkpointing``, as (kernels, the
    tensor-parallel collectives among them): a recomputed block (``full``, ``every_N``:
    ``TrainConfig.checkpointed``) its whole forward, collectives included; ``selective`` each
    block's attention core (``core``: its forward time), which has no collective; ``none``
    nothing. Empty tuples where nothing is run again."""
    n = len(forward)
    if checkpointing == "selective":
        return tuple(core), ()
    train = TrainConfig(activation_checkpointing=checkpointing)
    again = [train.checkpointed(i, n) for i in range(n)]
    if not any(again):
        return (), ()
    return (tuple(f if a else 0.0 for f, a in zip(forward, again)),
            tuple(t if a else 0.0 for t, a in zip(tp_s, again)))


def tp_all_reduces(num_layers: int) -> list[float]:
    """One micro-batch's activation moved inside the TP group per layer in the forward, in
    all-reduces' worth, as Megatron splits layers with sequence parallelism (a reduce-scatter or
    an all-gather moves half an all-reduce's bytes): the embedding's output reduce-scattered (1/2),
    a block's attention and MLP each gathering their input and reduce-scattering their output (2),
    the head gathering its input (1/2; its vocabulary-parallel loss sums only per-token scalars)."""
    return [0.5] + [2.0] * (num_layers - 2) + [0.5]



def choose_layout(devices: int, num_layers: int) -> tuple[int, int]:
    """(dp, pp): the deepest pipeline up to 16 stages (and the model's layers) that divides the
    devices and leaves at least two pipelines; one pipeline of every device if none does."""
    for pp in range(min(16, num_layers, devices // 2), 0, -1):
        if devices % pp == 0 and devices // pp >= 2:
            return devices // pp, pp
    return 1, min(devices, num_layers)
