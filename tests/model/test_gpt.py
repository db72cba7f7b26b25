import torch

from elaswave import rng
from elaswave.config import ModelConfig
from elaswave.model.gpt import build_layer


def test_layers_are_built_identically_from_their_own_stream():
    cfg = ModelConfig(d_model=16, num_heads=2, seq_len=8, num_blocks=3)
    for i in range(cfg.num_layers):
        a, b = build_layer(cfg, i, seed=5), build_layer(cfg, i, seed=5)
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(build_layer(cfg, 1, 5).qkv.weight, build_layer(cfg, 2, 5).qkv.weight)


def test_dropout_is_keyed_not_global():
    cfg = ModelConfig(d_model=16, num_heads=2, seq_len=8, num_blocks=1, dropout=0.5)
    block = build_layer(cfg, 1, seed=0)
    x = torch.randn(2, 8, 16)
    y1 = block(x, rng.generator(0, rng.DROPOUT, 3, 4, 1))
    torch.rand(100)  # the global generator is never used
    y2 = block(x, rng.generator(0, rng.DROPOUT, 3, 4, 1))
    y3 = block(x, rng.generator(0, rng.DROPOUT, 3, 5, 1))
    assert torch.equal(y1, y2) and not torch.equal(y1, y3)
