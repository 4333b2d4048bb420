"""No input may produce a 5xx, and every answer is one the OpenAPI document promises (status,
content type, body and headers): schemathesis drives the app's own OpenAPI schema (positive and
negative cases), hypothesis drives the request models and the app with arbitrary JSON.
(tests/robustness runs schemathesis's whole CLI, stateful phase included, on real server and
router processes.)"""

from __future__ import annotations

import contextlib

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from llmfleet.server.config import EngineConfig
from llmfleet.server.openai.app import create_app
from llmfleet.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from tests.server.fakes import fake_state, real_tiny_state

# a short context keeps every generated request cheap
CONTEXT = 48


@pytest.fixture(scope="module")
def app():
    """The real builtin:tiny engine behind the app."""
    state = real_tiny_state(EngineConfig(max_model_len=CONTEXT, kv_cache_memory_mb=8))
    yield create_app(state)
    state.engine.shutdown()


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app) as c:
        yield c


# schemathesis needs its app when it collects; the fake runner (the real engine loop and HTTP layer,
# no model) costs nothing to build, and the schema is the same whatever the model.
FAKE_STATE = fake_state(EngineConfig(max_model_len=CONTEXT), max_model_len=CONTEXT)
_config = schemathesis.Config()
_config.projects.default.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(FAKE_STATE), config=_config)


# Every check on the answers; not the checks of how strictly a request is read (pydantic reads
# "true" as true, and the schema cannot say a token id must be under the vocabulary's size)
CONFORMANCE = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]


@schema.parametrize()
@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_gives_a_server_error(case):
    response = case.call()
    case.validate_response(response, checks=CONFORMANCE)
    assert response.status_code < 500, response.text
    assert response.status_code != 422, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["message"] and "pydantic" not in error["message"].lower()
        assert '"loc"' not in response.text and "input_value" not in response.text  # pydantic's error shape


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)
sampling_fields = {
    "model": json_values,
    "temperature": json_values,
    "top_p": json_values,
    "top_k": json_values,
    "n": json_values,
    "stop": json_values,
    "stop_token_ids": json_values,
    "seed": json_values,
    "stream": json_values,
    "stream_options": json_values,
    "ignore_eos": json_values,
    "priority": json_values,
    "unknown_field": json_values,
}
completion_bodies = st.fixed_dictionaries(
    {"prompt": json_values},
    optional={**sampling_fields, "max_tokens": json_values, "logprobs": json_values, "echo": json_values},
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "bogus"]) | json_values},
        optional={"content": json_values, "name": json_values},
    ),
    max_size=3,
)
chat_bodies = st.fixed_dictionaries(
    {"messages": messages | json_values},
    optional={
        **sampling_fields,
        "max_tokens": json_values,
        "max_completion_tokens": json_values,
        "logprobs": json_values,
        "top_logprobs": json_values,
    },
)


def mostly(valid):
    """A valid value four times in five, else any JSON."""
    return st.integers(0, 4).flatmap(lambda k: valid if k else json_values)


kinds = st.sampled_from(["input_text", "input_image"])
parts = st.fixed_dictionaries({"type": mostly(kinds), "text": mostly(st.just("x"))})
text = mostly(st.just("hi")) | st.lists(parts, max_size=2)
items = st.one_of(
    st.fixed_dictionaries({"role": mostly(st.sampled_from(["user", "assistant", "tool"])), "content": text}),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": mostly(st.just("c")),
            "name": mostly(st.just("f")),
            "arguments": mostly(st.just("{}")),
        }
    ),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": mostly(st.just("c")), "output": text}),
    st.fixed_dictionaries({"type": mostly(st.just("reasoning"))}, optional={"summary": json_values}),
)
formats = st.fixed_dictionaries(
    {"type": mostly(st.sampled_from(["text", "json_object", "json_schema", "grammar"]))},
    optional={"schema": mostly(st.just({"type": "object"})), "name": json_values},
)
tools = st.fixed_dictionaries({"type": mostly(st.just("function")), "name": mostly(st.just("f"))})
# Each field valid or not and the rest mostly valid: a body invalid in several ways would never
# reach the translation
responses_bodies = st.fixed_dictionaries(
    {"input": mostly(st.just("hi") | st.lists(items, min_size=1, max_size=3)), "max_output_tokens": st.just(2)},
    optional={
        "instructions": mostly(st.just("be brief")),
        "text": mostly(st.fixed_dictionaries({"format": mostly(formats)})),
        "tools": st.lists(tools, max_size=2),
        "tool_choice": mostly(st.sampled_from(["none", "required", {"type": "function", "name": "f"}])),
        "include": mostly(st.just(["message.output_text.logprobs"])),
        "stream": st.booleans(),
        "unknown_field": json_values,
    },
)


