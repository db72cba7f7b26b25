"""bf16 mixed precision in the flat layer, the accumulator and the optimizer: bfloat16 compute,
float32 sums, float32 masters that keep what bfloat16 rounds away."""
import pytest
import torch

from elaswave.config import ConfigError, TrainConfig
from elaswave.precision import compute_dtype
from elaswave.zero.bucket import Bucket
from elaswave.zero.flat import FlatLayer
from elaswave.zero.optimizer import ShardedAdamW
from elaswave.zero.reduce import GradAccumulator


def _tied_pair():
    torch.manual_seed(0)
    owner = FlatLayer(torch.nn.Embedding(16, 8), 0)
    head = torch.nn.Linear(8, 16, bias=False)
    del head.weight  # as the stage unties a user: the tensor is the owner's
    head.weight = owner.tie("weight")
    return owner, head


def test_cast_keeps_parameters_tied_uses_and_gradients_on_the_flat_storage():
    owner, head = _tied_pair()
    before = owner.flat.clone()
    owner.cast(torch.bfloat16)
    assert owner.flat.dtype == owner.grad.dtype == head.weight.dtype == torch.bfloat16
    assert torch.equal(owner.flat, before.to(torch.bfloat16))
    owner.flat.add_(1.0)  # every view reads the one storage
    assert torch.equal(owner.module.weight.view(-1), owner.flat) and torch.equal(head.weight.view(-1), owner.flat)
    head(owner.module(torch.tensor([[1, 2]]))).sum().backward()
    assert owner.grad.abs().sum() > 0 and head.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("deterministic", [False, True])
def test_bf16_gradients_are_summed_in_float32_or_fixed_point(deterministic):
    owner, head = _tied_pair()
    owner.cast(torch.bfloat16)
    twin, twin_head = _tied_pair()  # the same layers, gradients read the plain way
    twin.cast(torch.bfloat16)
    acc = GradAccumulator([owner], deterministic, 32, 4)
    expected = torch.zeros(owner.numel, dtype=torch.float64)
    for mb in range(4):
        head(owner.module(torch.tensor([[mb, mb + 1]]))).pow(2).sum().backward()
        twin_head(twin.module(torch.tensor([[mb, mb + 1]]))).pow(2).sum().backward()
        expected += twin.grad.double() + twin_head.weight.grad.double().view(-1)
        twin.grad.zero_()
        twin_head.weight.grad.zero_()
        acc.add_micro_batch()
    total = acc.to_float(acc.sums[0])
    assert total.dtype == torch.float32 and torch.allclose(total.double(), expected, rtol=0, atol=1e-6)
    if not deterministic:  # fast mode keeps no bfloat16 gradient: each went into the sum as it was written
        assert owner.grad is None and owner.module.weight.grad is None and head.weight.grad is None


def test_fast_bf16_sums_have_the_bits_of_adding_each_micro_batchs_gradient():
    """Folding autograd's gradient into the float32 sum as it is written gives the bits of the
    flat-gradient way (zeroed bfloat16 gradient, then added): 0 + g is g."""
    owner, head = _tied_pair()
    owner.cast(torch.bfloat16)
    twin, twin_head = _tied_pair()
    twin.cast(torch.bfloat16)
    acc = GradAccumulator([owner], False, 32, 3)
    expected = torch.zeros(owner.numel, dtype=torch.float32)
    for mb in range(3):
        head(owner.module(torch.tensor([[mb, 3 - mb]]))).pow(2).sum().backward()
        twin_head(twin.module(torch.tensor([[mb, 3 - mb]]))).pow(2).sum().backward()
        expected.add_(twin.grad)
        expected.add_(twin_head.weight.grad.view(-1))
        twin.grad.zero_()
        twin_head.weight.grad.zero_()
        acc.add_micro_batch()
    assert torch.equal(acc.sums[0], expected)
    acc.zero()
    assert not acc.sums[0].any()


def test_the_float32_master_keeps_updates_that_bfloat16_would_round_away():
    torch.manual_seed(0)
    layer = FlatLayer(torch.nn.Linear(32, 32), 0)
    bucket = Bucket((0,), [0], [layer.numel], 256, me=0)
    opt = ShardedAdamW([bucket], [layer], TrainConfig(lr=1e-6, weight_decay=0.0))
    initial = opt.params[0].clone()
    layer.cast(torch.bfloat16)
    assert opt.params[0].dtype == torch.float32 and torch.equal(opt.params[0], initial)  # not the rounded copy
    for step in range(3):
        opt.step([torch.ones(bucket.slot_numel)], step, 1e-6, 1.0)
    master, initial = bucket.unpack(opt.params[0])[0], initial[:layer.numel]
    assert (master != initial).all()  # every master moved by ~3e-6 ...
    same_in_bf16 = (master.to(torch.bfloat16) == initial.to(torch.bfloat16)).float().mean()
    assert same_in_bf16 > 0.9  # ... which a bfloat16 weight would mostly have rounded away


def test_auto_is_float32_on_cpu_and_bf16_can_be_asked_for():
    assert compute_dtype("auto", torch.device("cpu")) == torch.float32
    assert compute_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ConfigError, match="train.precision='fp16' is invalid"):
        compute_dtype("fp16", torch.device("cpu"))


def test_a_gradient_left_by_a_backward_cut_short_is_not_added_to_the_next_step():
    owner, head = _tied_pair()
    owner.cast(torch.bfloat16)
    acc = GradAccumulator([owner], False, 32, 1)
    owner.module.weight.grad = torch.ones_like(owner.module.weight)  # as if the hook never ran
    acc.zero()
    head(owner.module(torch.tensor([[1, 2]]))).pow(2).sum().backward()
    twin, twin_head = _tied_pair()
    twin.cast(torch.bfloat16)
    twin_head(twin.module(torch.tensor([[1, 2]]))).pow(2).sum().backward()
    expected = twin.grad.float() + twin_head.weight.grad.float().view(-1)
    assert torch.equal(acc.sums[0], expected)


def test_a_layer_whose_gradients_go_into_a_sum_is_freed_when_dropped():
    """The hooks hold the sum, not the layer: a layer a re-partition drops leaves memory."""
    import gc
    import weakref
    owner, head = _tied_pair()
    owner.cast(torch.bfloat16)
    GradAccumulator([owner], False, 32, 1)
    gone = weakref.ref(owner)
    del owner, head
    gc.collect()
    assert gone() is None
