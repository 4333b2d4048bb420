"""vLLM's request fields that act on sampling, on the real builtin:tiny model in-process (the
fake runner ignores the sampler): ``allowed_token_ids``; with a real tokenizer and real
logprobs, /tokenize's ``return_token_strs`` and the chat logprobs' ``bytes``; and its
``--structured-outputs-config.disable_any_whitespace``."""

from __future__ import annotations

import argparse
import json
import re

import pytest
from fastapi.testclient import TestClient

from llmfleet.server import cli as server_cli
from llmfleet.server.config import EngineConfig
from llmfleet.server.openai.app import create_app
from tests.server.fakes import real_tiny_state
from tests.server.openai.helpers import sse_chunks


@pytest.fixture(scope="module")
def tiny():
    state = real_tiny_state(EngineConfig(dtype="float32", kv_cache_memory_mb=8))
    try:
        with TestClient(create_app(state)) as client:
            yield state, client
    finally:
        state.engine.shutdown()


def test_allowed_token_ids_are_the_only_ones_sampled(tiny):
    state, client = tiny
    ask = {"prompt": "hello", "max_tokens": 6, "ignore_eos": True}
    allowed = [state.tokenizer.encode(piece, add_special_tokens=False)[0] for piece in ("x", "y")]
    for extra in ({"temperature": 0}, {"temperature": 1.5, "seed": 3}, {"temperature": 0, "logit_bias": {"5": 100}}):
        out = client.post("/v1/completions", json=ask | extra | {"allowed_token_ids": allowed}).json()
        text = out["choices"][0]["text"]
        assert text and set(text) <= {"x", "y"}, text
        assert out["usage"]["completion_tokens"] == 6
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "allowed_token_ids": allowed[:1]}
    assert client.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"] == "x" * 4
    vocab = len(state.tokenizer)
    for bad in ([vocab], [-1], []):
        reply = client.post("/v1/completions", json={"prompt": "hi", "allowed_token_ids": bad})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "allowed_token_ids", reply.text


def test_tokenize_returns_the_token_strings_when_asked(tiny):
    state, client = tiny
    plain = client.post("/tokenize", json={"prompt": "hello world"}).json()
    assert plain["token_strs"] is None  # vLLM's field, null unless asked
    out = client.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert out["tokens"] == plain["tokens"] and len(out["token_strs"]) == out["count"] > 1
    assert out["token_strs"] == state.tokenizer.convert_ids_to_tokens(out["tokens"])
    chat = {"messages": [{"role": "user", "content": "hi"}], "return_token_strs": True}
    out = client.post("/tokenize", json=chat).json()
    assert len(out["token_strs"]) == out["count"]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_carry_each_tokens_utf8_bytes(tiny, stream):
    _, client = tiny
    ask = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "stream": stream,
    }
    response = client.post("/v1/chat/completions", json=ask)
    assert response.status_code == 200, response.text
    if stream:
        chunks = [json.loads(line[6:]) for line in response.text.split("\n\n") if line.startswith("data: {")]
        entries = [e for c in chunks for choice in c["choices"] for e in (choice["logprobs"] or {}).get("content", [])]
    else:
        entries = response.json()["choices"][0]["logprobs"]["content"]
    assert len(entries) == 4
    for entry in entries:
        assert len(entry["top_logprobs"]) == 2
        for each in (entry, *entry["top_logprobs"]):
            assert each["bytes"] == list(each["token"].encode("utf-8")), each


def _events(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.split("\n\n") if line.startswith("data: {")]


@pytest.mark.parametrize("stream", [False, True])
def test_return_token_ids_gives_the_prompt_and_each_choice_s_ids(tiny, stream):
    # vLLM's return_token_ids: the ids the model saw and gave, for clients that must not re-tokenize
    state, client = tiny
    prompt = state.tokenizer.encode("hello world")
    ask = {
        "prompt": "hello world",
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "n": 2,
        "stream": stream,
        "return_token_ids": True,
    }
    plain = client.post("/v1/completions", json=ask | {"stream": False, "return_token_ids": False}).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]
    response = client.post("/v1/completions", json=ask)
    if stream:
        got = {0: ([], []), 1: ([], [])}
        for chunk in _events(response):
            for choice in chunk["choices"]:
                got[choice["index"]][0].extend(choice.get("prompt_token_ids") or [])  # the first chunk's
                got[choice["index"]][1].extend(choice["token_ids"])
    else:
        got = {c["index"]: (c["prompt_token_ids"], c["token_ids"]) for c in response.json()["choices"]}
    for index in (0, 1):
        prompt_ids, token_ids = got[index]
        assert prompt_ids == prompt and len(token_ids) == 6
        assert state.tokenizer.decode(token_ids) == plain["choices"][index]["text"]

    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "return_token_ids": True,
    }
    response = client.post("/v1/chat/completions", json=chat)
    if stream:
        chunks = _events(response)
        assert [i for i, c in enumerate(chunks) if "prompt_token_ids" in c] == [0]  # beside the choices, once
        prompt_ids = chunks[0]["prompt_token_ids"]
        token_ids = [t for c in chunks for choice in c["choices"] for t in choice["token_ids"]]
        text = "".join(choice["delta"].get("content") or "" for c in chunks for choice in c["choices"])
    else:
        out = response.json()
        prompt_ids, token_ids = out["prompt_token_ids"], out["choices"][0]["token_ids"]
        text = out["choices"][0]["message"]["content"]
    assert state.tokenizer.decode(prompt_ids).endswith("<|assistant|>\n") and len(token_ids) == 5
    assert state.tokenizer.decode(token_ids) == text


