"""The model's generation_config.json gives the sampling values a request leaves out, as vLLM's
`--generation-config auto` (its default) does."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from llmfleet.server.openai.generation_defaults import GenerationConfigError, read_generation_defaults
from llmfleet.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from llmfleet.server.openai.submission import build_subrequests
from tests.server.fakes import fake_state

LLAMA_LIKE = {
    "bos_token_id": 1,
    "do_sample": True,
    "eos_token_id": 2,
    "temperature": 0.6,
    "top_p": 0.9,
    "max_new_tokens": 5,
    "transformers_version": "4.45.0",
}


def write(folder, config) -> None:
    (folder / "generation_config.json").write_text(json.dumps(config))


def test_auto_reads_the_models_file_and_vllm_reads_none(tmp_path):
    write(tmp_path, LLAMA_LIKE)
    assert read_generation_defaults("auto", tmp_path) == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 5}
    assert read_generation_defaults("vllm", tmp_path) == {}
    assert read_generation_defaults("auto", tmp_path / "no-model-here") == {}  # a model without the file
    other = tmp_path / "tuned"
    other.mkdir()
    write(other, {"top_k": 40, "repetition_penalty": 1.1, "min_p": None})
    assert read_generation_defaults(str(other), tmp_path) == {"top_k": 40, "repetition_penalty": 1.1}


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"max_new_tokens": 0}, "max_tokens must be a whole number >= 1, got 0"),
        ({"max_new_tokens": 0.5}, "max_tokens must be a whole number >= 1, got 0.5"),
        ({"top_k": -5}, "top_k must be a whole number >= -1, got -5"),
        ([], "expected a JSON object"),
    ],
)
def test_a_value_no_request_could_carry_is_refused_at_start(tmp_path, config, words):
    write(tmp_path, config)
    with pytest.raises(GenerationConfigError, match="generation config") as refused:
        read_generation_defaults("auto", tmp_path)
    assert words in str(refused.value)
    with pytest.raises(GenerationConfigError, match="cannot read the generation config"):
        read_generation_defaults(str(tmp_path / "missing"), None)


def test_a_request_gets_the_models_values_for_what_it_leaves_out():
    state = fake_state()
    try:
        state.sampling_defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 40, "max_tokens": 5}

        def sampling(body, max_tokens):
            (sub,) = asyncio.run(build_subrequests(state, [[5, 6, 7]], body, max_tokens, None))
            return sub.sampling

        messages = [{"role": "user", "content": "hi"}]
        left_out = sampling(ChatCompletionRequest(messages=messages), None)
        assert (left_out.temperature, left_out.top_p, left_out.top_k, left_out.max_tokens) == (0.6, 0.9, 40, 5)
        given = sampling(ChatCompletionRequest(messages=messages, temperature=0, top_p=1.0, top_k=-1, max_tokens=9), 9)
        assert (given.temperature, given.top_p, given.top_k, given.max_tokens) == (0, 1.0, 0, 9)
        completion = sampling(CompletionRequest(prompt="hi"), 16)  # its max_tokens defaults to 16, as vLLM's
        assert completion.max_tokens == 16 and completion.temperature == 0.6
    finally:
        state.engine.shutdown()


def test_serve_reads_the_models_generation_config(tmp_path):
    import argparse

    from llmfleet.server import cli as server_cli
    from llmfleet.server.runner.builtin_models import resolve_model
    from llmfleet.server.serve import local_engine_state

    model = tmp_path / "tiny"
    shutil.copytree(resolve_model("builtin:tiny"), model)
    write(model, LLAMA_LIKE)
    parser = argparse.ArgumentParser()
    server_cli.add_arguments(parser)
    state, _ = local_engine_state(parser.parse_args(["--model", str(model)]))
    try:
        assert state.sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 5}
    finally:
        state.engine.shutdown()
    write(model, {"temperature": -1})
    with pytest.raises(SystemExit, match=r"generation config .* temperature must be >= 0, got -1"):
        local_engine_state(parser.parse_args(["--model", str(model)]))


def test_an_override_sets_keys_over_the_file(tmp_path):
    write(tmp_path, LLAMA_LIKE)
    override = '{"temperature": 0.2, "top_k": 20, "do_sample": false}'
    got = read_generation_defaults("auto", tmp_path, override)
    assert got == {"temperature": 0.2, "top_p": 0.9, "max_tokens": 5, "top_k": 20}
    assert read_generation_defaults("vllm", tmp_path, '{"min_p": 0.05}') == {"min_p": 0.05}
    with pytest.raises(GenerationConfigError, match="cannot read the generation config --override-generation-config"):
        read_generation_defaults("vllm", tmp_path, "{temperature: 0.2}")
