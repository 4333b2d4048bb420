"""Bad requests in-process: every one an OpenAI-style 400 (or 404) naming its field, refused
before the engine or the tokenizer spends time on it; what vLLM refuses is refused, what it takes is taken."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from llmfleet.server.config import EngineConfig
from llmfleet.server.openai.app import create_app
from tests.server.openai.helpers import assert_openai_error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "seed": 2**63}, "seed"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "n": 0}, "n"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": {"not": "a prompt"}}, "prompt"),
        ({"prompt": [1, "mixed"]}, "prompt"),
        ({"max_tokens": 4}, "prompt"),
        ({"prompt": "hi", "stop": ["a"] * 17}, "stop"),
        ({"prompt": "hi", "stop": ["a", "x" * 2049]}, "stop"),  # each token's check costs its length
        ({"prompt": "hi", "stop": "x" * 2049}, "stop"),
        ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": "sometimes"}}, "stream_options"),
        # as vLLM refuses them
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "hi", "stop": ""}, "stop"),
        ({"prompt": "hi", "stop": ["x", ""]}, "stop"),
        ({"prompt": [5, 10_000]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "hi", "logit_bias": {"five": 1}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"100000": 1}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"\u00b2": 1}}, "logit_bias"),  # a digit to isdigit, not to int
        ({"prompt": "hi", "logit_bias": {"0" * 5000 + "1": 1}}, "logit_bias"),  # past int()'s digit limit
        ({"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "hi", "frequency_penalty": -2.5}, "frequency_penalty"),
        ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "hi", "min_p": 1.5}, "min_p"),
        # not implemented: refused, since ignoring them would answer another question
        ({"prompt": "hi", "best_of": 3}, "best_of"),
        ({"prompt": "hi", "suffix": "end"}, "suffix"),
        # structured output that cannot be served as asked
        ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"prompt": "hi", "response_format": {"type": "structural_tag"}}, "response_format"),
        ({"prompt": "hi", "response_format": {"type": "yaml"}}, "response_format"),
        ({"prompt": "hi", "guided_json": "{not json"}, "guided_json"),
        ({"prompt": "hi", "guided_json": {"type": "frobnicate"}}, "guided_json"),
        ({"prompt": "hi", "guided_regex": "(["}, "guided_regex"),
        ({"prompt": "hi", "guided_choice": []}, "guided_choice"),
        ({"prompt": "hi", "guided_grammar": "start: missing_rule"}, "guided_grammar"),
        ({"prompt": "hi", "guided_regex": "a+", "guided_choice": ["b"]}, "guided_choice"),
        ({"prompt": "hi", "structured_outputs": {"regx": "a+"}}, "structured_outputs"),
        ({"prompt": "hi", "structured_outputs": {"json_object": True, "structural_tag": "{}"}}, "structured_outputs"),
        ({"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ],
)
def test_bad_completion_values_are_openai_400s(client, body, param):
    error = assert_openai_error(client.post("/v1/completions", json=body), 400, param)
    assert error["type"] == "invalid_request_error"
    assert "pydantic" not in error["message"].lower() and "CompletionRequest" not in error["message"]


def test_prompt_over_the_context_is_a_400_in_vllms_words(client):
    """Clients parse these messages (the numbers in them) to shorten a request and retry."""
    error = assert_openai_error(client.post("/v1/completions", json={"prompt": "x" * 300}), 400, "prompt")
    assert error["type"] == "invalid_request_error"
    assert error["message"] == (
        "This model's maximum context length is 256 tokens. However, your request has 300 input tokens. "
        "Please reduce the length of the input messages."
    )


def test_max_tokens_past_the_context_is_cut_to_it_as_vllm_cuts_it(client):
    """A client's fixed max_tokens (1024 by habit) works on any prompt that fits: vLLM 0.32 cuts
    it to the context's room (its get_max_tokens) where older versions answered 400."""
    for path, body in (
        ("/v1/completions", {"prompt": "x" * 200, "max_tokens": 100, "ignore_eos": True}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x" * 183}], "max_completion_tokens": 100, "ignore_eos": True},
        ),
    ):
        answer = client.post(path, json=body)
        assert answer.status_code == 200, answer.text
        usage = answer.json()["usage"]
        assert usage["prompt_tokens"] == 200 and usage["completion_tokens"] == 256 - 200
        assert answer.json()["choices"][0]["finish_reason"] == "length"


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@pytest.fixture
def tokenizer_calls(state, monkeypatch):
    """Whether each encode and chat templating call ran on the event loop (True) or off it."""
    calls = []
    for name in ("encode", "apply_chat_template"):
        method = getattr(state.tokenizer, name)

        def recorded(*args, _method=method, **kwargs):
            calls.append(_on_event_loop())
            return _method(*args, **kwargs)

        monkeypatch.setattr(state.tokenizer, name, recorded)
    return calls


