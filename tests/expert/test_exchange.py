"""Expert parallelism's all-to-all between real gloo ranks: each rank's block output, input
gradient and router gradient, and every expert's fixed-point weight gradient, equal the
reference's (every expert on one rank, each rank's rows a micro-batch of their own) bit for bit."""
import gc
from types import SimpleNamespace

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from elaswave.expert import exchange
from elaswave.expert.exchange import AllToAll
from elaswave.model.moe import SparseMoE
from elaswave.model.recompute import checkpointed
from elaswave.plan.experts import place
from tests.helpers.spawn import run_group

ME = "tests.expert.test_exchange"
BITS = 30


def _block(num_experts: int) -> SparseMoE:
    torch.manual_seed(0)
    m = SimpleNamespace(d_model=16, num_experts=num_experts, experts_per_token=2, moe_norm_topk=True,
                        expert_ffn_width=24, moe_names="qwen", shared_expert_ffn_dim=0)
    return SparseMoE(m)


def _rows(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(3, 5, 16, generator=g)
    x[..., 0] += 2.0 * rank  # ranks route differently: some send an expert nothing
    return x.requires_grad_(True)


def _fixed(g: torch.Tensor) -> torch.Tensor:
    return torch.round(g.double() * 2 ** BITS).to(torch.int64)


def _expert_grads(block, e: int) -> torch.Tensor:
    ps = list(block.experts[e].parameters())
    out = torch.cat([_fixed(p.grad).reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=torch.int64)
                     for p in ps])
    for p in ps:
        p.grad = None
    return out


