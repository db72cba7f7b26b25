"""Chat data: ``elaswave prepare --format chat`` renders conversations with the model folder's own
chat template and stores a loss mask beside the tokens; training honours it. The loss of a step is
the mean over the loss tokens of the whole global batch: transformers' loss with ``labels=-100`` on
the masked tokens on the same batch, real dp=2 x pp=2 and 1 x 3 runs, and the reference, bit for bit."""
import json

import numpy as np
import pytest
import torch

from elaswave import config
from elaswave.config import ConfigError
from elaswave.data import chat as chat_module
from elaswave.data import tokenizer as tok
from elaswave.data.prepare import prepare
from elaswave.data.sampler import IGNORE, open_sampler
from elaswave.data.shards import PreparedTokens
from elaswave.model.registry import model_for
from tests.helpers.spawn import TINY, run_cli

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
WORDS = "the cat sat on a mat and then it ran to see why sky is blue because light scatters".split()


def _conversation(i: int) -> dict:
    say = lambda k, n: " ".join(WORDS[(i * 7 + k * 3 + j) % len(WORDS)] for j in range(n))  # noqa: E731
    messages = [{"role": "system", "content": "be brief"}] if i % 3 == 0 else []
    for turn in range(1 + i % 2):
        messages += [{"role": "user", "content": say(turn, 5 + i % 4)}, {"role": "assistant", "content": say(turn + 9, 4 + i % 5)}]
    return {"messages": messages}


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A model folder as chat models come: tokenizer.json (a byte-level BPE with ChatML's special
    tokens) and tokenizer_config.json with the chat template; the conversations beside it."""
    from tokenizers import AddedToken, Tokenizer
    root = tmp_path_factory.mktemp("chat")
    spec = tok.train_bpe("train-bpe:320", [" ".join(WORDS)] * 20)
    tokenizer = Tokenizer.from_str(spec.json)
    tokenizer.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    model = root / "model"
    model.mkdir()
    tokenizer.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    (root / "chat.jsonl").write_text("".join(json.dumps(_conversation(i)) + "\n" for i in range(60)))
    return root


def _prepared(chat_model, tmp_path, **options):
    return prepare([str(chat_model / "chat.jsonl")], str(tmp_path / "corpus"), str(chat_model / "model"),
                   progress=False, fmt="chat", **options)


def test_the_mask_covers_what_the_assistant_says_and_its_end_of_turn(chat_model, tmp_path):
    m = _prepared(chat_model, tmp_path)
    assert m["format"] == "elaswave-tokens/2" and m["loss_mask"]["train_on"] == "assistant"
    corpus = PreparedTokens(str(tmp_path / "corpus"))
    encoder, starts = corpus.encoder(), corpus.shards[0].starts
    assert len(starts) - 1 == 60
    for d in (0, 1, 5):
        ids = corpus.read(int(starts[d]), int(starts[d + 1] - starts[d]))
        mask = corpus.read_mask(int(starts[d]), int(starts[d + 1] - starts[d]))
        said = "".join(msg["content"] + "<|im_end|>\n" for msg in _conversation(d)["messages"]
                       if msg["role"] == "assistant")
        assert encoder.decode(ids[mask]) == said
        whole = encoder.decode(ids[:-1])  # the end-of-document id follows, untrained
        assert whole.startswith("<|im_start|>") and not mask[-1]
    everything = _prepared(chat_model, tmp_path / "all", train_on="all")
    assert everything["format"] == "elaswave-tokens/1" and everything["splits"]["train"]["tokens"] == m["splits"]["train"]["tokens"]


@pytest.mark.parametrize("record,expected", [
    ({"messages": [{"content": "hi"}]}, 'message 0 has no "role"'),
    ({"messages": [{"role": "user"}]}, 'message 0 (user) has no text "content"'),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "message 0 has role 'wizard'"),
    ({"text": "hi"}, 'has no "messages" list'),
])
def test_a_bad_conversation_is_one_line_naming_its_line(tmp_path, chat_model, record, expected):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_conversation(0)) + "\n" + json.dumps(record) + "\n")
    res = run_cli(["prepare", str(bad), "--out", str(tmp_path / "corpus"), "--tokenizer", str(chat_model / "model"),
                   "--format", "chat", "--workers", "1"], tmp_path)
    assert res.returncode == 2 and f"{bad}:2" in res.stderr and expected in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "corpus").exists()
    assert not (tmp_path / "corpus.partial").exists()  # nothing half-written is left behind


def test_the_shapes_of_openai_style_messages_are_taken(tmp_path, chat_model):
    """A developer turn, content as a list of text parts, an assistant turn that only calls a tool:
    given to the template as they are (the template decides how they read)."""
    template = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n'}}{% if m['content'] is string %}"
                "{{ m['content'] }}{% elif m['content'] %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}"
                "{% else %}{{ m['tool_calls'] | tojson }}{% endif %}{{'<|im_end|>\\n'}}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_bytes((chat_model / "model" / "tokenizer.json").read_bytes())
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<|im_end|>"}))
    record = {"messages": [{"role": "developer", "content": "be brief"},
                           {"role": "user", "content": [{"type": "text", "text": "the cat"}, {"type": "text", "text": " sat"}]},
                           {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "see"}}]},
                           {"role": "tool", "content": "a mat"}, {"role": "assistant", "content": "on a mat"}]}
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(record) + "\n")
    m = prepare([str(data)], str(tmp_path / "corpus"), str(model), progress=False, fmt="chat")
    assert m["splits"]["train"]["documents"] == 1
    corpus = PreparedTokens(str(tmp_path / "corpus"))
    text = corpus.encoder().decode(corpus.read(0, len(corpus)).tolist())
    assert "the cat sat" in text and '"name": "see"' in text and "developer" in text
    bad = dict(record, messages=[{"role": "user", "content": [{"type": "image", "url": "x"}]}])
    data.write_text(json.dumps(bad) + "\n")
    with pytest.raises(ConfigError, match=r'message 0 \(user\) has no text "content"'):
        prepare([str(data)], str(tmp_path / "corpus2"), str(model), progress=False, fmt="chat")
    assert not (tmp_path / "corpus2.partial").exists()
    # A template without a branch for a role would drop its turns silently: refused, naming it.
    picky = ("{% for m in messages %}{% if m['role'] in ['user', 'assistant'] %}{{'<|im_start|>' + m['role'] + "
             "'\\n' + m['content'] + '<|im_end|>\\n'}}{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": picky, "eos_token": "<|im_end|>"}))
    data.write_text(json.dumps({"messages": [{"role": "developer", "content": "be brief"},
                                             {"role": "user", "content": "the cat"},
                                             {"role": "assistant", "content": "sat"}]}) + "\n")
    with pytest.raises(ConfigError, match=r"leaves out message 0 \(developer\)"):
        prepare([str(data)], str(tmp_path / "corpus3"), str(model), progress=False, fmt="chat")


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path, chat_model):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer.json").write_bytes((chat_model / "model" / "tokenizer.json").read_bytes())
    with pytest.raises(ConfigError, match="has no chat template"):
        prepare([str(chat_model / "chat.jsonl")], str(tmp_path / "c"), str(plain), progress=False, fmt="chat")


def test_the_loss_is_the_mean_over_the_global_batch_loss_tokens(chat_model, tmp_path):
    """The sampler marks untrained targets IGNORE and counts the step's loss tokens over every
    micro-batch, whichever pipeline reads them."""
    _prepared(chat_model, tmp_path)
    cfg = config.load(None, [*TINY, "model.vocab_size=400", f"data.path={tmp_path / 'corpus'}",
                             "train.num_micro_batches=4"])
    sampler = open_sampler(cfg, model_for(cfg))
    batches = [sampler.micro_batch(3, mb) for mb in range(4)]
    counted = sum(int((b.targets != IGNORE).sum()) for b in batches)
    assert sampler.loss_tokens(3) == counted == sum(b.loss_tokens for b in batches)
    assert 0 < counted < 4 * batches[0].targets.numel()  # prompts are masked, answers are not
    assert np.array_equal(batches[0].inputs[:, 1:], np.where(batches[0].targets[:, :-1] == IGNORE,
                                                             batches[0].inputs[:, 1:], batches[0].targets[:, :-1]))
    # One window a micro-batch: the targets are a view of the row that the inputs come from too,
    # and masking them must leave the inputs whole (it wrote -100 into them).
    one = config.load(None, [*TINY, "model.vocab_size=400", f"data.path={tmp_path / 'corpus'}",
                             "train.micro_batch_size=1"])
    b = open_sampler(one, model_for(one)).micro_batch(3, 0)
    assert (b.targets == IGNORE).any() and bool((b.inputs >= 0).all())
    # auto masking is for the Llama family: the GPT on the same corpus runs unmasked (it crashed).
    gpt = config.load(None, ["model.arch=gpt", "model.vocab_size=400", f"data.path={tmp_path / 'corpus'}"])
    assert gpt.data.masks_documents and not gpt.masks_documents


# per_document: masked, and the rotary positions restart at each conversation (data.position_ids)
@pytest.mark.parametrize("documents", ["false", "true", "per_document"])
def test_masked_training_equals_transformers_and_the_reference_in_a_real_layout(chat_model, tmp_path, documents):
    transformers = pytest.importorskip("transformers")
    _prepared(chat_model, tmp_path)
    vocab = PreparedTokens(str(tmp_path / "corpus")).vocab_size
    torch.manual_seed(0)
    hf = tmp_path / "hf"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)).save_pretrained(hf)
    sets = [f"model.init_from={hf}", "model.seq_len=32", f"data.path={tmp_path / 'corpus'}", "train.steps=3",
            "train.num_micro_batches=4", "train.micro_batch_size=2", "parallel.timeout_s=60",
            f"data.document_masking={'true' if documents == 'per_document' else documents}",
            f"data.position_ids={'per_document' if documents == 'per_document' else 'continuous'}"]
    args = [x for s in sets for x in ("--set", s)]
    run = run_cli(["run", "--deterministic", *args, "--set", "parallel.dp=2", "--set", "parallel.pp=2"], tmp_path)
    assert run.returncode == 0, run.stderr
    ref = run_cli(["reference", "--deterministic", *args], tmp_path)
    assert ref.returncode == 0, ref.stderr
    steps = [r for r in run.records if r["event"] == "step"]
    assert [r["loss"] for r in steps] == [r["loss"] for r in ref.records if r["event"] == "step"]
    assert run.summary["params_sha256"] == ref.summary["params_sha256"]
    deep = run_cli(["run", "--deterministic", *args, "--set", "parallel.dp=1", "--set", "parallel.pp=3"], tmp_path)
    assert deep.returncode == 0, deep.stderr  # another layout, the same bits
    assert [r["loss"] for r in deep.records if r["event"] == "step"] == [r["loss"] for r in steps]
    assert deep.summary["params_sha256"] == ref.summary["params_sha256"]
    assert all(0 < r["loss_tokens"] < r["tokens"] == 4 * 2 * 32 for r in steps)
    # transformers on step 0's global batch: labels -100 where masked, the mean over all its loss tokens.
    cfg = config.load(None, [*sets, "train.deterministic=true"])
    sampler = open_sampler(cfg, model_for(cfg))
    model = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    total = 0.0
    with torch.no_grad():
        for mb in range(4):
            b = sampler.micro_batch(0, mb)
            extra = {}
            if documents == "per_document":  # what DataCollatorWithFlattening passes
                from elaswave.model.llama import positions_in_documents
                extra["position_ids"] = positions_in_documents(b.documents)
            if documents != "false":  # transformers' custom 4D mask: the same block-causal pattern
                t = b.inputs.shape[1]
                allowed = torch.tril(torch.ones(t, t, dtype=torch.bool)) & (b.documents[:, :, None] == b.documents[:, None, :])
                extra["attention_mask"] = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[:, None]
            out = model(input_ids=b.inputs, labels=b.targets, shift_labels=b.targets,
                        num_items_in_batch=steps[0]["loss_tokens"], **extra)
            total += float(out.loss)
    assert steps[0]["loss_tokens"] == sampler.loss_tokens(0)
    assert abs(steps[0]["loss"] - total) <= 1e-5


def test_document_masking_keeps_attention_inside_each_conversation(chat_model, tmp_path):
    """Block-causal attention from the document index: a window's logits at a document's tokens
    equal the logits of that document alone (at its own positions, as a window starting with it
    sees them); without the mask the earlier conversation leaks in. Every layout equals the reference."""
    _prepared(chat_model, tmp_path)
    from elaswave.pipeline.stage import Stage
    sets = [*TINY, "model.vocab_size=400", f"data.path={tmp_path / 'corpus'}", "train.deterministic=true",
            "model.dropout=0"]
    masked = config.load(None, sets)
    assert masked.data.masks_documents  # auto: a corpus of conversations
    plain = config.load(None, [*sets, "data.document_masking=false"])
    sampler = open_sampler(masked, model_for(masked))
    # A row in which the next document starts well inside the window.
    for mb in range(8):
        batch = sampler.micro_batch(0, mb)
        rows = [(r, int((d != d[0]).nonzero()[0])) for r, d in enumerate(batch.documents) if (d != d[0]).any()]
        rows = [(r, at) for r, at in rows if 4 <= at <= len(batch.documents[r]) - 8]
        if rows:
            break
    row, second = rows[0]
    batch = type(batch)(0, mb, batch.inputs[row:row + 1], batch.targets[row:row + 1], batch.documents[row:row + 1])
    model = model_for(masked)
    stage = Stage(masked, (0, model.num_layers), torch.device("cpu"), model)
    with torch.no_grad():
        with_mask = stage.forward(batch.inputs, 0, 0, train=False, documents=batch.documents)
        without = stage.forward(batch.inputs, 0, 0, train=False)
        # The second document alone at positions from 0 (rotary: shifting every token's position
        # alike changes nothing that attention reads).
        alone = stage.forward(batch.inputs[:, second:], 0, 0, train=False)
    assert torch.allclose(with_mask[0, second:], alone[0], atol=1e-5)
    assert not torch.allclose(without[0, second:], alone[0], atol=1e-3)
    assert torch.equal(with_mask[0, :second], without[0, :second])  # the first document saw only itself
    assert not plain.data.masks_documents


def test_the_chat_template_is_checked_and_the_export_carries_the_one_trained_on(chat_model, tmp_path):
    """The corpus keeps the template its conversations were rendered with. A model folder with
    another template is refused in one line, unless data.chat_template=corpus: then the export
    carries the corpus's. A base folder (no template) trains, and its export gains the corpus's:
    apply_chat_template on the result renders as the training data was rendered."""
    transformers = pytest.importorskip("transformers")
    import shutil
    _prepared(chat_model, tmp_path)
    corpus = tmp_path / "corpus"
    assert (corpus / "chat_template.jinja").read_text() == CHATML
    hf = tmp_path / "hf"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=PreparedTokens(str(corpus)).vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)).save_pretrained(hf)
    shutil.copyfile(chat_model / "model" / "tokenizer.json", hf / "tokenizer.json")
    other = CHATML.replace("'<|im_end|>' + '\\n'", "'<|im_end|>' + '\\n\\n'")
    assert other != CHATML
    (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": other, "eos_token": "<|im_end|>"}))
    sets = [f"model.init_from={hf}", "model.seq_len=32", f"data.path={corpus}", "train.steps=2", "parallel.dp=1",
            "parallel.pp=1", "train.num_micro_batches=2", "train.micro_batch_size=2", "elastic.enabled=false"]

    def run(*more):
        return run_cli(["run", *[x for s in [*sets, *more] for x in ("--set", s)]], tmp_path, timeout_s=120)
    refused = run()
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert "rendered with another chat template than the folder's" in lines[0] and "data.chat_template=corpus" in lines[0]
    messages = _conversation(1)["messages"]
    expected = chat_module.ChatTemplate("", CHATML, eos_token="<|im_end|>").render(messages)
    for folder_template in (other, None):  # another template (carried over it), none (a base folder)
        (hf / "tokenizer_config.json").write_text(json.dumps(
            {"eos_token": "<|im_end|>", **({"chat_template": folder_template} if folder_template else {})}))
        out = tmp_path / f"out-{folder_template is None}"
        done = run("data.chat_template=corpus" if folder_template else "data.chat_template=check",
                   f"checkpoint.export_hf={out}")
        assert done.returncode == 0, done.stderr
        assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHATML
        tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(out)
        assert tokenizer.apply_chat_template(messages, tokenize=False) == expected


def test_a_step_without_a_trained_token_has_no_loss_not_a_perfect_one(chat_model, tmp_path):
    """Conversations of user turns only: every target is masked, and the mean over no token is
    undefined -- the step's record says loss None (and the progress line n/a), as the reference
    does; it said 0.0, a perfect loss."""
    only_users = tmp_path / "users.jsonl"
    only_users.write_text("".join(json.dumps({"messages": _conversation(i)["messages"][:1 + (i % 3 == 0)][-1:]}) + "\n"
                                  for i in range(40)))
    assert all(json.loads(line)["messages"][0]["role"] != "assistant" for line in only_users.read_text().splitlines())
    prepare([str(only_users)], str(tmp_path / "corpus"), str(chat_model / "model"), progress=False, fmt="chat")
    sets = [*TINY, "model.vocab_size=400", f"data.path={tmp_path / 'corpus'}", "train.steps=2", "parallel.dp=1",
            "parallel.pp=2", "train.num_micro_batches=2"]
    res = run_cli(["run", *[x for s in sets for x in ("--set", s)], "--deterministic"], tmp_path)
    assert res.returncode == 0, res.stderr
    steps = [r for r in res.records if r["event"] == "step"]
    assert [r["loss_tokens"] for r in steps] == [0, 0] and [r["loss"] for r in steps] == [None, None]
    assert "loss n/a (no trained token in the batch)" in res.stdout and "final loss n/a" in res.stdout
    ref = run_cli(["reference", *[x for s in sets for x in ("--set", s)], "--deterministic"], tmp_path)
    assert ref.returncode == 0, ref.stderr
    assert [r["loss"] for r in ref.records if r["event"] == "step"] == [None, None]


def test_every_bad_line_is_counted_and_the_first_few_shown(tmp_path, chat_model):
    """Five bad lines among good ones, of every kind (not JSON, no messages, a bad message, one the
    template cannot render): one line counts all five and shows the first three; prepare stopped at
    the first before."""
    lines = [json.dumps(_conversation(0)), "{not json", json.dumps({"text": "hi"}), json.dumps(_conversation(1)),
             json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}), json.dumps({"messages": "none"}),
             json.dumps({"messages": [{"role": "user"}]}), json.dumps(_conversation(2))]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    res = run_cli(["prepare", str(bad), "--out", str(tmp_path / "corpus"), "--tokenizer", str(chat_model / "model"),
                   "--format", "chat", "--workers", "1"], tmp_path)
    assert res.returncode == 2 and len([x for x in res.stderr.splitlines() if "error" in x]) == 1, res.stderr
    assert "5 of the 8 lines read cannot be used, so nothing was written" in res.stderr, res.stderr
    assert all(f"{bad}:{n}" in res.stderr for n in (2, 3, 5)) and "and 2 more" in res.stderr, res.stderr
    assert not (tmp_path / "corpus").exists() and not (tmp_path / "corpus.partial").exists()
