"""ZB-H1's split backward in one process: B then W leaves exactly (torch.equal) the gradients of
one whole backward -- the input's and every weight's, tied uses included -- on the built-in
families' layers, recomputed or not, one piece or two, with gradients kept in the layers' flat
buffers or summed into float32 by their hooks; and B and W together do one backward's work, not
more (counted in FLOPs)."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from elaswave import config
from elaswave.pipeline.stage import Stage
from elaswave.pipeline.zero_bubble import backward_input

TINY = ["model.d_model=16", "model.num_heads=2", "model.seq_len=8", "model.num_blocks=2", "model.dropout=0.1"]


def _gradients(sets: list[str], layers: tuple[int, int], split: bool, pieces: int,
               into_sums: bool) -> list[torch.Tensor]:
    cfg = config.load(None, [*TINY, *sets])
    stage = Stage(cfg, layers, torch.device("cpu"))
    sums = {}
    for layer in stage.layers:
        if into_sums:  # fast mode's bfloat16 layers: each gradient added into a float32 sum by a hook
            layer.cast(torch.bfloat16)
            sums[layer.index] = torch.zeros(layer.numel)
            layer.sum_gradients_into(sums[layer.index])
    weights = _weights(stage)
    together = [layer.params for layer in stage.running if layer.index in stage.recomputed]  # as the executor groups
    gen, rows, m = torch.Generator().manual_seed(0), 2, cfg.model
    shape = (rows * pieces, m.seq_len)
    if stage.is_first:
        x = torch.randint(0, m.vocab_size, shape, generator=gen)
    else:
        x = torch.randn(*shape, m.d_model, generator=gen).to(stage.dtype).requires_grad_(True)
    targets = torch.randint(0, m.vocab_size, shape, generator=gen)
    grad = None if stage.is_last else torch.randn(*shape, m.d_model, generator=gen).to(stage.dtype)
    out = []
    for k in range(pieces):  # each piece's gradient taken alone, as the executor folds it
        part = slice(k * rows, (k + 1) * rows)
        y = stage.forward(x[part], step=3, micro_batch=k)
        if stage.is_last:
            y = stage.model.loss_sum(y, targets[part]) / 100
        g = None if grad is None else grad[part]
        if split:
            weight_pass = backward_input(y, g, x if x.requires_grad else None, weights, together)
            assert all(t.grad is None or not t.grad.any() for t in weights), "B wrote a weight's gradient"
            del y
            weight_pass.run()
        else:
            torch.autograd.backward(y, g)
        if into_sums:
            out += [s.clone() for s in sums.values()]
        else:
            out += [t.grad.clone() for t in weights]
            for t in weights:
                t.grad.zero_()
    return out + ([x.grad] if x.requires_grad else [])


def _weights(stage: Stage) -> list[torch.Tensor]:
    return [t for layer in stage.layers for t in (*layer.params, *(alias for alias, _ in layer.uses))]


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("sets,pieces,into_sums", [([], 1, False), (["train.activation_checkpointing=full"], 2, False),
                                                   ([], 2, True)])
def test_b_then_w_gives_the_bits_of_one_backward(arch, sets, pieces, into_sums):
    m = config.load(None, [*TINY, f"model.arch={arch}"]).model
    # A middle stage, the last (the loss; llama's also holds the tied embedding) and the first (no B).
    for layers in [(1, 3), (2, m.num_layers), (0, 2)]:
        sets_here = [f"model.arch={arch}", *sets]
        whole = _gradients(sets_here, layers, False, pieces, into_sums)
        split = _gradients(sets_here, layers, True, pieces, into_sums)
        assert len(whole) == len(split)
        assert all(torch.equal(a, b) for a, b in zip(whole, split)), (arch, sets, layers)
        assert sum(bool(g.any()) for g in split) >= len(split) // 2  # gradients that are there to compare


def test_w_gives_the_last_layers_their_gradients_first():
    """W restarts the last layers' branches first, as a whole backward runs them, so their buckets'
    sums can start while it goes on (zero/watch.py): a middle stage's layers get their last
    weight gradient in W from the last layer down."""
    cfg = config.load(None, [*TINY, "model.num_blocks=4"])
    stage = Stage(cfg, (1, 4), torch.device("cpu"))
    x = torch.randn(2, cfg.model.seq_len, cfg.model.d_model).requires_grad_(True)
    y = stage.forward(x, step=3, micro_batch=0)
    weight_pass = backward_input(y, torch.randn_like(y), x, _weights(stage))
    assert all(t.grad is None or not t.grad.any() for t in _weights(stage)), "B wrote a weight's gradient"
    order = []
    for layer in stage.layers:
        for t in layer.params:
            t.register_post_accumulate_grad_hook(lambda t, i=layer.index: order.append(i))
    weight_pass.run()
    whole = [i for k, i in enumerate(order) if i not in order[k + 1:]]  # each layer at its last tensor
    assert whole == [3, 2, 1], order


def _flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def _backward_flops(arch: str, layers: tuple[int, int], sets: list[str] = ()) -> tuple[int, int, int]:
    """(whole backward, B, W) FLOPs of one micro-batch on a middle stage ``layers`` of 4 blocks."""
    cfg = config.load(None, [*TINY, "model.num_blocks=4", f"model.arch={arch}", *sets])
    stage = Stage(cfg, layers, torch.device("cpu"))
    together = [layer.params for layer in stage.running if layer.index in stage.recomputed]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, cfg.model.seq_len, cfg.model.d_model, generator=gen).requires_grad_(True)
    grad = torch.randn(2, cfg.model.seq_len, cfg.model.d_model, generator=gen)
    y = stage.forward(x, 3, 0)
    whole = _flops(lambda: torch.autograd.backward(y, grad))
    y = stage.forward(x, 3, 0)
    passes = []
    b = _flops(lambda: passes.append(backward_input(y, grad, x, _weights(stage), together)))
    w = _flops(passes[0].run)
    return whole, b, w


@pytest.mark.parametrize("arch,layers", [("llama", (1, 4)), ("gpt", (1, 3))])
def test_b_and_w_do_the_work_of_one_backward(arch, layers):
    """W restarts each boundary node towards its own weights only: no input gradient again (the
    previous all-in-one W redid every layer's but the lowest: llama 737,280 + 1,425,408 FLOPs
    against 1,425,408; gpt 229,376 + 425,984 against 425,984)."""
    whole, b, w = _backward_flops(arch, layers)
    assert b > 0 and w > 0
    assert b + w == whole, (arch, whole, b, w)


def test_w_recomputes_a_recomputed_layer_once():
    """A recomputed layer's boundary nodes restart in one call: W is at most a whole backward (its
    recomputation included), not a forward again per weight."""
    whole, b, w = _backward_flops("llama", (1, 4), ["train.activation_checkpointing=full"])
    assert b <= whole and w <= whole, (whole, b, w)


def test_a_weight_used_twice_on_a_stage_is_refused():
    """One backward sums such a weight's two gradients before accumulating once; W would not."""
    x = torch.randn(3, 3, requires_grad=True)
    w = torch.randn(3, 3, requires_grad=True)
    with pytest.raises(ValueError, match="two places"):
        backward_input((x @ w @ w).sum(), None, x, [w])
    alias = w.detach().requires_grad_(True)  # a tie's owner and user on one stage
    with pytest.raises(ValueError, match="tied"):
        backward_input((x @ w @ alias).sum(), None, x, [w, alias])


