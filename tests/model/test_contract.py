import pytest
import torch

from elaswave import config, rng
from elaswave.model.contract import saved_activation_bytes, untie
from elaswave.model.registry import model_for


def _saved_on_cpu(model, index: int, b: int, dtype: torch.dtype) -> int:
    """What autograd really keeps of one forward of layer ``index`` on the CPU (storages once,
    parameters not counted)."""
    layer = model.build_layer(index, 0)
    for _, parent, name, shape in untie(model, layer, index):
        setattr(parent, name, torch.nn.Parameter(torch.zeros(shape)))
    layer.to(dtype)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    T = model.seq_len
    x = (torch.randint(0, model.vocab_size, (b, T)) if index == 0 else
         torch.randn(b, T, model.hidden_size, dtype=dtype, requires_grad=True))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x, rng.generator(0, rng.DROPOUT, 0, 0, index))
        if index == model.num_layers - 1:
            model.loss_sum(y, torch.randint(0, model.vocab_size, (b, T)))
    return sum(seen.values())


@pytest.mark.parametrize("sets,dtype", [([], torch.float32), (["model.arch=gpt"], torch.float32),
                                        (["train.deterministic=true", "model.dropout=0"], torch.bfloat16)])
def test_activation_bytes_measured_on_the_meta_device_are_what_the_cpu_keeps(sets, dtype):
    model = model_for(config.load(None, sets))  # attention written out (dropout, or deterministic mode)
    meta = saved_activation_bytes(model, 3, dtype)
    assert meta == [_saved_on_cpu(model, i, 3, dtype) for i in range(model.num_layers)]
    assert all(b > 0 for b in meta[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_attention_is_priced_within_6_percent_of_what_the_cpu_kernel_keeps(dtype):
    model = model_for(config.load(None, ["model.dropout=0"]))  # fast mode without dropout: SDPA
    priced = saved_activation_bytes(model, 3, dtype, fused_kernel=True)
    real = [_saved_on_cpu(model, i, 3, dtype) for i in range(model.num_layers)]
    assert priced == pytest.approx(real, rel=0.06)


def test_a_fused_attention_kernel_keeps_no_attention_matrix():
    model = model_for(config.load(None, ["model.dropout=0", "model.seq_len=256"]))
    math, fused = saved_activation_bytes(model, 1, torch.float32), saved_activation_bytes(model, 1, torch.float32, True)
    heads, T = model.cfg.num_heads, model.seq_len
    # The math path keeps every head's softmax; the kernel keeps its output and a log-sum-exp instead.
    assert math[1] - fused[1] == 4 * (heads * T * T - T * model.hidden_size - heads * T)


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt-tiny", "qwen2-7b"])
def test_counting_a_models_layers_imports_no_compiler_and_no_checkpoint_library(preset):
    """A rank counts its model's layers on the meta device before it trains. The initialisers' fills
    and any arithmetic on meta tensors import torch._dynamo (measured: 2.6 s of every rank's start-up),
    and torch.distributed.checkpoint pulls in DTensor and sympy (1 s): neither may come with it."""
    import subprocess
    import sys
    code = ("import sys\n"
            "import elaswave.runtime.worker\n"
            "from elaswave.config import load\n"
            "from elaswave.model.contract import counted_numels\n"
            "from elaswave.model.registry import model_for\n"
            f"n = counted_numels(model_for(load(None, ['model.preset={preset}'])))\n"
            "print(sum(n), [m for m in ('torch._dynamo', 'torch.distributed.checkpoint', 'sympy') if m in sys.modules])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    total, imported = out.stdout.split(" ", 1)
    assert int(total) > 0 and imported.strip() == "[]", out.stdout