def test_tokenizing_and_chat_templating_run_off_the_event_loop(client, tokenizer_calls):
    # a 2.4 MB prompt held the event loop, every other request with it, for seconds
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert client.post("/v1/completions", json={"prompt": ["hi", "yo"], "max_tokens": 2}).status_code == 200
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert client.post("/tokenize", json={"prompt": "hi"}).status_code == 200
    assert client.post("/tokenize", json={"messages": chat["messages"]}).status_code == 200
    assert len(tokenizer_calls) == 7 and not any(tokenizer_calls)


TOO_LONG = "x" * (256 * 32 + 1)  # more than any tokenizer fits into the fake model's 256 tokens


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": TOO_LONG}, "prompt"),
        ("/v1/completions", {"prompt": TOO_LONG}, "prompt"),
        ("/v1/completions", {"prompt": ["hi", TOO_LONG]}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": TOO_LONG}]}, "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": TOO_LONG[:5000]}] * 2}, "messages"),
    ],
)
def test_text_the_context_cannot_hold_is_refused_before_tokenizing(client, tokenizer_calls, path, body, param):
    error = assert_openai_error(client.post(path, json=body), 400, param)
    assert "maximum context length of 256 tokens can hold (at most 8192 characters)" in error["message"]
    assert len(tokenizer_calls) == (path == "/v1/completions" and len(body["prompt"]) == 2)  # "hi" only


def test_a_truncation_over_the_context_is_refused_before_a_long_text_is_tokenized(client, tokenizer_calls):
    body = {"prompt": TOO_LONG, "truncate_prompt_tokens": 257, "max_tokens": 2}
    error = assert_openai_error(client.post("/v1/completions", json=body), 400, "truncate_prompt_tokens")
    assert "greater than max_model_len (256)" in error["message"] and tokenizer_calls == []


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": TOO_LONG}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": TOO_LONG}]}),
    ],
)
def test_a_long_text_asked_to_be_truncated_is_truncated_not_refused(client, path, body):
    """truncate_prompt_tokens: a long document cut to its last tokens, as vLLM takes it."""
    reply = client.post(path, json=body | {"truncate_prompt_tokens": 100, "max_tokens": 2})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == 100


def test_a_structured_output_spec_past_the_grammar_cache_is_a_400(make_state):
    # a megabyte of choices took seconds to compile, on the event loop, and then answered ""
    state = make_state()
    state.engine.engine.runner.structured_output = True
    choices = [f"choice-{i}" for i in range(10_000)]  # 130 KB as JSON
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with TestClient(create_app(state)) as client:
        body = {"prompt": "hi", "max_tokens": 2, "guided_choice": choices}
        error = assert_openai_error(client.post("/v1/completions", json=body), 400, "guided_choice")
        assert "too large for structured output: at most 65536 characters" in error["message"]
        schema = {"type": "string", "description": "x" * 70_000}
        body = chat | {"structured_outputs": {"json": schema}}
        assert_openai_error(client.post("/v1/chat/completions", json=body), 400, "structured_outputs.json")
        body = {"prompt": "hi", "max_tokens": 2, "guided_choice": choices[:1000]}
        assert client.post("/v1/completions", json=body).status_code == 200


def test_grammars_compile_off_the_event_loop(make_state, monkeypatch):
    from llmfleet.server.core import grammar

    state = make_state()
    state.engine.engine.runner.structured_output = True
    where, check = [], grammar.check
    monkeypatch.setattr(grammar, "check", lambda structured: where.append(_on_event_loop()) or check(structured))
    with TestClient(create_app(state)) as client:
        body = {"prompt": "hi", "max_tokens": 2, "guided_regex": "[a-z]+"}
        assert client.post("/v1/completions", json=body).status_code == 200
    assert where and not any(where)  # the API's check, then the engine thread's


