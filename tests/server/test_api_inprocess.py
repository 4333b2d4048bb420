"""The HTTP layer in-process, on the real engine loop with the fake hash runner: error shapes,
admission control, drain, SSE framing, echo, metrics names/types/labels. Milliseconds each."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

import llmfleet
from llmfleet.server.config import EngineConfig
from llmfleet.server.http.drain import drain
from llmfleet.server.openai.app import create_app
from tests.server.fakes import CharTokenizer, fake_state


@pytest.fixture
def make_state():
    states = []

    def make(config: EngineConfig | None = None, **runner_kwargs):
        state = fake_state(config, **runner_kwargs)
        states.append(state)
        return state

    yield make
    for state in states:
        state.engine.shutdown()


@pytest.fixture
def state(make_state):
    return make_state()


@pytest.fixture
def client(state):
    with TestClient(create_app(state)) as c:
        yield c


def sse_chunks(response) -> list:
    """Parse an SSE body: the JSON chunks, and the literal [DONE] last."""
    events = [line[len("data: ") :] for line in response.text.split("\n\n") if line]
    assert all(not e.startswith("data:") for e in events)
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def assert_openai_error(response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


# --- errors ----------------------------------------------------------------------------------------
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
    for path, body in (
        ("/v1/completions", {"prompt": "x" * 200, "max_tokens": 100}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 183}], "max_completion_tokens": 100}),
    ):
        error = assert_openai_error(client.post(path, json=body), 400, "max_tokens")
        assert error["type"] == "invalid_request_error"
        assert error["message"] == (
            "'max_tokens' or 'max_completion_tokens' is too large: 100. This model's maximum context length "
            "is 256 tokens and your request has 200 input tokens (100 > 256 - 200)."
        )


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
    robot = [{"role": "robot", "content": "x"}]
    assert_openai_error(client.post("/v1/chat/completions", json={"messages": robot}), 400)
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


def test_chat_template_rejection_is_a_400(client):
    body = {"messages": [{"role": "tool", "content": "result"}]}
    assert_openai_error(client.post("/v1/chat/completions", json=body), 400, "messages")


def rendered(client, **body) -> str:
    """The prompt text a chat request becomes (the fake tokenizer's ids map back to characters)."""
    response = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]} | body)
    assert response.status_code == 200, response.text
    return "".join(chr(32 + t) for t in response.json()["tokens"])


def test_chat_template_takes_tools_and_template_variables_as_vllm_does(client):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    assert rendered(client) == "<user>hi<assistant>"
    assert rendered(client, tools=tools, chat_template_kwargs={"enable_thinking": False}) == (
        "<tool lookup><enable_thinking=False><user>hi<assistant>"
    )
    ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": tools, "tool_choice": "none"}
    plain = client.post("/v1/chat/completions", json=ask | {"tools": None}).json()
    with_tools = client.post("/v1/chat/completions", json=ask).json()
    assert with_tools["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + len("<tool lookup>")


def test_text_parts_reach_the_template_one_per_line_as_vllm_joins_them(client):
    from llmfleet.server.openai.protocol import ChatMessage

    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "World"}]
    assert ChatMessage(role="user", content=parts).for_template()["content"] == "Hello\nWorld"
    joined = rendered(client, messages=[{"role": "user", "content": "Hello\nWorld"}])
    assert rendered(client, messages=[{"role": "user", "content": parts}]) == joined