@pytest.mark.parametrize("stream", [False, True])
def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(tiny, stream):
    _, client = tiny
    ask = {
        "prompt": "hello",
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 2,
        "stream": stream,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    response = client.post("/v1/completions", json=ask)
    choices = [c for chunk in _events(response) for c in chunk["choices"]] if stream else response.json()["choices"]
    names = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
    ids = [t for c in choices for t in c["token_ids"]]
    assert names == [f"token_id:{t}" for t in ids] and len(ids) == 4
    tops = [key for c in choices if c["logprobs"] for top in c["logprobs"]["top_logprobs"] for key in top]
    assert tops and all(key.startswith("token_id:") for key in tops)

    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 1,
        "stream": stream,
        "return_tokens_as_token_ids": True,
    }
    response = client.post("/v1/chat/completions", json=chat)
    chunks = _events(response) if stream else [response.json()]
    entries = [e for c in chunks for choice in c["choices"] for e in (choice["logprobs"] or {}).get("content", [])]
    assert len(entries) == 3
    assert all(
        e["token"].startswith("token_id:") and e["top_logprobs"][0]["token"].startswith("token_id:") for e in entries
    )


def test_streamed_logprobs_text_offsets_are_the_whole_answers(tiny):
    """A token whose text is held back (half a character) still takes its place in the offsets of
    the tokens after it, streamed as in the whole answer."""
    _, client = tiny
    ask = {"prompt": "Story 5: the cat", "max_tokens": 30, "temperature": 0, "logprobs": 1}
    whole = client.post("/v1/completions", json=ask).json()["choices"][0]["logprobs"]
    assert "\ufffd" in whole["tokens"]  # this prompt's answer has a token of half a character
    chunks = sse_chunks(client.post("/v1/completions", json=ask | {"stream": True}))
    streamed = [c["logprobs"] for chunk in chunks for c in chunk["choices"] if c["logprobs"]]
    assert [o for lp in streamed for o in lp["text_offset"]] == whole["text_offset"]
    assert [t for lp in streamed for t in lp["tokens"]] == whole["tokens"]


SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "string", "maxLength": 3}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _outside_strings(text: str) -> str:
    return JSON_STRING.sub('""', text)


def test_disable_any_whitespace_is_vllms_dotted_flag():
    parser = argparse.ArgumentParser()
    server_cli.add_arguments(parser)
    assert parser.parse_args([]).structured_outputs_compact is False  # vLLM's default: any whitespace
    for suffix, value in (("", True), ("=true", True), ("=False", False)):
        flag = "--structured-outputs-config.disable_any_whitespace" + suffix
        assert parser.parse_args([flag]).structured_outputs_compact is value


def test_disable_any_whitespace_makes_json_compact_unless_the_request_says(tiny):
    """vLLM's --structured-outputs-config.disable_any_whitespace: the random model fills JSON with
    whitespace wherever a grammar lets it (a required tool call spends its 60 tokens on tabs here).
    Compact, a schema's answer and a forced call hold none outside their strings and end in time;
    a request's own whitespace_pattern still wins."""
    state, client = tiny
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 60, "temperature": 0}
    schema_ask = chat | {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
    tool_ask = chat | {"tools": [tool], "tool_choice": "required"}
    loose = chat | {"guided_json": SCHEMA, "guided_whitespace_pattern": "[ ]{1,3}"}

    def choice(body: dict) -> dict:
        reply = client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]

    assert re.search(r"\s", _outside_strings(choice(schema_ask)["message"]["content"]))  # the default: any
    assert choice(tool_ask)["finish_reason"] == "length"
    state.structured_outputs_compact = True
    try:
        answer, forced, spaced = choice(schema_ask), choice(tool_ask), choice(loose)
    finally:
        state.structured_outputs_compact = False
    assert answer["finish_reason"] == "stop" and set(json.loads(answer["message"]["content"])) == {"a", "b"}
    assert not re.search(r"\s", _outside_strings(answer["message"]["content"]))
    (call,) = forced["message"]["tool_calls"]
    assert forced["finish_reason"] == "tool_calls" and set(json.loads(call["function"]["arguments"])) == {"a", "b"}
    assert " " in _outside_strings(spaced["message"]["content"])