def test_n_is_bounded_by_the_queue_not_by_16(make_state):
    """vLLM takes any n >= 1; the n choices of each prompt queue at once, so more than the
    waiting queue holds is a 400 naming n, not a 429 a client would retry forever."""
    with TestClient(create_app(make_state(EngineConfig(max_queue_len=24)))) as c:
        out = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "n": 20})
        assert out.status_code == 200, out.text
        assert sorted(choice["index"] for choice in out.json()["choices"]) == list(range(20))
        error = assert_openai_error(c.post("/v1/completions", json={"prompt": "hi", "n": 25}), 400, "n")
        assert "24" in error["message"]
        assert_openai_error(c.post("/v1/completions", json={"prompt": ["a", "b"], "n": 13}), 400, "n")
        chat = {"messages": [{"role": "user", "content": "hi"}], "n": 25}
        assert_openai_error(c.post("/v1/chat/completions", json=chat), 400, "n")


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens_as_vllm(client):
    ask = {"max_tokens": 4, "temperature": 0}
    cut = client.post("/v1/completions", json=ask | {"prompt": "abcdefgh", "truncate_prompt_tokens": 3}).json()
    short = client.post("/v1/completions", json=ask | {"prompt": "fgh"}).json()
    assert cut["choices"][0]["text"] == short["choices"][0]["text"]
    assert cut["usage"]["prompt_tokens"] == 3  # the usage counts the prompt the model was given
    echoed = client.post(
        "/v1/completions", json=ask | {"prompt": [1, 2, 3, 4], "truncate_prompt_tokens": 2, "echo": True}
    ).json()
    assert echoed["choices"][0]["text"].startswith("#$")  # CharTokenizer: token t is chr(32 + t)
    long = client.post("/v1/completions", json=ask | {"prompt": "x" * 300, "truncate_prompt_tokens": 100}).json()
    assert long["usage"]["prompt_tokens"] == 100
    chat = {"messages": [{"role": "user", "content": "hello there"}], "truncate_prompt_tokens": 5} | ask
    assert client.post("/v1/chat/completions", json=chat).json()["usage"]["prompt_tokens"] == 5
    # -1: the context length (a 300-token prompt keeps 256, which leaves no room)
    full = client.post("/v1/completions", json=ask | {"prompt": "x" * 300, "truncate_prompt_tokens": -1})
    assert "your request has 256 input tokens" in assert_openai_error(full, 400, "prompt")["message"]
    over = client.post("/v1/completions", json=ask | {"prompt": "x", "truncate_prompt_tokens": 257})
    assert "greater than max_model_len (256)" in assert_openai_error(over, 400, "truncate_prompt_tokens")["message"]
    assert_openai_error(client.post("/v1/completions", json={"prompt": "x", "truncate_prompt_tokens": -2}), 400)


@pytest.mark.parametrize(
    "extra",
    [{"use_beam_search": True}, {"bad_words": ["x"]}],
)
def test_beam_search_and_bad_words_are_refused_not_ignored(client, extra):
    (field,) = extra
    for path, body in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        error = assert_openai_error(client.post(path, json=body | extra), 400, field)
        assert "not supported" in error["message"]
    assert (
        client.post("/v1/completions", json={"prompt": "hi", "use_beam_search": False, "bad_words": []}).status_code
        == 200
    )


def test_chat_refuses_what_vllm_refuses_and_takes_what_it_takes(client):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for extra, param in (
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
        ({"stop": ""}, "stop"),
    ):
        assert_openai_error(client.post("/v1/chat/completions", json=chat | extra), 400, param)
    for extra in (
        {"stream_options": {}},
        {"stream_options": None},
        {"top_logprobs": 0},
        {"stop": []},
        {"logprobs": True, "top_logprobs": 3},
    ):
        assert client.post("/v1/chat/completions", json=chat | extra).status_code == 200, extra


def test_malformed_json_and_wrong_shapes_are_400_never_422(client):
    raw = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_openai_error(raw, 400)
    assert_openai_error(client.post("/v1/completions", json=["prompt"]), 400)
    assert_openai_error(client.post("/v1/chat/completions", json={"messages": []}), 400, "messages")
    nobody = [{"role": "", "content": "x"}]
    assert_openai_error(client.post("/v1/chat/completions", json={"messages": nobody}), 400, "messages")
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert_openai_error(client.post("/v1/chat/completions", json={"messages": image}), 400, "messages")


def test_tool_choice_auto_needs_a_parser_and_forced_calls_need_their_tools(client, state):
    ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]

    def refused(extra: dict, param: str, words: str) -> None:
        error = assert_openai_error(client.post("/v1/chat/completions", json=ask | extra), 400, param)
        assert words in error["message"], error

    refused({"tools": tools}, "tool_choice", "needs a tool-call parser")  # tools alone mean 'auto'
    refused({"tools": tools, "tool_choice": "auto"}, "tool_choice", "needs a tool-call parser")
    refused({"tool_choice": "required"}, "tools", "has no tools")
    refused(
        {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "other"}}},
        "tool_choice",
        "'other', which is not in tools",
    )
    refused({"tools": tools, "tool_choice": "sometimes"}, "tool_choice", "must be 'none'")
    refused({"tools": [{"type": "function"}], "tool_choice": "none"}, "tools", "each tool must be")
    refused({"tools": tools, "tool_choice": "required", "guided_regex": "a+"}, "tool_choice", "only one kind")
    none = client.post("/v1/chat/completions", json=ask | {"tools": tools, "tool_choice": "none"})
    assert none.status_code == 200, none.text
    state.tool_call_parser = "hermes"  # --enable-auto-tool-choice --tool-call-parser hermes
    for auto in ({"tools": tools}, {"tools": tools, "tool_choice": "auto"}):
        reply = client.post("/v1/chat/completions", json=ask | auto)
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"], reply.text
    refused({"tool_choice": "auto"}, "tools", "needs tools")


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
        ({"chat_template": "{{ messages }}"}, "chat_template", "server's own template"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "tokenize"),
    ],
)
def test_chat_templating_refusals_name_the_field(client, extra, param, words):
    body = {"messages": [{"role": "user", "content": "hi"}]} | extra
    for path in ("/v1/chat/completions", "/tokenize"):
        assert words in assert_openai_error(client.post(path, json=body), 400, param)["message"]


