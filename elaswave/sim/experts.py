"""What expert parallelism's all-to-alls move and cost (expert/exchange.py), priced from the
model's shape and a balanced router -- the simulator's assumption, checked against the runtime's
counted bytes (tests/runtime/test_expert_parallel.py).

Each forward of an MoE block sends a rank's rows to their experts' owners (dispatch) and takes
the outputs back (combine); its backward does both again with gradients. A row is one token's
assignment to one expert (top-k of them a token), ``d_model`` values wide. Of a rank's rows, those
of its own experts stay: a balanced router over an even placement sends (n - 1) / n of them.
"""
from __future__ import annotations

EXCHANGES = 4
"""Per MoE block's forward and backward: dispatch and combine, each way."""


def exchange_bytes(tokens: int, top_k: int, d_model: int, value_bytes: int, members: int, moe_blocks: int,
                   recomputed_moe_blocks: int = 0) -> float:
    """Bytes one rank sends its group in a step: ``tokens`` (the rank's, in the step), each of its
    ``moe_blocks`` blocks 4 exchanges, a recomputed block's forward 2 more."""
    if members <= 1:
        return 0.0
    rows = tokens * top_k * (members - 1) / members
    exchanges = EXCHANGES * moe_blocks + 2 * recomputed_moe_blocks
    return rows * d_model * value_bytes * exchanges


def exchange_s(tokens: int, top_k: int, d_model: int, value_bytes: int, members: int, moe_blocks: int,
               link_gbps: float, recomputed_moe_blocks: int = 0) -> float:
    """The step's all-to-all time on a link of ``link_gbps`` GB/s each way, nothing overlapped
    (the runtime waits for each exchange before the experts compute)."""
    sent = exchange_bytes(tokens, top_k, d_model, value_bytes, members, moe_blocks, recomputed_moe_blocks)
    return sent / (link_gbps * 1e9) if sent else 0.0


def busiest_owner_s(model, plan, rank: int, i: int, j: int) -> float:
    """What ``rank`` waits in layers ``i..j`` for its group's busiest owner over a balanced
    placement's time (``ClusterModel``, ``Plan``): each MoE layer's expert compute -- its share of
    the layer's forward, its backward, and its forward again where the block is recomputed whole
    (configured, or chosen by the plan; selective's attention core runs no expert) -- times that
    member's share of the layer's experts over an even one (``Plan.expert_imbalance``; a balanced
    router gives each expert as many tokens), less one; at the rank's clock."""
    group, extra = plan.expert_group[rank], 0.0
    chosen = plan.recomputed_of(rank)
    for layer in range(i, j):
        share = model.layer_expert_share[layer]
        busiest = plan.expert_imbalance.get((group, layer), 1.0) if share else 1.0
        if busiest > 1.0:
            runs = 1 + model.backward_factor + model.layer_expert_again[layer] + model.recompute_runs * (layer in chosen)
            extra += share * (busiest - 1.0) * model.layer_forward_s[layer] * runs
    return extra / model.power.speed(plan.frequency(rank))