def test_earlier_tool_calls_reach_the_template_with_their_arguments_as_a_mapping(client):
    """The API carries a call's arguments as a JSON string; chat templates read a mapping (as
    vLLM and transformers pass it), and an empty list of calls is left out."""
    from llmfleet.server.openai.protocol import ChatMessage

    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    called = ChatMessage(role="assistant", content=None, tool_calls=[call, call | {"function": {"name": "now"}}])
    assert called.for_template()["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert called.for_template()["tool_calls"][1] == call | {"function": {"name": "now"}}  # no arguments: as given
    empty = call | {"function": {"name": "now", "arguments": ""}}
    assert ChatMessage(role="assistant", tool_calls=[empty]).for_template()["tool_calls"][0]["function"] == {
        "name": "now",
        "arguments": {},
    }
    assert "tool_calls" not in ChatMessage(role="assistant", content="hi", tool_calls=[]).for_template()
    broken = {"role": "assistant", "tool_calls": [call | {"function": {"name": "x", "arguments": "{oops"}}]}
    body = {"messages": [{"role": "user", "content": "hi"}, broken]}
    assert "JSON" in assert_openai_error(client.post("/v1/chat/completions", json=body), 400, "messages")["message"]


def test_an_earlier_answers_thinking_reaches_the_template_under_both_names():
    """vLLM's ``reasoning`` (or the older ``reasoning_content``) on an assistant message: templates
    read one or the other (Qwen3's, reasoning_content)."""
    from llmfleet.server.openai.protocol import ChatMessage

    for name in ("reasoning", "reasoning_content"):
        message = ChatMessage.model_validate({"role": "assistant", "content": "4", name: "2+2"}).for_template()
        assert (message["reasoning"], message["reasoning_content"], message["content"]) == ("2+2", "2+2", "4")
    assert "reasoning" not in ChatMessage(role="assistant", content="4").for_template()


def test_continue_final_message_and_echo_complete_the_assistants_message(client):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]
    assert rendered(client, messages=messages, add_generation_prompt=False, continue_final_message=True) == (
        "<user>hi<assistant>Once"
    )
    ask = {"messages": messages, "max_tokens": 3, "add_generation_prompt": False, "continue_final_message": True}
    plain = client.post("/v1/chat/completions", json=ask).json()["choices"][0]["message"]["content"]
    echoed = client.post("/v1/chat/completions", json=ask | {"echo": True}).json()["choices"][0]["message"]
    assert echoed == {"role": "assistant", "content": "Once" + plain}
    chunks = sse_chunks(client.post("/v1/chat/completions", json=ask | {"echo": True, "stream": True}))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Once"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Once" + plain
    user_last = {"messages": messages[:1], "max_tokens": 3}  # echo repeats only the assistant's message
    replies = [client.post("/v1/chat/completions", json=user_last | {"echo": echo}).json() for echo in (False, True)]
    assert replies[0]["choices"][0]["message"] == replies[1]["choices"][0]["message"]


def test_without_a_generation_prompt_the_last_message_s_author_goes_on(client):
    # vLLM's: the reply's role is the last message's, and echo repeats that message
    ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "add_generation_prompt": False}
    plain = client.post("/v1/chat/completions", json=ask).json()["choices"][0]["message"]
    assert plain["role"] == "user"
    echoed = client.post("/v1/chat/completions", json=ask | {"echo": True}).json()["choices"][0]["message"]
    assert echoed == {"role": "user", "content": "hi" + plain["content"]}
    chunks = sse_chunks(client.post("/v1/chat/completions", json=ask | {"echo": True, "stream": True}))
    assert chunks[0]["choices"][0]["delta"] == {"role": "user", "content": "hi"}