@pytest.mark.parametrize("raw", ['"temperature": NaN', '"logit_bias": {"5": NaN}', '"repetition_penalty": Infinity'])
def test_nan_and_infinity_are_refused(client, raw):
    body = '{"prompt": "hi", "max_tokens": 2, ' + raw + "}"
    response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_openai_error(response, 400, raw.split('"')[1])


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", '{"prompt": "a\\ud800b"}'),
        ("/v1/completions", '{"prompt": "ab", "stop": ["\\udfff"]}'),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}'),
        ("/tokenize", '{"prompt": "a\\ud800"}'),
        ("/v1/completions", '{"prompt": "a", "model": "m\\ud800"}'),
    ],
)
def test_text_that_is_not_valid_unicode_is_a_400(client, path, body):
    # JSON lets a lone UTF-16 surrogate through (\ud800), which no tokenizer can encode
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    assert "not valid Unicode" in assert_openai_error(response, 400)["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
def test_a_long_list_of_token_ids_with_text_in_it_is_a_400(client, path):
    """Long id lists skip the Unicode walk (their field checks every element is an int, in one
    pass), so text hidden in one, valid Unicode or not, is still refused, never tokenized."""
    for tail in ('"\\ud800"', '"ok"', "1.5"):
        body = '{"prompt": [' + "7, " * 100 + tail + "]}"
        response = client.post(path, content=body, headers={"content-type": "application/json"})
        assert response.status_code == 400, (tail, response.text)


def test_an_error_quoting_a_lone_surrogate_still_renders():
    from llmfleet.server.http.errors import error_response

    body = error_response(404, "model 'm\ud800' is not served", "not_found_error").body
    assert json.loads(body)["error"]["message"] == "model 'm\\ud800' is not served"  # escaped


def test_unknown_model_is_404_and_unknown_route_is_json_404(client):
    error = assert_openai_error(client.post("/v1/completions", json={"prompt": "hi", "model": "gpt-9"}), 404, "model")
    assert "gpt-9" in error["message"]
    missing = assert_openai_error(client.post("/v1/embeddings", json={"input": "hi"}), 404)
    assert missing["message"] == "Not Found: POST /v1/embeddings is not served here (GET /openapi.json lists what is)"
    assert client.get("/v1/completions").status_code == 405


def test_unknown_fields_are_ignored(client):
    body = {"prompt": "hi", "max_tokens": 3, "frequency_penalty": 0.5, "suffix": None, "best_of": 1, "x": {"y": 1}}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text


def test_any_role_and_a_refusal_part_reach_the_template_as_vllm_passes_them(client):
    """OpenAI's older ``function`` role, Llama 3's ``ipython``, a model's own roles: vLLM passes
    them to the chat template, which decides; an assistant's refusal part is its text."""
    messages = [
        {"role": "user", "content": "what is 6 x 7?"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I compute with a tool."}]},
        {"role": "function", "name": "multiply", "content": "42"},
        {"role": "ipython", "content": "42"},
        {"role": "robot", "content": "beep"},
    ]
    ask = {"messages": messages, "max_tokens": 1, "echo": True, "add_generation_prompt": False}
    answer = client.post("/v1/chat/completions", json=ask)
    assert answer.status_code == 200, answer.text
    tokens = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    text = client.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    for said in ("I compute with a tool.", "function", "ipython", "robot", "beep"):
        assert said in text, text


def test_a_body_without_a_json_content_type_is_told_so(client):
    """FastAPI reads a body as JSON only under a JSON content type: the 400 says what to send,
    in vLLM's words, not that the body "should be a valid dictionary"."""
    body = b'{"prompt": "hi", "max_tokens": 2}'
    for headers in ({}, {"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}):
        error = assert_openai_error(client.post("/v1/completions", content=body, headers=headers), 400)
        assert error["message"].startswith("Unsupported Media Type: Only 'application/json' is allowed"), headers
    ok = client.post("/v1/completions", content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200
