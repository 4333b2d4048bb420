"""Built-in models: made locally, cached atomically, loaded like any HF model; their tokenizer."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from llmfleet.server.runner import builtin_models
from llmfleet.server.runner.builtin_models import STAMP_FILE, BuiltinSpec, build_model_dir, resolve_model

MICRO = BuiltinSpec("llama", 300, 32, 1, 2, 1, 64, 256, 0.08, 99)


def test_concurrent_first_uses_build_one_complete_model(tmp_path):
    target = tmp_path / "models" / "micro"
    errors: list[BaseException] = []

    def build() -> None:
        try:
            build_model_dir(MICRO, target)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(p.name for p in target.parent.iterdir()) == ["micro"]  # no staging left behind
    model = AutoModelForCausalLM.from_pretrained(target)
    assert model.config.hidden_size == 32 and model.config.vocab_size == 300


def test_a_stale_cached_copy_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMFLEET_CACHE", str(tmp_path))
    monkeypatch.setitem(builtin_models.BUILTINS, "micro", MICRO)
    path = builtin_models.ensure_builtin("micro")
    stamp = json.loads((path / STAMP_FILE).read_text())
    assert stamp["spec"]["hidden_size"] == 32
    monkeypatch.setitem(builtin_models.BUILTINS, "micro", BuiltinSpec("llama", 300, 48, 1, 2, 1, 64, 256, 0.08, 99))
    assert builtin_models.ensure_builtin("micro") == path
    assert AutoConfig.from_pretrained(path).hidden_size == 48
    assert sorted(p.name for p in tmp_path.joinpath("models").iterdir()) == ["micro"]


def test_tokenizer_has_special_tokens_and_a_chat_template():
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("builtin:tiny"))
    assert tokenizer.bos_token == "<|bos|>" and tokenizer.eos_token == "<|eos|>" and tokenizer.pad_token == "<|pad|>"
    text = "Hello, llm-fleet! Ünïcödé too."
    assert tokenizer.decode(tokenizer.encode(text)) == text  # byte-level: any text round-trips
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|user|>\nhi<|end|>\n<|assistant|>\n"
    tools = [{"type": "function", "function": {"name": "lookup"}}]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]
    chat = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, continue_final_message=True)
    assert chat == '<|tools|>\n[{"type": "function", "function": {"name": "lookup"}}]<|end|>\n' + (
        "<|user|>\nhi<|end|>\n<|assistant|>\nOnce"  # the last message left open, to go on with
    )
    config = AutoConfig.from_pretrained(resolve_model("builtin:tiny"))
    assert tokenizer.convert_tokens_to_ids("<|end|>") in config.eos_token_id
    assert len(tokenizer) == config.vocab_size


def test_random_weights_give_long_varied_greedy_text():
    path = resolve_model("builtin:tiny")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([[11, 12, 13, 14]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=48)
    generated = out[0, 4:].tolist()
    assert len(generated) == 48  # no early EOS
    assert len(set(generated)) > 8  # not one token repeated


def test_unknown_models_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown built-in model 'huge'"):
        resolve_model("builtin:huge")
    with pytest.raises(FileNotFoundError, match="neither a built-in"):
        resolve_model(str(tmp_path / "nothing-here"))


def test_generate_command_prints_text_and_says_it_is_gibberish(capsys):
    from llmfleet.cli import main

    assert main(["generate", "--max-tokens", "5", "Hello"]) == 0
    out = capsys.readouterr().out
    assert "gibberish" in out and "> Hello" in out and "5 tokens" in out


def test_llama_1b_has_llama_3_2_1bs_shape_and_is_stored_in_bfloat16(tmp_path):
    spec = builtin_models.BUILTINS["llama-1b"]
    config = AutoConfig.for_model(spec.architecture, **builtin_models._config_kwargs(spec))
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (2048, 16, 8192)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 8, 64)
    assert config.vocab_size == 128256 and config.tie_word_embeddings
    assert config.rope_parameters["rope_type"] == "llama3" and config.rope_parameters["factor"] == 32.0
    # the same spec at a small size, built: its weights saved in the spec's dtype, its mapping thawed
    small = BuiltinSpec("llama", 300, 32, 1, 4, 2, 64, 256, 0.08, 7, extra_config=spec.extra_config, dtype=spec.dtype)
    build_model_dir(small, tmp_path / "m")
    saved = json.loads((tmp_path / "m" / "config.json").read_text())
    assert saved["dtype"] == "bfloat16" and saved["rope_parameters"]["rope_theta"] == 500000.0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert model.dtype == torch.bfloat16
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