class BosTokenizer(CharTokenizer):
    """Adds a BOS (id 0) when asked for special tokens, as Llama's tokenizers do."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [0] * add_special_tokens + super().encode(text)


def test_special_tokens_are_added_where_vllm_adds_them(make_state):
    state = make_state()
    state.tokenizer = BosTokenizer()
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    with TestClient(create_app(state)) as c:
        assert c.post("/tokenize", json={"prompt": "hi"}).json()["tokens"][0] == 0  # a prompt: on
        assert c.post("/tokenize", json=chat).json()["tokens"][0] != 0  # messages: the template's own
        assert c.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False}).json()["count"] == 2

        def prompt_tokens(path, body):
            return c.post(path, json=body | {"max_tokens": 1}).json()["usage"]["prompt_tokens"]

        assert prompt_tokens("/v1/completions", {"prompt": "hi"}) == 3
        assert prompt_tokens("/v1/completions", {"prompt": "hi", "add_special_tokens": False}) == 2
        assert prompt_tokens("/v1/completions", {"prompt": [5, 6]}) == 2  # token ids are taken as given
        plain = prompt_tokens("/v1/chat/completions", chat)
        assert prompt_tokens("/v1/chat/completions", chat | {"add_special_tokens": True}) == plain + 1


def test_detokenize_inverts_tokenize_and_version_answers(client):
    tokens = client.post("/tokenize", json={"prompt": "round trip"}).json()["tokens"]
    assert client.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": "round trip"}
    assert_openai_error(client.post("/detokenize", json={"tokens": [10**6]}), 400, "tokens")
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        assert_openai_error(client.post(path, json=body | {"model": "gpt-9"}), 404, "model")
    assert client.get("/version").json() == {"version": llmfleet.__version__}


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


def test_an_error_quoting_a_lone_surrogate_still_renders():
    from llmfleet.server.http.errors import error_response

    body = error_response(404, "model 'm\ud800' is not served", "not_found_error").body
    assert json.loads(body)["error"]["message"] == "model 'm\\ud800' is not served"  # escaped


def test_unknown_model_is_404_and_unknown_route_is_json_404(client):
    error = assert_openai_error(client.post("/v1/completions", json={"prompt": "hi", "model": "gpt-9"}), 404, "model")
    assert "gpt-9" in error["message"]
    assert_openai_error(client.get("/v1/nothing-here"), 404)
    assert client.get("/v1/completions").status_code == 405


def test_unknown_fields_are_ignored(client):
    body = {"prompt": "hi", "max_tokens": 3, "frequency_penalty": 0.5, "suffix": None, "best_of": 1, "x": {"y": 1}}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text


# --- responses -------------------------------------------------------------------------------------
def test_models_card(client):
    (card,) = client.get("/v1/models").json()["data"]
    assert card["id"] == "fake" and card["root"] == "fake" and card["object"] == "model"
    assert card["max_model_len"] == 256 and card["owned_by"] and isinstance(card["created"], int)


def test_every_served_model_name_is_listed_and_taken_and_answers_carry_the_first(state, client):
    state.model_aliases = ("fake-alias",)  # serve --served-model-name fake fake-alias
    assert [card["id"] for card in client.get("/v1/models").json()["data"]] == ["fake", "fake-alias"]
    out = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "model": "fake-alias"})
    assert out.status_code == 200 and out.json()["model"] == "fake"
    error = assert_openai_error(client.post("/v1/completions", json={"prompt": "hi", "model": "x"}), 404, "model")
    assert "`fake`, `fake-alias`" in error["message"]


def test_completion_max_tokens_null_means_the_default_16(client):
    """Current vLLM's: an explicit null is the field's default, not the rest of the context."""
    out = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": None, "ignore_eos": True}).json()
    assert out["usage"]["completion_tokens"] == 16


def test_completion_body_and_usage(client):
    out = client.post("/v1/completions", json={"prompt": ["ab", "cde"], "max_tokens": 5, "n": 2}).json()
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert all(len(c["text"]) == 5 and c["finish_reason"] == "length" for c in out["choices"])
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 20, "total_tokens": 25}


def test_echo_prepends_the_prompt(client):
    plain = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 0}).json()
    echoed = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 0, "echo": True})
    assert echoed.json()["choices"][0]["text"] == "hello" + plain["choices"][0]["text"]
    stream = client.post("/v1/completions", json={"prompt": [72, 73], "max_tokens": 4, "echo": True, "stream": True})
    text = "".join(c["choices"][0]["text"] for c in sse_chunks(stream) if c["choices"])
    assert text.startswith("hi") and len(text) == 6


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_request_id_becomes_the_answer_id_as_vllm(client, stream):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": stream}
    for path, body, prefix in (
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": stream}, "cmpl"),
        ("/v1/chat/completions", chat, "chatcmpl"),
    ):

        def ids(response) -> set[str]:
            assert response.status_code == 200, response.text
            return {c["id"] for c in sse_chunks(response)} if stream else {response.json()["id"]}

        assert ids(client.post(path, json=body, headers={"X-Request-Id": "trace-abc"})) == {f"{prefix}-trace-abc"}
        assert ids(client.post(path, json=body | {"request_id": "mine-42"})) == {f"{prefix}-mine-42"}
        both = client.post(path, json=body | {"request_id": "mine-42"}, headers={"X-Request-Id": "trace-abc"})
        assert ids(both) == {f"{prefix}-trace-abc"}  # the header first, as vLLM
        # the same id twice at once: the engine's own ids stay unique
        assert ids(client.post(path, json=body | {"n": 2}, headers={"X-Request-Id": "again"})) == {f"{prefix}-again"}
        (random,) = ids(client.post(path, json=body))
        assert random.startswith(f"{prefix}-") and len(random) > len(prefix) + 16


def test_completion_stream_framing(client):
    body = {"prompt": "abc", "max_tokens": 6, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    response = client.post("/v1/completions", json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = sse_chunks(response)
    *token_chunks, usage = chunks
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15}
    for index in (0, 1):
        mine = [c["choices"][0] for c in token_chunks if c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) and len("".join(c["text"] for c in mine)) == 6
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + ["length"]
    assert len({c["id"] for c in chunks}) == 1


def test_chat_stream_framing(client):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5, "stream": True}
    chunks = sse_chunks(client.post("/v1/chat/completions", json=body))
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len("".join(c["choices"][0]["delta"].get("content", "") for c in chunks)) == 5
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert all("usage" not in c for c in chunks)  # include_usage not asked


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_count_each_choice_so_far(client, path):
    ask = {"prompt": "abc"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "abc"}]}
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = ask | {"max_tokens": 5, "n": 2, "stream": True, "stream_options": options}
    chunks = sse_chunks(client.post(path, json=body))
    *per_choice, total = chunks
    prompt = total["usage"]["prompt_tokens"]
    so_far = {0: [], 1: []}
    for chunk in per_choice:
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == prompt and usage["total_tokens"] == prompt + usage["completion_tokens"]
        so_far[chunk["choices"][0]["index"]].append(usage["completion_tokens"])
    for counts in so_far.values():
        assert counts == sorted(counts) and counts[-1] == 5
    assert total["choices"] == [] and total["usage"]["completion_tokens"] == 10


def test_chat_without_max_tokens_fits_the_kv_cache(make_state):
    # 16 blocks of 4 tokens: a request can hold 64 tokens, fewer than the 256-token context
    state = make_state(EngineConfig(), num_kv_blocks=16, kv_block_size=4)
    with TestClient(create_app(state)) as client:
        out = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    prompt = out["usage"]["prompt_tokens"]
    assert out["usage"]["completion_tokens"] == 64 - prompt
    assert out["choices"][0]["finish_reason"] == "length"


def test_stop_strings_and_stop_token_ids(client):
    base = client.post("/v1/completions", json={"prompt": "q", "max_tokens": 12, "temperature": 0}).json()
    text = base["choices"][0]["text"]
    cut = client.post("/v1/completions", json={"prompt": "q", "max_tokens": 12, "stop": text[4:6]}).json()
    assert cut["choices"][0]["text"] == text[: text.index(text[4:6])]
    assert cut["choices"][0]["finish_reason"] == "stop"
    stop_id = ord(text[3]) - 32  # CharTokenizer: token t is chr(32 + t)
    by_id = client.post("/v1/completions", json={"prompt": "q", "max_tokens": 12, "stop_token_ids": [stop_id]})
    assert by_id.json()["choices"][0]["finish_reason"] == "stop"
    kept = {"prompt": "q", "max_tokens": 12, "stop": text[4:6], "include_stop_str_in_output": True}
    assert client.post("/v1/completions", json=kept).json()["choices"][0]["text"] == text[: text.index(text[4:6]) + 2]
    # the first min_tokens tokens never stop a request: neither stop strings nor stop tokens in them
    late = {"prompt": "q", "max_tokens": 12, "min_tokens": 7, "stop": text[4:6], "stop_token_ids": [stop_id]}
    out = client.post("/v1/completions", json=late).json()
    assert out["usage"]["completion_tokens"] >= 8 and out["choices"][0]["text"].startswith(text[:7])


def test_stop_reason_names_the_stop_string_or_token_as_vllm(client):
    base = client.post("/v1/completions", json={"prompt": "q", "max_tokens": 12, "temperature": 0}).json()
    text = base["choices"][0]["text"]
    assert base["choices"][0]["stop_reason"] is None  # ran to its length
    stop_id = ord(text[3]) - 32  # CharTokenizer: token t is chr(32 + t)
    # of two stop strings the token completes, the first in the text (the detokenizer cuts there)
    stop = [text[6:8], text[5:7], text[4:5] + "\u00ff", text[4:7]]
    asks = [
        ({"stop": stop}, text[4:7]),
        ({"stop_token_ids": [stop_id]}, stop_id),
        # a stop string in the first min_tokens tokens does not count: the later one ended it
        ({"stop": [text[1], text[8]], "min_tokens": 5, "include_stop_str_in_output": True}, text[8]),
    ]
    assert text[1] not in text[2:9] and text[8] not in text[:8]  # (the hash runner's text is fixed)
    for extra, expected in asks:
        ask = {"prompt": "q", "max_tokens": 12, "temperature": 0} | extra
        out = client.post("/v1/completions", json=ask).json()["choices"][0]
        assert (out["finish_reason"], out["stop_reason"]) == ("stop", expected), (extra, text)
        chunks = sse_chunks(client.post("/v1/completions", json=ask | {"stream": True}))
        assert [c["choices"][0]["stop_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [expected]
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0}
        reply = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
        chat |= {"stop_token_ids": [ord(reply[2]) - 32]}
        assert client.post("/v1/chat/completions", json=chat).json()["choices"][0]["stop_reason"] == ord(reply[2]) - 32
        chunks = sse_chunks(client.post("/v1/chat/completions", json=chat | {"stream": True}))
        assert (
            "stop_reason" not in chunks[0]["choices"][0]
            and chunks[-1]["choices"][0]["stop_reason"] == ord(reply[2]) - 32
        )


# --- admission control and drain -------------------------------------------------------------------
async def test_full_queue_is_429_with_retry_after_and_accepted_requests_finish(make_state):
    # a minute's coalescing window holds 2 new prompts while 6 batch slots are free: they stay queued
    state = make_state(EngineConfig(max_batch_size=8, batch_timeout_ms=60_000, max_queue_len=2))
    transport = httpx.ASGITransport(app=create_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        body = {"prompt": "abc", "max_tokens": 3}
        accepted = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(2)]
        while state.engine.stats.num_waiting < 2:
            await asyncio.sleep(0.01)
        rejected = await client.post("/v1/completions", json=body)
        error = assert_openai_error(rejected, 429)
        assert error["type"] == "rate_limit_exceeded" and rejected.headers["retry-after"] == "1"
        state.engine.flush()  # launch the partial batch
        done = await asyncio.wait_for(asyncio.gather(*accepted), 10)
    assert [r.status_code for r in done] == [200, 200]
    assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in done)


async def test_drain_refuses_new_work_finishes_old_and_times_out(make_state):
    state = make_state(EngineConfig(), step_seconds=0.01)
    app = create_app(state)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        short = asyncio.create_task(client.post("/v1/completions", json={"prompt": "a", "max_tokens": 5}))
        long = asyncio.create_task(client.post("/v1/completions", json={"prompt": "b", "max_tokens": 250}))
        while state.engine.stats.num_running < 2:
            await asyncio.sleep(0.01)
        state.draining = True  # what SIGTERM does first
        # the short one needs 5 steps (50 ms) and the long one 250 (at least 2.5 s): a 1.5 s timeout
        # separates them with room for a slow machine
        draining = asyncio.create_task(drain(state, timeout=1.5))
        assert_openai_error(await client.get("/ready"), 503)
        late = await client.post("/v1/completions", json={"prompt": "c", "max_tokens": 2})
        assert_openai_error(late, 503)
        assert late.headers["retry-after"] == "1"
        assert (await client.get("/health")).status_code == 200  # still alive while draining
        assert (await client.get("/ping")).status_code == (await client.post("/ping")).status_code == 200  # vLLM's
        assert await asyncio.wait_for(draining, 10) == 1  # the long one
        short_out, long_out = (await short).json(), (await long).json()
    assert short_out["choices"][0]["finish_reason"] == "length"
    # past the drain timeout the long one was cut, and its response still ended cleanly
    assert long_out["choices"][0]["finish_reason"] == "abort" and len(long_out["choices"][0]["text"]) < 250
    assert state.engine.num_unfinished == 0 and state.engine.stats.kv_usage == 0


@pytest.mark.parametrize("pause_s", [0.0, 0.6])  # the next choice comes before / after the first finished
async def test_a_drain_finishes_every_choice_of_a_call_it_caught_half_handed_over(make_state, monkeypatch, pause_s):
    """A call's choices reach the engine one add at a time. Under static batching, a drain that
    began between two adds flushed once, the engine launched the first choice alone and ended its
    flush, and the second then waited for a batch that never came: aborted at the drain timeout
    (or, had the first finished before it came, the drain returned and left it behind)."""
    from llmfleet.server.engine import async_engine

    state = make_state(EngineConfig(policy="static", max_batch_size=8), step_seconds=0.01)
    scheduler = state.engine.engine.scheduler
    add, draining = async_engine.AsyncEngine.add, []

    async def add_then_sigterm(self, *args, **kwargs):
        added = await add(self, *args, **kwargs)
        if not draining:  # SIGTERM lands right after the first choice was handed over
            state.draining = True
            draining.append(asyncio.ensure_future(drain(state, timeout=3.0)))
            while not scheduler.running:  # the engine took the flush and launched choice 0 alone
                await asyncio.sleep(0.001)
            await asyncio.sleep(pause_s)
        return added

    monkeypatch.setattr(async_engine.AsyncEngine, "add", add_then_sigterm)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://t") as c:
        answer = await asyncio.wait_for(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 40, "n": 2}), 15)
    assert await asyncio.wait_for(draining[0], 10) == 0  # nothing aborted
    assert [choice["finish_reason"] for choice in answer.json()["choices"]] == ["length", "length"]


# --- metrics ---------------------------------------------------------------------------------------
HISTOGRAMS = [
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_params_max_tokens",
    "vllm:iteration_tokens_total",
    "vllm:request_params_n",
    "vllm:request_max_num_generation_tokens",
    "llmfleet_batch_size",
    "llmfleet_step_duration_seconds",
    "llmfleet_scheduler_duration_seconds",
    "llmfleet_kv_transfer_bytes",
    "llmfleet_kv_transfer_seconds",
]
COUNTERS = [
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:num_preemptions",
    "llmfleet_config_errors",
]
GAUGES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
    "llmfleet_config_generation",
    "llmfleet_config_knob",
    "llmfleet_role_info",
    "llmfleet_requests_in_flight",
]


def test_metrics_names_types_and_labels(client):
    assert client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3}).status_code == 200
    response = client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    for name in HISTOGRAMS:
        assert families[name].type == "histogram", name
    for name in COUNTERS:
        assert families[name].type == "counter", name
    for name in GAUGES:
        assert families[name].type in ("gauge", "info"), name
    assert len(families["vllm:time_to_first_token_seconds"].samples) > 20  # vLLM-like buckets
    steps = {s.labels["le"] for s in families["vllm:iteration_tokens_total"].samples if s.name.endswith("_bucket")}
    assert {"1024.0", "16384.0"} <= steps  # vLLM's: a step's tokens reach the budget, often past 512
    for family in families.values():
        for sample in family.samples:
            assert sample.labels.get("model_name") == "fake", sample
            assert sample.labels.get("role") == "colocated", sample
    text = response.text
    assert 'vllm:request_success_total{finished_reason="length",model_name="fake",role="colocated"} 1.0' in text
    assert 'llmfleet_config_knob{knob="max_batch_size",model_name="fake",role="colocated"} 32.0' in text
    assert 'vllm:cache_config_info{block_size="4"' in text
    (info,) = families["vllm:cache_config_info"].samples
    assert (info.labels["enable_prefix_caching"], info.labels["scheduling"]) == ("True", "fcfs")
    # request sizes, for vLLM's prompt and generation length heatmaps: one finished request
    sizes = {
        s.name: s.value
        for name in ("vllm:request_generation_tokens", "vllm:request_params_max_tokens")
        for s in families[name].samples
        if s.name.endswith(("_sum", "_count"))
    }
    assert sizes == {
        "vllm:request_generation_tokens_sum": 3.0,
        "vllm:request_generation_tokens_count": 1.0,
        "vllm:request_params_max_tokens_sum": 3.0,
        "vllm:request_params_max_tokens_count": 1.0,
    }
    bounds = [float(s.labels["le"]) for s in families["vllm:request_prompt_tokens"].samples if "le" in s.labels]
    assert bounds[:4] == [1.0, 2.0, 5.0, 10.0] and bounds[-1] == float("inf")


def test_every_series_exists_at_zero_before_the_first_request(client):
    """Prometheus takes a series' first sample as its baseline: a histogram born with a pod's
    first request would leave that request out of rate() and the TTFT quantiles."""
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    for name in HISTOGRAMS:
        counts = [s.value for s in families[name].samples if s.name == f"{name}_count"]
        assert counts == [0.0], name
    for name in (
        *COUNTERS,
        "llmfleet_batch_shed",
        "llmfleet_kv_transfer_cached_tokens",
        "llmfleet_kv_import_recomputed",
    ):
        assert [s.value for s in families[name].samples if s.name == f"{name}_total"], name
    failures = {
        s.labels["reason"]: s.value
        for s in families["llmfleet_kv_transfer_failures"].samples
        if s.name.endswith("_total")
    }
    assert failures == {"fetch": 0.0, "mismatch": 0.0}


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_sampling_histograms_observe_each_prompts_n_and_longest_choice(client, stream):
    """vLLM's request_params_n and request_max_num_generation_tokens: one observation per prompt
    once its n choices have finished, the n and the most tokens one of them generated."""
    text = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 6, "temperature": 0}).json()
    cut = text["choices"][0]["text"][2]  # the choices all stop at their third token
    body = {"prompt": ["ab", "ab"], "max_tokens": 6, "n": 3, "temperature": 0, "stream": stream}
    assert client.post("/v1/completions", json=body | {"stop": cut}).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 7, "stream": stream}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    samples = families["vllm:request_params_n"].samples
    buckets = {s.labels["le"]: s.value for s in samples if s.name.endswith("_bucket")}
    assert buckets == {"1.0": 1.0, "2.0": 1.0, "5.0": 3.0, "10.0": 4.0, "20.0": 4.0, "+Inf": 4.0}
    longest = {
        s.name: s.value
        for s in families["vllm:request_max_num_generation_tokens"].samples
        if s.name.endswith(("_sum", "_count"))
    }
    assert longest == {
        "vllm:request_max_num_generation_tokens_sum": 6 + 3 + 3 + 4.0,
        "vllm:request_max_num_generation_tokens_count": 4.0,
    }


async def test_in_flight_gauge_counts_streams_until_they_end(make_state):
    state = make_state(EngineConfig(), step_seconds=0.01)
    gauge = state.metrics.lab(state.metrics.in_flight)
    transport = httpx.ASGITransport(app=create_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        body = {"prompt": "a", "max_tokens": 20, "stream": True}
        task = asyncio.create_task(client.post("/v1/completions", json=body))
        while state.engine.stats.num_running < 1:
            await asyncio.sleep(0.005)
        assert gauge._value.get() == 1
        await client.get("/metrics")  # scrapes are not API work
        assert gauge._value.get() == 1
        assert (await task).status_code == 200
    assert gauge._value.get() == 0


async def test_priority_lower_value_is_served_first(make_state):
    """vLLM's API convention: among waiting requests, the lower ``priority`` value goes first."""
    state = make_state(EngineConfig(max_batch_size=1, scheduling="priority", priority_age_weight=0), step_seconds=0.002)
    transport = httpx.ASGITransport(app=create_app(state))
    finished: list[str] = []

    async def ask(name: str, priority: int, max_tokens: int):
        body = {"prompt": name, "max_tokens": max_tokens, "priority": priority}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200
        finished.append(name)

    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        first = asyncio.create_task(ask("first", 0, 150))  # holds the only batch slot
        while state.engine.stats.num_running < 1:
            await asyncio.sleep(0.002)
        late = [asyncio.create_task(ask(name, prio, 2)) for name, prio in (("low", 5), ("high", -5), ("mid", 0))]
        while state.engine.stats.num_waiting < 3 and not first.done():
            await asyncio.sleep(0.002)
        await asyncio.gather(first, *late)
    assert finished == ["first", "high", "mid", "low"]


