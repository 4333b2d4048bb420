"""No input may produce a 5xx: schemathesis drives the app's own OpenAPI schema, hypothesis
drives the request models with arbitrary JSON."""

from __future__ import annotations

import contextlib

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from llmfleet.server.api.app import ServerState, create_app
from llmfleet.server.api.async_engine import AsyncEngine
from llmfleet.server.api.metrics import ServerMetrics
from llmfleet.server.api.protocol import ChatCompletionRequest, CompletionRequest
from llmfleet.server.config import EngineConfig
from llmfleet.server.engine.build import build_engine


def make_app():
    # a short context keeps every generated request cheap
    engine, tokenizer = build_engine("builtin:tiny", EngineConfig(max_model_len=48, kv_cache_memory_mb=8))
    metrics = ServerMetrics("tiny", "colocated")
    async_engine = AsyncEngine(engine, observers=[metrics.on_step])
    async_engine.start()
    return create_app(ServerState(async_engine, tokenizer, "tiny", 48, metrics)), async_engine


APP, ENGINE = make_app()
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@pytest.fixture(scope="module", autouse=True)
def _stop_engine():
    yield
    ENGINE.shutdown()


@schema.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_gives_a_server_error(case):
    response = case.call()
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and "pydantic" not in error["message"].lower()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)
completion_bodies = st.fixed_dictionaries(
    {"prompt": json_values},
    optional={
        "max_tokens": json_values,
        "temperature": json_values,
        "top_p": json_values,
        "n": json_values,
        "stop": json_values,
        "seed": json_values,
        "stream": json_values,
        "logprobs": json_values,
        "unknown_field": json_values,
    },
)


@given(completion_bodies)
@settings(max_examples=200, deadline=None)
def test_request_models_accept_or_reject_cleanly(body):
    with contextlib.suppress(ValidationError):
        CompletionRequest.model_validate(body)


@given(completion_bodies)
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_app_answers_arbitrary_completion_bodies_without_5xx(body):
    with TestClient(APP) as client:
        body = {**body, "max_tokens": 2} if isinstance(body.get("max_tokens"), int) else body
        response = client.post("/v1/completions", json=body)
    assert response.status_code in (200, 400, 404, 429), response.text


def test_unknown_fields_are_ignored():
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi", "name": "x"}], "frequency_penalty": 0.1, "tools": []}
    )
    assert request.messages[0].text() == "hi"