def _run(block, x: torch.Tensor, sums: dict[int, torch.Tensor] | None = None, recompute: bool = False) -> dict:
    out = checkpoint(checkpointed(block), x, use_reentrant=False) if recompute else block(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    if sums is not None:  # the reference: one fold of every expert per micro-batch
        for e in range(block.num_experts):
            sums[e] = sums.get(e, 0) + _expert_grads(block, e)
    return {"out": out.detach(), "x_grad": x.grad, "gate_grad": block.gate.weight.grad}


def exchange_rank(group, num_experts: int, loads: list[float] | None, recompute: bool = False):
    block = _block(num_experts)
    owners = place(num_experts, group.size, loads)
    sums: dict[int, torch.Tensor] = {}

    def fold(e: int) -> None:
        sums[e] = sums.get(e, 0) + _expert_grads(block, e)

    block.exchange = AllToAll(group, owners, fold)
    got = _run(block, _rows(group.group_rank), recompute=recompute)
    got["sums"] = sums
    got["owners"] = owners
    got["rows_seen"] = block.exchange.take_rows()
    got["bytes"] = group.payload_bytes
    return got


@pytest.mark.parametrize("size,num_experts,loads,recompute", [
    (2, 4, None, False),  # contiguous blocks
    (3, 8, [40.0, 1.0, 1.0, 1.0, 30.0, 1.0, 1.0, 1.0], False),  # by load: the two hot experts apart
    (2, 4, None, True),  # the block recomputed in the backward: rows kept, experts run again
], ids=["2-ranks-blocks", "3-ranks-by-load", "2-ranks-recomputed"])
def test_experts_over_ranks_give_the_references_bits(tmp_path, size, num_experts, loads, recompute):
    results = run_group(f"{ME}:exchange_rank", size, tmp_path, num_experts=num_experts, loads=loads,
                        recompute=recompute)
    torch.set_num_threads(1)  # as the ranks compute
    block, sums, routed = _block(num_experts), {}, torch.zeros(num_experts)
    for rank, got in enumerate(results):
        x = _rows(rank)
        ref = _run(block, x, sums)
        for key in ("out", "x_grad", "gate_grad"):
            assert torch.equal(got[key], ref[key]), (rank, key)
        block.gate.weight.grad = None
        with torch.no_grad():
            chosen = torch.topk(torch.softmax(block.gate(x.reshape(-1, 16)), -1), 2).indices
        routed += torch.bincount(chosen.reshape(-1), minlength=num_experts)
        seen = routed * (2 if recompute else 1)  # a recomputation exchanges its counts again
        assert got["rows_seen"] == seen.tolist() if rank == size - 1 else True
        assert got["bytes"] > 0
    owners = results[0]["owners"]
    assert all(r["owners"] == owners for r in results) and len(set(owners)) == size
    for e in range(num_experts):  # each expert folded only where it computes, once per member's rows
        held = [r["sums"][e] for r in results if e in r["sums"]]
        assert len(held) == 1 and [r for r in results if e in r["sums"]][0] is results[owners[e]]
        assert torch.equal(held[0], sums[e]), e
        assert held[0].abs().sum() > 0
    assert all(rs["rows_seen"] == results[0]["rows_seen"] for rs in results)
    assert results[0]["rows_seen"] == (routed * (2 if recompute else 1)).tolist()


def test_the_local_exchange_is_the_blocks_plain_computation():
    """ep = 1: the Function-wrapped block equals calling each expert in the graph directly."""
    block, x = _block(4), _rows(1)
    got = _run(block, x)
    x2 = _rows(1)
    h = x2.reshape(-1, 16)
    probs = torch.softmax(block.gate(h), -1, dtype=torch.float32)
    top, chosen = torch.topk(probs, 2, -1)
    top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(h)
    for e, expert in enumerate(block.experts):
        token, slot = torch.where(chosen == e)
        if token.numel():
            out.index_add_(0, token, expert(h[token]) * top[token, slot, None])
    out = out.reshape(x2.shape)
    assert torch.allclose(got["out"], out, atol=1e-6, rtol=0)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    assert torch.allclose(got["x_grad"], x2.grad, atol=1e-6, rtol=0)


def test_a_recomputed_block_gives_the_same_bits_and_keeps_nothing_after_its_backward():
    """Checkpointed, the exchange keeps only the rows in the first forward (its graph would escape
    the checkpoint) and the experts' graph in the recomputation, which their backward then uses:
    each expert runs forward twice, as a recomputed layer does (it ran a third time in the
    backward). No call outlives its backward -- a call that kept its own outputs made a cycle
    through autograd, and every recomputation's leaked its graph."""
    torch.set_num_threads(1)
    plain, again = _block(4), _block(4)
    runs = [0] * 4
    for e, expert in enumerate(again.experts):
        expert.register_forward_hook(lambda *_, e=e: runs.__setitem__(e, runs[e] + 1))
    for step in range(3):
        runs[:] = [0] * 4
        want, got = _run(plain, _rows(step)), _run(again, _rows(step), recompute=True)
        for key in ("out", "x_grad", "gate_grad"):
            assert torch.equal(got[key], want[key]), (step, key)
        for p, q in zip(plain.experts.parameters(), again.experts.parameters()):
            assert torch.equal(p.grad, q.grad)
        assert sum(runs) > 0 and set(runs) <= {0, 2}, runs  # (an expert no row chose runs on none)
    del want, got
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) in (exchange._LocalCall, exchange._Call)]


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
def test_zb_h1_leaves_the_experts_weight_gradients_to_w_with_one_backwards_bits(recompute):
    """ZB-H1's B (pipeline/zero_bubble.backward_input) takes the rows' gradients through the
    exchange alone; every expert's weight gradient -- and its fold -- comes in W, with the bits of
    one whole backward. (They were computed in B, which ZB-H1's timing does not expect.)"""
    from elaswave.pipeline.zero_bubble import backward_input
    torch.set_num_threads(1)
    whole, split = _block(4), _block(4)
    want = _run(whole, _rows(0), recompute=recompute)
    folded = []
    split.exchange = exchange.Local(lambda e: folded.append(e))
    x = _rows(0)
    out = checkpoint(checkpointed(split), x, use_reentrant=False) if recompute else split(x)
    grad = torch.linspace(-1, 1, out.numel()).view_as(out)
    layer = [p for p in split.parameters() if p.requires_grad]
    w = backward_input(out, grad, x, layer, [layer] if recompute else ())
    experts = list(split.experts.parameters())
    assert torch.equal(x.grad, want["x_grad"]) and all(p.grad is None for p in experts) and not folded
    w.run()
    assert sorted(set(folded)) == [e for e in range(4) if any(p.grad is not None for p in split.experts[e].parameters())]
    assert folded and torch.equal(split.gate.weight.grad, want["gate_grad"])
    for p, q in zip(whole.experts.parameters(), experts):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