async def test_a_caller_that_gives_up_mid_handover_never_stops_the_engine(make_state):
    """A client gone while its request is handed to the engine thread cancels the hand-over; the
    engine skips it instead of crashing on the cancelled future."""
    from llmfleet.server.core.request import SamplingParams

    state = make_state(step_seconds=0.05)
    engine = state.engine
    busy = asyncio.ensure_future(engine.add("busy", [1, 2, 3], SamplingParams(max_tokens=40)))
    await busy  # the engine thread is now stepping; the next command waits for the step's end
    gives_up = asyncio.ensure_future(engine.add("gone", [4, 5, 6], SamplingParams(max_tokens=4)))
    await asyncio.sleep(0)
    gives_up.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gives_up
    events = await asyncio.wait_for(engine.add("after", [7, 8], SamplingParams(max_tokens=2)), 10)
    while not (await asyncio.wait_for(events.get(), 10)).finished:
        pass
    assert engine.alive


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi", "echo": True}),
    ],
    ids=["chat-role-chunk", "completion-echo-chunk"],
)
async def test_a_client_gone_while_the_opening_chunk_is_sent_aborts_the_requests(make_state, path, body):
    """Chat's role chunk and an echoed prompt go out before any token; a client that leaves while
    one is being written (a slow socket) must still abort its requests."""
    state = make_state(step_seconds=0.01)
    app = create_app(state)
    payload = json.dumps(body | {"max_tokens": 200, "stream": True}).encode()
    received = 0

    async def receive():
        nonlocal received
        received += 1
        if received == 1:
            return {"type": "http.request", "body": payload, "more_body": False}
        await asyncio.sleep(0.02)
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body":
            await asyncio.sleep(0.1)  # the write outlasts the client

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    await app(scope, receive, send)
    for _ in range(100):
        if state.engine.num_unfinished == 0:
            break
        await asyncio.sleep(0.01)
    assert state.engine.num_unfinished == 0


