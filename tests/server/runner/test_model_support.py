"""Architectures beyond Llama, Qwen2 and Mistral: those whose attention scores differently (Gemma 2's
logit cap, gpt-oss's sinks) are served exactly; those the runner would serve wrongly (their own
attention code, recurrent state, latent attention, chunked attention, layers that drop the
attention kwargs) are refused at load with the reason, before any request."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import AutoConfig

from llmfleet.server.runner.attention import KVShape, kv_shape
from llmfleet.server.runner.builtin_models import BUILTINS, build_model_dir
from llmfleet.server.runner.model_support import UnsupportedModel, check_supported, unsupported_reason
from tests.server.runner.hand_scheduler import HandScheduler, hf_greedy
from tests.server.runner.test_runner_oracle import make_runner, prompts_for

TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
# Small windows, so that the window, the cap and the sinks all act on these short prompts; a cap of
# 1.0 (Gemma 2 ships 50.0) makes it decide tokens even with tiny random weights.
SCORED = {
    "gemma2": (("head_dim", 16), ("attn_logit_softcapping", 1.0), ("sliding_window", 6)),
    "gpt_oss": (("head_dim", 16), ("num_local_experts", 4), ("num_experts_per_tok", 2), ("sliding_window", 6)),
}


@pytest.mark.parametrize("architecture", sorted(SCORED))
def test_a_logit_cap_and_sinks_are_applied_in_every_path(tmp_path, architecture):
    spec = dataclasses.replace(BUILTINS["tiny"], architecture=architecture, extra_config=SCORED[architecture])
    model_dir = build_model_dir(spec, tmp_path / architecture)
    prompts = prompts_for(6, 5, longest=24)
    prompts[0] = prompts[0][:1]
    max_tokens = [14, 10, 16, 12, 9]
    expected = hf_greedy(model_dir, prompts, max_tokens)

    hand = HandScheduler(make_runner(model_dir))
    for i, chunk in enumerate([1 << 30, 1, 4, 7, 1 << 30]):  # whole prompts and chunks beside decodes
        hand.add(str(i), prompts[i], max_tokens[i], chunk=chunk)
    outputs = hand.run()
    for i in range(len(prompts)):
        assert outputs[str(i)] == expected[i], f"request {i} diverged on {architecture}"


@pytest.mark.parametrize(
    ("model_type", "config", "words"),
    [
        ("lfm2", {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"]}, "conv"),
        ("recurrent_gemma", {}, "linear_attention"),
        ("llama4_text", {"attention_chunk_size": 8}, "chunked_attention"),
        ("llama4_text", {"attention_chunk_size": None, "attn_temperature_tuning": True}, "attn_temperature_tuning"),
        ("deepseek_v3", {"n_routed_experts": 4}, "multi-head latent attention"),
    ],
)
def test_models_it_would_serve_wrongly_are_refused_with_the_reason(tmp_path, model_type, config, words):
    AutoConfig.for_model(model_type, **config).save_pretrained(tmp_path)  # no weights needed
    with pytest.raises(UnsupportedModel, match=words):
        check_supported(tmp_path)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", "gemma2", "gemma3_text", "gpt_oss", "gpt2", "opt"])
def test_models_it_serves_exactly_pass_the_check(model_type):
    assert unsupported_reason(AutoConfig.for_model(model_type, **TINY)) is None


@pytest.mark.parametrize(
    ("architecture", "words"),
    [
        ("nemotron", "do not pass their keyword arguments"),  # every step would fail
        ("bloom", "its own code"),  # requests would attend to each other's tokens
        # picks its attention class from a table of its own; transformers 5.25 routes it through
        # the interface but drops our kwargs on the way: refused at load either way
        ("falcon", "its own code|do not pass their keyword arguments"),
        ("mpt", "forward with llm-fleet's attention failed"),  # its own mask code
    ],
)
def test_what_the_config_does_not_show_fails_at_load_not_in_a_request(tmp_path, architecture, words):
    spec = dataclasses.replace(BUILTINS["tiny"], architecture=architecture)
    model_dir = build_model_dir(spec, tmp_path / architecture)
    with pytest.raises(UnsupportedModel, match=words):
        make_runner(model_dir)


@pytest.mark.parametrize(
    "architecture",
    [
        "gpt_neox",  # keeps a num_key_value_heads of 2 in its config and ignores it: 4 heads reach the attention
        "jetmoe",  # 2 KV heads, each shared by the query heads of its 2 attention experts
    ],
)
def test_the_cache_holds_what_the_attention_gets_not_what_the_config_says(tmp_path, architecture):
    spec = dataclasses.replace(BUILTINS["tiny"], architecture=architecture)
    model_dir = build_model_dir(spec, tmp_path / architecture)
    prompts = prompts_for(6, 3, longest=20)
    max_tokens = [12, 9, 14]
    expected = hf_greedy(model_dir, prompts, max_tokens)

    hand = HandScheduler(make_runner(model_dir))
    for i, chunk in enumerate([1 << 30, 5, 1 << 30]):
        hand.add(str(i), prompts[i], max_tokens[i], chunk=chunk)
    outputs = hand.run()
    for i in range(len(prompts)):
        assert outputs[str(i)] == expected[i], f"request {i} diverged on {architecture}"


@pytest.mark.parametrize(
    ("shapes", "words"),
    [
        ({(2, 16, 2, 16, 4), (4, 16, 4, 16, 4)}, "different shapes"),
        ({(2, 16, 2, 32, 4)}, "keys .* and values .* differ"),
        ({(3, 16, 3, 16, 4)}, "do not share"),
    ],
)
def test_kv_shapes_one_paged_cache_cannot_hold_are_refused(shapes, words):
    with pytest.raises(UnsupportedModel, match=words):
        kv_shape("SomeForCausalLM", shapes)


def test_one_kv_shape_is_read_as_heads_and_size():
    assert kv_shape("SomeForCausalLM", {(2, 16, 2, 16, 4)}) == KVShape(kv_heads=2, head_dim=16)
