"""``elaswave prepare`` and the prepared corpus it makes: every tokenizer spec, shards and their
index read back through memory maps, the eval split, bad input as one line, and a prepare killed
half-way leaving nothing a job could mistake for a corpus."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from elaswave.config import ConfigError, DataConfig
from elaswave.data.corpus import open_tokens
from elaswave.data.prepare import prepare
from elaswave.data.shards import MANIFEST, PreparedTokens
from tests.helpers.spawn import run_cli

DOCS = ["first document", "the second one, a little longer", "third\nwith two lines", "déjà vu"]


@pytest.fixture
def inputs(tmp_path):
    folder = tmp_path / "in"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text(DOCS[0])
    (folder / "sub" / "b.jsonl").write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(DOCS[1:])) + "\n\n")
    (folder / "sub" / "c.pyc").write_bytes(b"\x00\x01binary")  # passed over in a folder
    return folder


def test_bytes_shards_hold_the_documents_with_an_end_of_document_id_between(tmp_path, inputs):
    m = prepare([str(inputs)], str(tmp_path / "out"), "bytes", shard_tokens=40, progress=False)
    encoded = [d.encode() + b"\0" for d in DOCS]
    train = m["splits"]["train"]
    assert train["documents"] == 4 and train["tokens"] == sum(map(len, encoded))
    assert len(train["shards"]) > 1 and m["dtype"] == "uint16" and m["vocab_size"] == 256
    stream = PreparedTokens(str(tmp_path / "out"))
    assert bytes(stream.read(0, len(stream)).tolist()) == b"".join(encoded)  # windows read across shards
    third = sum(map(len, encoded[:2]))
    # A shard closes after the document that takes it past 40 tokens: the third opens the second.
    assert [s["documents"] for s in train["shards"]] == [2, 2]
    assert stream.locate(third + 3) == ("train-00001", 0, 3) and stream.locate(third - 1) == ("train-00000", 1, 31)
    assert bytes(stream.read(third, 5).tolist()) == b"third"


def test_trained_bpe_is_the_same_with_any_number_of_workers_and_serves_as_a_spec(tmp_path, inputs):
    docs = [f"document {i}: " + " ".join(f"word{j % 37}" for j in range(i, i + 60)) for i in range(300)]
    (inputs / "many.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    src = str(inputs / "many.jsonl")
    one = prepare([src], str(tmp_path / "w1"), "train-bpe:300", text_field="body", eval_fraction=0.2, progress=False)
    two = prepare([src], str(tmp_path / "w2"), "train-bpe:300", text_field="body", eval_fraction=0.2, workers=2,
                  progress=False)
    assert one["splits"] == two["splits"] and one["tokenizer"]["sha256"] == two["tokenizer"]["sha256"]
    held = one["splits"]["eval"]["documents"]
    assert 0.1 * 300 < held < 0.3 * 300 and held + one["splits"]["train"]["documents"] == 300
    a, b = PreparedTokens(str(tmp_path / "w1")), PreparedTokens(str(tmp_path / "w2"))
    assert np.array_equal(a.read(0, len(a)), b.read(0, len(b)))
    assert one["vocab_size"] <= 300 and one["tokenizer"]["eod_id"] == 0
    # Its tokenizer.json, and a model folder holding it, tokenize the same.
    again = prepare([src], str(tmp_path / "json"), str(tmp_path / "w1" / "tokenizer.json"), text_field="body",
                    eval_fraction=0.2, progress=False)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "tokenizer.json").write_text((tmp_path / "w1" / "tokenizer.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    folder = prepare([src], str(tmp_path / "dir"), str(model_dir), text_field="body", eval_fraction=0.2, progress=False)
    assert again["splits"] == folder["splits"] == one["splits"]
    # The same text prepared again, with other workers, is the same corpus to a resume.
    from elaswave.data.shards import corpus_identity
    assert corpus_identity(str(tmp_path / "w1")) == corpus_identity(str(tmp_path / "w2"))
    assert corpus_identity(str(tmp_path / "w1")) != corpus_identity(str(tmp_path / "json"))
    held_out = PreparedTokens(str(tmp_path / "w1"), "eval")
    assert len(held_out) == one["splits"]["eval"]["tokens"] > 0


def test_bad_input_is_one_line(tmp_path, inputs):
    out = str(tmp_path / "out")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": unquoted}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2 is not JSON"):
        prepare([str(bad)], out, "bytes", progress=False)
    bad.write_text('{"text": "fine"}\n{"content": "x"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2 has no text field 'text'.*\['content'\]"):
        prepare([str(bad)], out, "bytes", progress=False)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match="hold no documents"):
        prepare([str(tmp_path / "empty.txt")], out, "bytes", progress=False)
    with pytest.raises(ConfigError, match="no such file or folder"):
        prepare([str(tmp_path / "missing")], out, "bytes", progress=False)
    with pytest.raises(ConfigError, match="VOCAB >= 257"):
        prepare([str(inputs)], out, "train-bpe:100", progress=False)
    with pytest.raises(ConfigError, match="no such tokenizer.json"):
        prepare([str(inputs)], out, str(tmp_path / "nowhere.json"), progress=False)
    assert not os.path.exists(out)
    prepare([str(inputs)], out, "bytes", progress=False)
    with pytest.raises(ConfigError, match="exists; give a new folder, or --overwrite"):
        prepare([str(inputs)], out, "bytes", progress=False)
    prepare([str(inputs)], out, "bytes", progress=False, overwrite=True)


def test_a_prepared_corpus_that_disagrees_with_its_manifest_or_the_model_is_refused(tmp_path, inputs):
    out = tmp_path / "out"
    prepare([str(inputs)], str(out), "bytes", progress=False)
    cfg = DataConfig(path=str(out))
    cfg.validate()
    assert cfg.kind == "tokens" and len(open_tokens(cfg, 256, 33)) > 0
    with pytest.raises(ConfigError, match="model.vocab_size=100 is invalid: .* vocabulary of 256.*use >= 256"):
        open_tokens(cfg, 100, 33)
    shard = out / "train-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ConfigError, match=r"train-00000.bin has \d+ bytes, its manifest says \d+ bytes"):
        open_tokens(cfg, 256, 33)
    res = run_cli(["run", "--set", f"data.path={out}"], tmp_path, timeout_s=120)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "its manifest says" in res.stderr


def test_a_killed_prepare_leaves_no_manifest(tmp_path):
    text = tmp_path / "big.txt"
    text.write_text(("lorem ipsum dolor sit amet " * 40 + "\n") * 20_000)  # ~22 MB: seconds to prepare
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "elaswave.cli", "prepare", str(text), "--out", str(out),
                             "--shard-tokens", "1000000"], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "out.partial" / "train-00000.bin").exists():  # it is writing shards
            assert time.monotonic() < deadline and proc.poll() is None, "prepare never started writing"
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not out.exists() and not (tmp_path / "out.partial" / MANIFEST).exists()
    res = run_cli(["prepare", str(text), "--out", str(out), "--shard-tokens", "1000000"], tmp_path, timeout_s=120)
    assert res.returncode == 0, res.stderr
    assert "MB of text per second" in res.stdout and not (tmp_path / "out.partial").exists()
    train = json.loads((out / MANIFEST).read_text())["splits"]["train"]
    # No blank line in ~22 MB: cut at line ends into documents of at most 8 Mi characters, each with its id after it.
    assert train["documents"] == 3 and train["tokens"] == text.stat().st_size + 3


def test_data_batches_names_each_samples_window_and_document(tmp_path, inputs):
    out = tmp_path / "out"
    prepare([str(inputs)], str(out), "bytes", progress=False)
    exported = tmp_path / "exported"  # the run's export, already written: what the data was is still asked
    exported.mkdir()
    (exported / "config.json").write_text("{}")
    sets = ["--set", f"data.path={out}", "--set", "model.seq_len=8", "--set", "train.micro_batch_size=2",
            "--set", "train.num_micro_batches=2", "--set", f"checkpoint.export_hf={exported}"]
    res = run_cli(["data", "batches", "--steps", "0:2", "--text", *sets], tmp_path, timeout_s=120)
    assert res.returncode == 0, res.stderr
    records = [json.loads(line) for line in res.stdout.splitlines()]
    assert [(r["step"], r["micro_batch"]) for r in records] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    samples = [s for r in records for s in r["samples"]]
    assert [s["sample"] for s in samples] == list(range(8))
    stream = PreparedTokens(str(out))
    windows = (len(stream) - 1) // 8
    assert len({s["window"] for s in samples}) == min(8, windows)
    for s in samples:
        assert s["token"] == 8 * s["window"]
        assert s["text"].encode()[:4] == bytes(stream.read(s["token"], 4).tolist())[:4] or "\0" in s["text"]


def _rss_mb() -> float:
    with open("/proc/self/status") as fh:
        return int(fh.read().split("VmRSS:")[1].split()[0]) / 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS from /proc")
def test_reading_windows_at_random_does_not_map_the_corpus_into_the_rank(tmp_path):
    text = tmp_path / "big.txt"
    text.write_bytes(bytes(97 + i % 26 for i in range(1 << 20)) * 48)  # 48 MB: a 96 MB shard
    prepare([str(text)], str(tmp_path / "out"), "bytes", progress=False)
    text.unlink()
    stream = PreparedTokens(str(tmp_path / "out"))
    starts = np.random.default_rng(0).integers(0, len(stream) - 65, 500)
    before = _rss_mb()
    for s in starts:
        window = stream.read(int(s), 65)
    grown = _rss_mb() - before
    assert window[0] == 97 + int(starts[-1]) % (1 << 20) % 26
    assert grown < 8, f"500 windows of 65 tokens grew the process by {grown:.1f} MB"


def test_plain_text_is_cut_into_documents_at_blank_lines_and_streamed(tmp_path, capsys, monkeypatch):
    """A book is not one document: --separator blank-line (default) splits it, so --eval-fraction
    holds some out (it held out nothing before); off a terminal, progress is a line every
    LOG_EVERY_S against the input's total; a binary file named as input is refused."""
    from elaswave.data import prepare as module
    book = tmp_path / "book.txt"
    book.write_text("".join(f"chapter {i}\nline one of {i}\n  \nmore of {i}\n\n\n" for i in range(200)))
    m = prepare([str(book)], str(tmp_path / "a"), "bytes", progress=False)
    assert m["splits"]["train"]["documents"] == 400
    stream = PreparedTokens(str(tmp_path / "a"))
    first = bytes(stream.read(0, int(stream.shards[0].starts[1]) - 1).tolist()).decode()
    assert first == "chapter 0\nline one of 0"
    held = prepare([str(book)], str(tmp_path / "e"), "bytes", eval_fraction=0.2, progress=False)
    assert 40 < held["splits"]["eval"]["documents"] < 120
    whole = prepare([str(book)], str(tmp_path / "b"), "bytes", progress=False, separator="file")
    assert whole["splits"]["train"]["documents"] == 1
    monkeypatch.setattr(module, "LOG_EVERY_S", 0.0)
    prepare([str(book)], str(tmp_path / "c"), "bytes", progress=True)  # stderr is captured: not a terminal
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("elaswave prepare:")]
    assert len(lines) > 1 and all(" MB of input (" in line and " MB/s, " in line for line in lines)
    assert "(100%)" in lines[-1] and "(100%)" not in lines[0]
    binary = tmp_path / "x.bin"
    binary.write_bytes(b"\x00\x01" * 100)
    with pytest.raises(ConfigError, match="x.bin' is invalid: it is binary"):
        prepare([str(binary)], str(tmp_path / "d"), "bytes", progress=False)