def tensor_parallel_rank(group, exact: bool, sequence: bool):
    """B then W against one whole backward on this rank's shard of a tensor-parallel Llama stage (two
    blocks with biases, the head and its loss): every gradient's bits, and the FLOPs of the two halves."""
    from elaswave.model.llama_tp import TensorParallelLlama
    from elaswave.tensor.split import TensorSplit
    m = config.load(None, ["model.preset=llama-tiny", "model.seq_len=16", "model.dropout=0.0", "model.num_blocks=2",
                           "model.tie_embeddings=false", "model.attention_bias=true", "model.mlp_bias=true"]).model
    model = TensorParallelLlama(m, TensorSplit(group.size, group.group_rank), group, exact, sequence_parallel=sequence)
    layers = [model.build_layer(i, 0) for i in (1, 2, 3)]
    weights = [p for layer in layers for p in layer.parameters()]
    gen = torch.Generator().manual_seed(group.group_rank if sequence else 0)  # a shard of the sequence each
    x = torch.randn(2, model.boundary_tokens, m.d_model, generator=gen).requires_grad_(True)
    targets = torch.randint(0, m.vocab_size, (2, m.seq_len), generator=torch.Generator().manual_seed(1))

    def loss():
        y = x
        for layer in layers:
            y = layer(y, None)
        return model.loss_sum(y, targets) / 100

    out = {}
    for split in (False, True):
        y = loss()
        with FlopCounterMode(display=False) as counter:
            if split:
                pass_ = backward_input(y, None, x, weights)
                b = counter.get_total_flops()
                pass_.run()
            else:
                y.backward()
        out[split] = {"grads": [t.grad.clone() for t in [*weights, x]], "flops": counter.get_total_flops(),
                      "b_flops": b if split else None}
        for t in [*weights, x]:
            t.grad = None
    return out


@pytest.mark.parametrize("exact,sequence", [pytest.param(True, False, marks=pytest.mark.slow), (True, True),
                                            pytest.param(False, True, marks=pytest.mark.slow), (False, False)])
def test_b_then_w_splits_tensor_parallel_products(tmp_path, exact, sequence):
    """The tensor-parallel products (column, row, norm and bias Functions with collectives in their
    backward) compute the input's gradient alone in B and the weights' alone in W: the bits of one
    whole backward on every rank of a group of 2, and B + W the FLOPs of one backward, not more."""
    from tests.helpers.spawn import run_group
    for rank, res in enumerate(run_group("tests.pipeline.test_zero_bubble:tensor_parallel_rank", 2, tmp_path,
                                         exact=exact, sequence=sequence)):
        whole, split = res[False], res[True]
        assert len(whole["grads"]) == len(split["grads"]) > 10
        for i, (a, b) in enumerate(zip(whole["grads"], split["grads"])):
            assert torch.equal(a, b), (rank, i)
        assert sum(bool(g.any()) for g in split["grads"]) == len(split["grads"])
        assert 0 < split["b_flops"] < split["flops"] == whole["flops"], (rank, whole["flops"], split)