@given(completion_bodies, chat_bodies)
@settings(max_examples=150, deadline=None)
def test_request_models_accept_or_reject_cleanly(completion, chat):
    """Validation either succeeds or raises ValidationError (which the app turns into a 400)."""
    with contextlib.suppress(ValidationError):
        CompletionRequest.model_validate(completion)
    with contextlib.suppress(ValidationError):
        ChatCompletionRequest.model_validate(chat)


@given(st.text(max_size=40))
@settings(max_examples=50, deadline=None)
def test_any_text_prompt_validates(prompt):
    request = CompletionRequest.model_validate({"prompt": prompt, "n": 2, "stop": "x"})
    assert request.prompt == prompt and request.stop_list() == ["x"]


def _cheap(body: dict) -> dict:
    # keep generation short when a body happens to be valid
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int):
            body[key] = 2
    return body


def _assert_clean(response) -> None:
    assert response.status_code in (200, 400, 404, 429), response.text
    if response.status_code != 200:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@given(completion_bodies)
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_app_answers_arbitrary_completion_bodies_without_5xx(client, body):
    _assert_clean(client.post("/v1/completions", json=_cheap(body)))


@given(chat_bodies)
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_app_answers_arbitrary_chat_bodies_without_5xx(client, body):
    _assert_clean(client.post("/v1/chat/completions", json=_cheap(body)))


@given(responses_bodies)
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
def test_app_answers_arbitrary_responses_bodies_without_5xx(client, body):
    _assert_clean(client.post("/v1/responses", json=body))


@given(st.binary(max_size=64))
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_app_answers_arbitrary_bytes_with_400(client, raw):
    response = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text


def test_unknown_fields_are_ignored():
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi", "name": "x"}], "frequency_penalty": 0.1, "tools": []}
    )
    assert request.messages[0].text() == "hi"


def test_schema_documents_400_not_422(app):
    schema = app.openapi()
    responses = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert "400" in responses and "422" not in responses


@pytest.mark.parametrize("depth", [65, 330, 1000, 100_000])
@pytest.mark.parametrize(
    "path", ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"]
)
def test_json_of_any_depth_is_a_400(client, path, depth, caplog):
    """Even inside an unknown field, and on /tokenize, which needs no API key: a 400 and one log
    line, never pydantic's recursion."""
    body = '{"prompt": "hi", "unknown": ' + "[" * depth + "]" * depth + "}"
    with caplog.at_level("WARNING", logger="llmfleet.server.http.body_guard"):
        response = client.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400 and "nested deeper than 64" in response.json()["error"]["message"]
    assert len([r for r in caplog.records if "nested too deep" in r.getMessage()]) == 1


def test_a_body_past_the_limit_is_a_413_before_it_is_read(app):
    state = app.state.server
    limit, state_limit = 64 * 1024, state.max_body_bytes
    try:
        with TestClient(create_app_with_limit(state, limit)) as small:
            response = small.post("/v1/completions", json={"prompt": "x" * limit})
            assert response.status_code == 413 and set(response.json()["error"]) == {"message", "type", "param", "code"}
            assert small.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
    finally:
        state.max_body_bytes = state_limit


def create_app_with_limit(state, limit: int):
    state.max_body_bytes = limit
    return create_app(state)


def test_a_405_names_every_method_its_path_takes(client):
    response = client.request("TRACE", "/ping")
    assert response.status_code == 405 and response.headers["allow"] == "GET, POST"