async def test_a_drain_ends_even_if_an_aborted_request_never_reports(monkeypatch):
    from types import SimpleNamespace

    from llmfleet.server.http import drain as draining

    monkeypatch.setattr(draining, "_ABORT_GRACE_S", 0.2)
    stuck = SimpleNamespace(num_unfinished=1, alive=True, flush=lambda: None, abort_all=lambda: 1)
    state = SimpleNamespace(engine=stuck, kv_store=None)
    assert await asyncio.wait_for(drain(state, timeout=0.1), 5) == 1


async def test_a_request_handed_over_as_the_engine_loop_crashes_is_refused_not_left_waiting(make_state):
    import threading
    import time as clock

    from llmfleet.server.core.request import SamplingParams

    state = make_state(step_seconds=0.01)
    engine = state.engine
    stream = await engine.add("busy", [1, 2, 3], SamplingParams(max_tokens=40))
    await stream.get()  # the engine thread is stepping

    stepping = threading.Event()

    def crashing_step():
        stepping.set()
        clock.sleep(0.2)  # the next request's hand-over queues up meanwhile
        raise KeyError("a bug outside the runner")

    engine.engine.step = crashing_step
    await asyncio.to_thread(stepping.wait, 5)
    with pytest.raises(RuntimeError, match="not running"):
        await asyncio.wait_for(engine.add("late", [4, 5], SamplingParams(max_tokens=2)), 5)
    assert not engine.alive


def test_the_openapi_document_has_one_id_per_operation(state):
    """Clients generated from /openapi.json name methods by operation id: none may repeat."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FastAPI warns of a duplicate id
        spec = create_app(state).openapi()
    ids = [op["operationId"] for path in spec["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids)) and {"get", "post"} <= set(spec["paths"]["/ping"])
