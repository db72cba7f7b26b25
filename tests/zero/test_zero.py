import torch

from elaswave.config import TrainConfig
from elaswave.zero.bucket import Bucket
from elaswave.zero.flat import FlatLayer
from elaswave.zero.optimizer import ShardedAdamW, _runs, clip_coef, decay_runs, lr_at


def test_bucket_pack_unpack_and_ownership():
    numels = [10, 3, 9]
    b = Bucket((4, 7), [0, 1, 2], numels, chunk_numel=4, me=7)
    flats = [torch.arange(n, dtype=torch.float32) + 100 * i for i, n in enumerate(numels)]
    packed = b.pack(flats)
    assert [torch.equal(a, c) for a, c in zip(b.unpack(packed), flats)] == [True] * 3
    # Chunks are numbered across the group (layer 0: 0-2, layer 1: 3, layer 2: 4-6);
    # holder 7 is slot 1 and owns the odd ones.
    assert [(o.layer, o.chunk, o.numel) for o in b.owned] == [(0, 1, 4), (1, 0, 3), (2, 1, 4)]
    mine = b.my_part(packed)
    assert mine[:4].tolist() == [4.0, 5.0, 6.0, 7.0]


def test_holders_share_chunks_within_one_of_each_other():
    numels = [5000, 13000, 13000, 13000, 4500]  # per-layer numbering would give holder 0 the most
    counts = [len(Bucket(range(4), range(5), numels, 4096, me).owned) for me in range(4)]
    assert max(counts) - min(counts) <= 1 and sum(counts) == 2 + 4 * 3 + 2


def test_sharded_adamw_matches_torch_adamw():
    torch.manual_seed(0)
    cfg = TrainConfig(weight_decay=0.1, lr=1e-2)
    model = torch.nn.Linear(20, 30)
    ref = torch.nn.Linear(20, 30)
    ref.load_state_dict(model.state_dict())
    layer = FlatLayer(model, 0)
    halves = [Bucket((0, 1), [0], [layer.numel], 64, me) for me in (0, 1)]
    opts = [ShardedAdamW([b], [layer], cfg) for b in halves]
    decay = [p for p in ref.parameters() if p.dim() >= 2]
    no_decay = [p for p in ref.parameters() if p.dim() < 2]
    torch_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-2, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    for step in range(5):
        g = torch.randn(layer.numel)
        off = 0
        for p in ref.parameters():
            p.grad = g[off:off + p.numel()].view_as(p).clone()
            off += p.numel()
        torch_opt.step()
        for b, opt in zip(halves, opts):
            opt.step([b.my_part(b.pack([g]))], step, 1e-2, 1.0)
        full = halves[0].pack([layer.flat])
        for b, opt in zip(halves, opts):
            full[b.my_slot * b.slot_numel:(b.my_slot + 1) * b.slot_numel] = opt.params[0]
        layer.flat.copy_(halves[0].unpack(full)[0])
    expected = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    assert torch.allclose(layer.flat, expected, atol=1e-6)


def test_lr_schedule_and_clipping():
    cfg = TrainConfig(steps=20, warmup_steps=5, lr=1.0, min_lr=0.1)
    assert lr_at(0, cfg) == 0.2 and lr_at(4, cfg) == 1.0
    assert abs(lr_at(20, cfg) - 0.1) < 1e-12
    norm, coef = clip_coef([9.0, 16.0], 1.0)
    assert norm == 5.0 and abs(coef - 1 / (5 + 1e-6)) < 1e-12
    assert clip_coef([0.25], 1.0) == (0.5, 1.0)


def test_fixed_point_overflow_is_a_clear_error_not_a_wrap():
    import pytest

    from elaswave.zero.reduce import GradAccumulator, GradientOverflowError

    layer = FlatLayer(torch.nn.Linear(2, 2), 0)
    acc = GradAccumulator([layer], deterministic=True, fixed_point_bits=40, num_micro_batches=8)
    layer.grad.fill_(1e9)
    with pytest.raises(GradientOverflowError, match="grad_fixed_point_bits=40"):
        acc.add_micro_batch()
    layer.grad.fill_(float("nan"))
    with pytest.raises(GradientOverflowError):
        acc.add_micro_batch()


def test_moments_still_arriving_are_in_place_before_the_update_and_not_offered_as_a_source():
    cfg = TrainConfig(weight_decay=0.0, lr=1e-2)
    layer = FlatLayer(torch.nn.Linear(4, 8), 0)
    b = Bucket((0,), [0], [layer.numel], 8, 0)
    keys = [(oc.layer, oc.chunk) for oc in b.owned]
    state = {k: torch.stack([torch.full((8,), 0.5), torch.full((8,), 0.1), torch.full((8,), 0.2)]) for k in keys}
    whole = ShardedAdamW([b], [layer], cfg, gen=3, chunks=state)
    arriving = ShardedAdamW([b], [layer], cfg, gen=3, chunks={k: torch.cat([v[:1], torch.zeros(2, 8)])
                                                              for k, v in state.items()})
    waited = []
    moments = torch.stack([v[1:] for v in state.values()])
    arriving.moments_arriving(lambda: waited.append(True), keys[:], moments)
    assert arriving.holding() == {3: []}  # nothing whole here until the moments are in
    grads = [torch.ones(b.slot_numel)]
    whole.step(grads, 3, 1e-2, 1.0)
    arriving.step(grads, 3, 1e-2, 1.0)
    assert waited == [True]
    assert torch.equal(whole.state[0], arriving.state[0])
    assert arriving.holding() == {4: keys, 3: keys}


def test_pack_and_unpack_into_keep_every_value_and_no_copy_of_the_bucket_in_between():
    from elaswave.runtime.memory import measure_peak
    numels = [4096 * 3 + 5, 4096 * 2, 7]
    b = Bucket((0, 1, 2), [0, 1, 2], numels, 4096, me=1)
    flats = [torch.randn(n) for n in numels]
    packed, before, peak = measure_peak(lambda: b.pack(flats), torch.device("cpu"))
    assert peak - before <= packed.numel() * 4  # the bucket, no padded copy staged first
    into = [torch.zeros(n) for n in numels]
    b.unpack_into(packed, into)
    assert all(torch.equal(x, y) for x, y in zip(into, flats))
    assert all(torch.equal(x, y) for x, y in zip(b.unpack(packed), flats))


def test_weight_decay_bits_do_not_depend_on_where_a_layout_ends_a_run():
    """A value decays to the same bits whether its run is whole or cut at odd places (another
    layout's chunk ends): vector bodies and tails of the kernels round alike."""
    p = torch.randn(4099, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(4099, dtype=torch.bool)
    mask[[5, 1000, 1001, 3000]] = False
    whole, cut = p.clone(), p.clone()
    decay_runs(whole, _runs(mask), -3e-4 * 0.1)
    decay_runs(cut, [(a, b) for lo, hi in _runs(mask) for a, b in ((lo, lo + (hi - lo) // 3), (lo + (hi - lo) // 3, hi))],
               -3e-4 * 0.1)
    assert torch.equal(whole.view(torch.int32), cut.view(torch.int32))
    assert torch.equal(whole[~mask], p[~mask]) and not torch.equal(whole[mask], p[mask])
    assert _runs(mask) == [(0, 5), (6, 1000), (1002, 3000), (3001, 4099)]
