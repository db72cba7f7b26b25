import numpy as np
import pytest
import torch

from elaswave import rng
from elaswave.config import ConfigError
from elaswave.data.config import DataConfig
from elaswave.data.corpus import InMemoryTokens, load_corpus
from elaswave.data.permutation import Permutation
from elaswave.data.sampler import Sampler


def _sampler(tokens, seed=3, b=4, seq_len=16, mbs=3):
    return Sampler(InMemoryTokens(tokens), seed=seed, micro_batch_size=b, seq_len=seq_len, num_micro_batches=mbs)


def test_micro_batch_depends_only_on_its_id():
    tokens = torch.arange(1000) % 256
    a, b = _sampler(tokens), _sampler(tokens.clone())
    b.micro_batch(9, 2)  # other reads in between change nothing
    x, y = a.micro_batch(5, 2), b.micro_batch(5, 2)
    assert torch.equal(x.inputs, y.inputs) and torch.equal(x.targets, y.targets)
    assert torch.equal(x.inputs[:, 1:], x.targets[:, :-1])
    assert not torch.equal(a.micro_batch(5, 1).inputs, x.inputs)


def test_every_epoch_visits_every_window_once_in_its_own_order():
    tokens = torch.arange(16 * 50 + 7) % 256  # 50 windows and a tail too short for another
    s = _sampler(tokens, b=4, seq_len=16, mbs=3)
    assert s.num_windows == [50]
    seen: dict[int, list[int]] = {}
    for step in range(9):  # 9 x 3 x 4 = 108 samples: two whole epochs and 8 samples of a third
        for m in range(3):
            d = s.draw(step, m)
            windows = d.windows
            for e, w in zip(d.epochs.tolist(), windows.tolist()):
                seen.setdefault(e, []).append(w)
            batch = s.micro_batch(step, m)  # the tokens are the windows' own
            starts = torch.as_tensor(windows) * 16
            assert torch.equal(batch.inputs, tokens[starts[:, None] + torch.arange(16)])
    assert sorted(seen[0]) == sorted(seen[1]) == list(range(50))
    assert seen[0] != seen[1] and len(set(seen[2])) == 8


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 65, 1000, 4099])
def test_permutation_is_a_bijection_keyed_by_its_keys(n):
    p = Permutation(n, 1234, rng.DATA, 0)
    image = p(np.arange(n))
    assert sorted(image.tolist()) == list(range(n))
    assert p(n - 1) == image[-1]  # per index, the same as in a batch
    if n >= 64:
        assert not np.array_equal(image, Permutation(n, 1234, rng.DATA, 1)(np.arange(n)))
        assert not np.array_equal(image, np.arange(n))
    with pytest.raises(IndexError):
        p(n)


def test_permutation_of_ten_billion_needs_no_index():
    p = Permutation(10 ** 10, 1, rng.DATA, 0)
    probe = np.arange(0, 10 ** 10, 10 ** 10 // 100_000)
    image = p(probe)
    assert image.min() >= 0 and image.max() < 10 ** 10 and len(set(image.tolist())) == len(probe)


def test_stream_seeds_are_keyed_and_ordered():
    assert rng.stream_seed(1, 2, 3) == rng.stream_seed(1, 2, 3)
    assert rng.stream_seed(1, 2, 3) != rng.stream_seed(1, 3, 2)


def test_corpora(tmp_path):
    stdlib = load_corpus(DataConfig(max_corpus_bytes=5000), 256, 65)
    assert stdlib.numel() == 5000 and int(stdlib.max()) < 256
    (tmp_path / "a.txt").write_text("hello world " * 20)
    text = load_corpus(DataConfig(source="text", path=str(tmp_path)), 256, 65)
    assert bytes(text.tolist()).startswith(b"hello world")
    toks = torch.tensor([1, 500, 65535, 7] * 40, dtype=torch.int32)
    (tmp_path / "t.bin").write_bytes(toks.numpy().astype("<u2").tobytes())
    binary = load_corpus(DataConfig(source="bin", path=str(tmp_path / "t.bin")), 65536, 65)
    assert binary[:4].tolist() == [1, 500, 65535, 7]


def test_the_source_is_read_from_what_is_at_the_path(tmp_path):
    (tmp_path / "t.bin").write_bytes(b"\0\1" * 100)
    (tmp_path / "a.txt").write_text("text")
    assert DataConfig().kind == "stdlib"
    assert DataConfig(path=str(tmp_path / "t.bin")).kind == "bin"
    assert DataConfig(path=str(tmp_path / "a.txt")).kind == "text"
    assert DataConfig(path=str(tmp_path)).kind == "text"
    (tmp_path / "manifest.json").write_text("{}")
    assert DataConfig(path=str(tmp_path)).kind == "tokens"
    with pytest.raises(ConfigError, match="data.path=.* has no effect with data.source=stdlib"):
        DataConfig(source="stdlib", path=str(tmp_path)).validate()
    with pytest.raises(ConfigError, match="no manifest.json"):
        DataConfig(source="tokens", path=str(tmp_path / "a.txt")).validate()


def test_a_mixture_keeps_its_weights_and_each_sources_epochs():
    from elaswave.data.mixture import Mixture, block_counts

    assert block_counts([0.5, 0.3, 0.2]).tolist() == [500, 300, 200]
    assert block_counts([1, 1, 1]).sum() == 1000
    small, large = torch.arange(16 * 30 + 1) % 256, torch.arange(16 * 500 + 1) % 256
    s = Sampler([InMemoryTokens(small), InMemoryTokens(large)], seed=5, micro_batch_size=10, seq_len=16,
                num_micro_batches=10, mixture=Mixture([0.37, 0.63], seed=5))
    draws = [s.draw(step, m) for step in range(100) for m in range(10)]  # 10,000 samples
    sources = np.concatenate([d.sources for d in draws])
    assert abs((sources == 0).mean() - 0.37) < 0.01 * 0.37 and abs((sources == 1).mean() - 0.63) < 0.01 * 0.63
    # Source 0 has 30 windows: its 3,700 samples are 123 whole epochs, each visiting every window once.
    mine = [(int(e), int(w)) for d in draws for src, e, w in zip(d.sources, d.epochs, d.windows) if src == 0]
    by_epoch: dict[int, list[int]] = {}
    for e, w in mine:
        by_epoch.setdefault(e, []).append(w)
    assert all(sorted(by_epoch[e]) == list(range(30)) for e in range(len(mine) // 30))
    again = Sampler([InMemoryTokens(small), InMemoryTokens(large)], seed=5, micro_batch_size=10, seq_len=16,
                    num_micro_batches=10, mixture=Mixture([0.37, 0.63], seed=5))
    d = again.draw(57, 3)  # alone, the same as in order
    assert np.array_equal(d.windows, draws[573].windows) and np.array_equal(d.sources, draws[573].sources)
    batch = again.micro_batch(57, 3)
    first = (small if d.sources[0] == 0 else large)[int(d.windows[0]) * 16:][:16]
    assert torch.equal(batch.inputs[0], first)
