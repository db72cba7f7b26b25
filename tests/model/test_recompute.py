"""Selective recomputation (elaswave/model/recompute.py): the attention core runs again in the
backward, with the same bits, the same dropout masks, and less kept for the backward."""
import pytest
import torch

from elaswave import rng
from elaswave.config import ModelConfig
from elaswave.model import recompute
from elaswave.model.contract import saved_activation_bytes
from elaswave.model.gpt import GPT
from elaswave.model.llama import Llama

LLAMA = dict(arch="llama", d_model=32, num_heads=4, num_kv_heads=2, seq_len=16, num_blocks=2, vocab_size=64)


def _model(kind: str, dropout: float):
    if kind == "gpt":
        return GPT(ModelConfig(d_model=32, num_heads=2, seq_len=16, num_blocks=2, dropout=dropout))
    return Llama(ModelConfig(**LLAMA, dropout=dropout))


def _run(block, x, gen):
    """Output, input gradient, every weight's gradient, and the generator's state after the block."""
    x = x.clone().requires_grad_(True)
    y = block(x, gen)
    after = gen.get_state().clone() if gen is not None else None
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads, after


@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_a_recomputed_core_gives_the_same_bits_masks_and_generator(kind, dropout):
    block = _model(kind, dropout).build_layer(1, seed=3)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0))
    kept = _run(block, x, rng.generator(0, rng.DROPOUT, 1, 2, 1))
    recompute.select(block, True)
    again = _run(block, x, rng.generator(0, rng.DROPOUT, 1, 2, 1))
    assert torch.equal(kept[0], again[0]) and torch.equal(kept[1], again[1])
    assert all(torch.equal(a, b) for a, b in zip(kept[2], again[2]))
    assert torch.equal(kept[3], again[3]), "the generator must move on as if the block drew the masks itself"
    if dropout:  # the masks matter: another draw gives other gradients (so the check above can fail)
        other = _run(block, x, rng.generator(0, rng.DROPOUT, 1, 3, 1))
        assert not torch.equal(kept[1], other[1])


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_selective_keeps_less_for_the_backward_by_the_cores_square_tensors(kind):
    model = _model(kind, 0.1)
    full = saved_activation_bytes(model, 2, torch.float32)
    selective = saved_activation_bytes(model, 2, torch.float32, selective=True)
    heads, t = model.cfg.num_heads, model.seq_len
    square = 2 * heads * t * t * 4  # one [b, h, t, t] float32 tensor
    blocks = range(1, model.num_layers - 1)
    # Scores, probabilities and the dropout mask (at least) are no longer kept; q, k, v still are.
    assert all(full[i] - selective[i] >= 2 * square for i in blocks), (full, selective)
    assert all(full[i] == selective[i] for i in (0, model.num_layers - 1))
    assert all(selective[i] > 0 for i in blocks)


def test_selective_on_a_model_that_names_no_attention_core_is_one_line(tmp_path):
    from tests.helpers.spawn import TINY, run_cli
    sets = [*TINY, "model.factory=examples.custom_model:build", "train.activation_checkpointing=selective"]
    res = run_cli(["run", *[x for s in sets for x in ("--set", s)]], tmp_path, timeout_s=60)
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "train.activation_checkpointing=selective is invalid for " \
        "model.factory=examples.custom_model:build: its layers name no attention core" in lines[0], res.stderr
