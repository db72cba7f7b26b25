"""A stage's activation checkpointing: recomputed forwards draw the same keyed dropout, so the
gradients have the same bits with it on or off, in float32 and bfloat16; it keeps fewer
activations (measured as the bytes autograd saves for the backward)."""
import pytest
import torch

from elaswave import config
from elaswave.pipeline.stage import Stage


def _grads_and_saved_bytes(sets: list[str], dtype: torch.dtype) -> tuple[list[torch.Tensor], int]:
    cfg = config.load(None, ["model.dropout=0.1", "train.deterministic=true", *sets])
    stage = Stage(cfg, (0, cfg.model.num_layers), torch.device("cpu"))
    for layer in stage.layers:
        layer.cast(dtype)
    idx = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len), generator=torch.Generator().manual_seed(0))
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage.forward(idx, step=3, micro_batch=1)
    forward_saved = sum(saved)
    stage.model.loss_sum(out, idx).backward()
    return [layer.grad.clone() for layer in stage.layers] + [a.grad.clone() for l in stage.layers for a, _ in l.uses], \
        forward_saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_checkpointing_keeps_the_bits_and_saves_memory(dtype):
    plain, plain_bytes = _grads_and_saved_bytes([], dtype)
    for mode in ("full", "every_2"):
        grads, saved_bytes = _grads_and_saved_bytes([f"train.activation_checkpointing={mode}"], dtype)
        assert all(torch.equal(a, b) for a, b in zip(grads, plain)), mode
        assert saved_bytes < plain_bytes, (mode, saved_bytes, plain_bytes)
    _, full_bytes = _grads_and_saved_bytes(["train.activation_checkpointing=full"], dtype)
    _, half_bytes = _grads_and_saved_bytes(["train.activation_checkpointing=every_2"], dtype)
    assert full_bytes < half_bytes < plain_bytes
    print(f"\n{dtype}: autograd keeps {plain_bytes} B per micro-batch; every_2 {half_bytes} B, full {full_bytes} B")

