"""Whole conversations packed into the sampler's windows (``prepare --format chat --pack-to L``): no
conversation cut at a window's edge, no target that crosses from one conversation to the next,
padding reported; and a job whose windows differ from the packing's is refused."""
import json

import numpy as np
import pytest
import torch

from elaswave import config
from elaswave.config import ConfigError
from elaswave.data.packing import Packer
from elaswave.data.prepare import prepare
from elaswave.data.sampler import IGNORE, open_sampler
from elaswave.data.shards import PreparedTokens
from elaswave.model.registry import model_for
from tests.data.test_chat import TINY, _conversation, chat_model  # noqa: F401 (the fixture)


class _Collect:
    def __init__(self):
        self.docs = []

    def add(self, ids, mask=None):
        self.docs.append((np.asarray(ids), None if mask is None else np.asarray(mask)))


@pytest.mark.parametrize("overlong", ["truncate", "split", "drop"])
def test_best_fit_decreasing_fills_windows_with_whole_items(overlong):
    rng = np.random.default_rng(0)
    packer = Packer(16, eod_id=0, overlong=overlong)
    lengths = [int(x) for x in rng.integers(1, 14, size=40)] + [20, 40]  # two longer than a window
    for n in lengths:
        packer.add(np.arange(1, n + 1), np.ones(n, np.uint8))
    out = _Collect()
    stats = packer.write(out)
    tokens = np.concatenate([d for d, _ in out.docs])
    assert tokens.size == stats["windows"] * 16 + 1  # whole windows, and the last one's next token
    starts = np.cumsum([0] + [d.size for d, _ in out.docs])
    assert set(range(0, stats["windows"] * 16, 16)) <= set(starts.tolist())  # every window starts a document
    assert stats["overlong"] == 2 and stats["conversations"] == 42
    assert stats["dropped"] == (2 if overlong == "drop" else 0)
    assert stats["pieces"] == ({"split": 2 + 3} if overlong == "split" else {}).get(overlong, 0)
    kept = sum(min(n, 15) for n in lengths[:-2]) + {"truncate": 30, "split": 60, "drop": 0}[overlong]
    assert int((tokens != 0).sum()) == kept  # every token kept, but the cut-off ones
    assert stats["padding_tokens"] == sum(d.size for d, _ in out.docs[:-1] if not d.any())  # all-eod documents
    for ids, mask in out.docs:  # a conversation's first token and its end are never trained
        assert mask[0] == 0 and (ids[-1] != 0 or mask[-1] == 0)
    sizes = [ids.size for ids, _ in packer.items]
    lower = max(-(-sum(sizes) // 16), sum(n > 8 for n in sizes))  # no packing needs fewer windows
    assert stats["windows"] <= lower + 2, (stats, lower)  # best fit decreasing comes close on these


@pytest.mark.parametrize("train_on", ["assistant", "all"])
def test_packed_windows_hold_whole_conversations_and_no_cross_targets(chat_model, tmp_path, train_on):  # noqa: F811
    m = prepare([str(chat_model / "chat.jsonl")], str(tmp_path / "corpus"), str(chat_model / "model"), progress=False,
                fmt="chat", train_on=train_on, pack_to=32)
    p = m["packing"]
    assert p["window"] == 32 and p["train"]["conversations"] == 60 and p["train"]["windows"] > 0
    assert 0 < p["train"]["padding_share"] < 0.5
    cfg = config.load(None, [*TINY, "model.vocab_size=400", f"data.path={tmp_path / 'corpus'}",
                             "data.document_masking=true"])
    assert cfg.model.seq_len == 32
    sampler = open_sampler(cfg, model_for(cfg))
    corpus = PreparedTokens(str(tmp_path / "corpus"))
    starts = set(corpus.shards[0].starts.tolist())
    assert all(w * 32 in starts for w in range(sampler.num_windows[0]))  # no window starts mid-conversation
    trained = crossing = 0
    for step in range(6):
        for mb in range(4):
            b = sampler.micro_batch(step, mb)
            ok = b.targets != IGNORE
            # A target's document (the next input's) is the document of the input that predicts it.
            following = torch.cat([b.documents[:, 1:], b.documents[:, -1:] + 1], dim=1)
            crossing += int((ok & (following != b.documents)).sum())
            trained += int(ok.sum())
    assert trained > 0 and crossing == 0
    with pytest.raises(ConfigError, match=r"model.seq_len=64 is invalid .* packed whole into windows of 32 tokens"):
        bad = config.load(None, [*TINY, "model.seq_len=64", "model.vocab_size=400", f"data.path={tmp_path / 'corpus'}"])
        open_sampler(bad, model_for(bad))


def test_unpacked_conversations_are_cut_and_packed_ones_are_not(chat_model, tmp_path, capsys):  # noqa: F811
    """What packing buys, on the same conversations: the share of trained targets whose
    conversation began before their window (so its prompt is not in it)."""
    def cut_share(path):
        cfg = config.load(None, [*TINY, "model.vocab_size=400", f"data.path={path}", "data.document_masking=true"])
        sampler = open_sampler(cfg, model_for(cfg))
        corpus = PreparedTokens(str(path))
        starts = np.array(corpus.shards[0].starts)
        cut = total = 0
        for w in range(sampler.num_windows[0]):
            mask = corpus.read_mask(w * 32 + 1, 32)
            doc_start = starts[np.searchsorted(starts, w * 32 + np.arange(32), side="right") - 1]
            total += int(mask.sum())
            cut += int((mask & (doc_start < w * 32)).sum())
        return cut / total
    prepare([str(chat_model / "chat.jsonl")], str(tmp_path / "plain"), str(chat_model / "model"), progress=False,
            fmt="chat")
    prepare([str(chat_model / "chat.jsonl")], str(tmp_path / "packed"), str(chat_model / "model"), progress=False,
            fmt="chat", pack_to=32, overlong="drop")
    assert cut_share(tmp_path / "plain") > 0.1
    assert cut_share(tmp_path / "packed") == 0.0
    assert json.loads((tmp_path / "packed" / "manifest.json").read_text())["packing"]["overlong"] == "drop"
    # The run says which it got, and how to pack, once (the launcher's check; not per rank).
    from elaswave import preflight
    for name, said in (("plain", True), ("packed", False)):
        cfg = config.load(None, [*TINY, "model.vocab_size=400", f"data.path={tmp_path / name}"])
        preflight.note_unpacked_conversations(cfg)
        err = capsys.readouterr().err
        assert ("--format chat --pack-to 32" in err) == said, err
