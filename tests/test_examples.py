"""The examples run as written: a custom model through a SIGKILL and a join, and the TOML that
fine-tunes a local Hugging Face Llama directory and exports it."""
from pathlib import Path

import pytest
import torch

from elaswave.data.prepare import prepare
from tests.helpers.spawn import assert_same_run, run_cli, run_job, run_reference

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
STEPS = 150  # long enough for the replacement's start-up (a new process importing torch)
CUSTOM = ["model.factory=examples.custom_model:build", "train.num_micro_batches=4", "parallel.timeout_s=60"]


def test_custom_model_trains_through_a_kill_and_a_join(tmp_path):
    reference = run_reference(tmp_path, STEPS, deterministic=True, extra=CUSTOM)
    res = run_job(tmp_path, 2, 2, STEPS, True, extra=[*CUSTOM, "elastic.inject=kill:rank=3,step=5,phase=backward"],
                  cli=["--respawn-after", "0"])
    assert_same_run(res, reference, STEPS)
    assert [r["event"] for r in res.records if r["event"] in ("recovery", "join")] == ["recovery", "join"]


def test_finetune_toml_loads_a_hugging_face_directory_and_exports_it(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model_dir = tmp_path / "tiny-llama"
    transformers.LlamaForCausalLM(config).save_pretrained(model_dir)
    # The model's tokenizer: a byte-level BPE of <= 512 trained here, saved beside its weights.
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(20):
        (texts / f"{i}.txt").write_text(" ".join(f"word{(i * j) % 97}" for j in range(400)))
    prepare([str(texts)], str(tmp_path / "bpe"), "train-bpe:512", progress=False)
    (model_dir / "tokenizer.json").write_text((tmp_path / "bpe" / "tokenizer.json").read_text())
    prep = run_cli(["prepare", str(texts), "--out", str(tmp_path / "corpus"), "--tokenizer", str(model_dir),
                    "--eval-fraction", "0.2"], tmp_path)
    assert prep.returncode == 0, prep.stderr
    out = tmp_path / "finetuned"
    res = run_cli(["run", "--config", str(EXAMPLES / "finetune_llama.toml"), "--set", "train.steps=3",
                   "--set", f"model.init_from={model_dir}", "--set", f"data.path={tmp_path / 'corpus'}",
                   "--set", f"checkpoint.export_hf={out}", "--set", "model.seq_len=32"], tmp_path)
    assert res.returncode == 0, res.stderr
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.num_key_value_heads == 2 and res.summary["steps"] == 3
    assert (out / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()  # a drop-in folder
    assert [r["step"] for r in res.records if r["event"] == "eval"] == [3]  # the example evaluates after the last


@pytest.mark.parametrize("example", ["instruct_llama.toml", "lora_llama.toml"])
def test_instruct_toml_tunes_a_chat_model_through_a_kill_and_exports_a_drop_in_folder(tmp_path, example):
    """The walkthrough of examples/instruct_llama.toml: a tiny chat model (ChatML template, its
    end-of-turn token as EOS), chat JSONL, prepare --format chat, a run at dp=2 x pp=2 through a
    SIGKILL, the export; transformers loads the export with its tokenizer and chat template and
    generates, stopping at the model's EOS. examples/lora_llama.toml the same with adapters: its
    export is a peft adapter folder that peft loads onto the base the folder names."""
    import json

    transformers = pytest.importorskip("transformers")
    from tokenizers import AddedToken, Tokenizer

    from elaswave.data import tokenizer as tok
    words = "please say hello to the small model and it says ok back every single time".split()
    spec = tok.train_bpe("train-bpe:300", [" ".join(words)] * 10)
    backend = Tokenizer.from_str(spec.json)
    backend.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")
    fast.chat_template = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}"
                          "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\\n'}}{% endif %}")
    model_dir = tmp_path / "my-chat-model"
    eos = backend.token_to_id("<|im_end|>")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=backend.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, eos_token_id=eos,
        bos_token_id=None)).save_pretrained(model_dir)
    fast.save_pretrained(model_dir)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": " ".join(words[(i + j) % len(words)] for j in range(3 + i % 4))},
        {"role": "assistant", "content": "ok"}]}) + "\n" for i in range(240)))
    prep = run_cli(["prepare", str(chats), "--format", "chat", "--tokenizer", str(model_dir), "--out",
                    str(tmp_path / "chats"), "--workers", "1", "--eval-fraction", "0.2", "--pack-to", "32"], tmp_path)
    assert prep.returncode == 0, prep.stderr
    out = tmp_path / "my-chat-model-tuned"
    res = run_cli(["run", "--config", str(EXAMPLES / example), "--set", f"model.init_from={model_dir}",
                   "--set", f"data.path={tmp_path / 'chats'}", "--set", f"checkpoint.export_hf={out}",
                   "--set", "model.seq_len=32", "--set", "train.steps=6", "--set", "train.lr=1e-2",
                   "--set", "train.warmup_steps=0", "--set", "parallel.timeout_s=60", "--set", "train.eval_batches=1",
                   "--inject", "kill:rank=2,step=3,phase=backward"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert [r["step"] for r in res.records if r["event"] == "eval"] == [6]  # the held-out 20 %, after the last step
    steps = [r for r in res.records if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(6)) and [r for r in res.records if r["event"] == "recovery"]
    assert all(0 < r["loss_tokens"] < r["tokens"] for r in steps)  # only the assistant's tokens are trained
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    if example == "lora_llama.toml":
        peft = pytest.importorskip("peft")
        assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(model_dir)
        model = peft.AutoPeftModelForCausalLM.from_pretrained(out).eval()
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert tokenizer.eos_token_id == model.generation_config.eos_token_id == eos
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "please say hello"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    generated = model.generate(**prompt, max_new_tokens=12, do_sample=False)[0, prompt["input_ids"].shape[1]:].tolist()
    assert eos not in generated[:-1]  # generation stops at the model's EOS, if it says it
