"""/metrics and /load as vLLM 0.32 has them, so that its dashboards and alerts work unchanged: the
process and GC collectors, prometheus-fastapi-instrumentator's HTTP metrics, every
``finished_reason`` at zero, no finished request recorded for a client's abort (a server's own
abort still is), ``engine="0"`` on every engine series, and ``server_load`` in ``/load``."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from functools import partial

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmfleet.server.http.app import build_app
from llmfleet.server.http.drain import drain
from llmfleet.server.http.state import ServerState
from llmfleet.server.openai.app import create_app
from llmfleet.server.router.balancer import Balancer
from llmfleet.server.router.hold import Holding, HoldSettings
from llmfleet.server.router.proxy import Proxy, ProxySettings
from llmfleet.server.router.router_metrics import RouterMetrics
from llmfleet.server.router.routes import install
from llmfleet.server.wire.endpoints import StaticEndpoints
from tests.server.openai.helpers import post_scope

# vLLM 0.32's FinishReason (vllm/v1/engine/__init__.py), each pre-created by its PrometheusStatLogger
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
# What vLLM records once per finished request (PrometheusStatLogger.record, finished_requests)
PER_FINISHED_REQUEST = (
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_params_max_tokens",
    "vllm:request_time_per_output_token_seconds",
)


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(text: str, name: str, **labels) -> float | None:
    """The one sample ``name`` whose labels include ``labels`` (None: there is none)."""
    found = [
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and labels.items() <= s.labels.items()
    ]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def client_for(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


# -- (a) process and GC collectors, HTTP metrics ------------------------------------------------


def test_metrics_carry_the_process_and_python_collectors(client):
    text = client.get("/metrics").text
    names = families(text)
    assert names["python_gc_objects_collected"].type == "counter"
    assert names["python_info"].type == "gauge"
    if sys.platform == "linux":  # the process collector reads /proc
        assert value(text, "process_resident_memory_bytes") > 0
        assert value(text, "process_start_time_seconds") > 0


def test_http_metrics_have_vllms_names_and_labels_by_route_template(client):
    assert client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3}).status_code == 200
    assert client.get("/v1/models").status_code == 200
    assert client.get("/v1/responses/resp_12345").status_code == 404  # a path parameter
    for i in range(3):  # any path a client makes up: one label value for all of them
        assert client.get(f"/no/such/path/{i}").status_code == 404
    for method in ("FOO", "BAR"):  # and any method
        assert client.request(method, "/v1/models").status_code == 405
    for probe in ("/health", "/ready", "/ping", "/load", "/version"):
        client.get(probe)
    text = client.get("/metrics").text
    names = families(text)
    assert value(text, "http_requests_total", handler="/v1/completions", method="POST", status="2xx") == 1
    assert value(text, "http_requests_total", handler="/v1/models", method="GET", status="2xx") == 1
    assert value(text, "http_requests_total", handler="/v1/responses/{response_id}", method="GET", status="4xx") == 1
    assert value(text, "http_requests_total", handler="none", method="GET", status="4xx") == 3
    assert value(text, "http_requests_total", handler="/v1/models", method="other", status="4xx") == 2
    assert {s.labels["method"] for s in names["http_requests"].samples} == {"GET", "POST", "other"}
    handlers = {s.labels["handler"] for s in names["http_requests"].samples}
    assert handlers == {"/v1/completions", "/v1/models", "/v1/responses/{response_id}", "none"}  # no probe
    assert value(text, "http_request_duration_seconds_count", handler="/v1/completions", method="POST") == 1
    assert value(text, "http_request_duration_highr_seconds_count") == 8  # vLLM's: no labels at all
    assert value(text, "http_request_size_bytes_count", handler="/v1/completions") == 1
    assert value(text, "http_request_size_bytes_sum", handler="/v1/completions") > 0
    assert value(text, "http_response_size_bytes_count", handler="/v1/completions") == 1
    for name in ("http_request_duration_seconds", "http_request_duration_highr_seconds"):
        assert names[name].type == "histogram"
    for name in ("http_request_size_bytes", "http_response_size_bytes"):
        assert names[name].type == "summary"


async def test_a_stream_goes_out_chunk_by_chunk_and_its_duration_covers_it(make_state):
    """The instrumentation is plain ASGI: it passes each chunk on as it comes (nothing buffered),
    and, as vLLM's, times the request to its last byte."""
    state = make_state(step_seconds=0.01)
    app = create_app(state)
    sent: list[tuple[float, bytes]] = []
    body = json.dumps({"prompt": "a", "max_tokens": 30, "stream": True, "ignore_eos": True}).encode()
    start = time.monotonic()
    await _call(app, "/v1/completions", body, lambda chunk: sent.append((time.monotonic(), chunk)))
    tokens = [at for at, chunk in sent if b'"text"' in chunk]
    assert len(tokens) >= 10 and tokens[-1] - tokens[0] > 0.1, "the stream came in one piece"
    async with client_for(app) as c:
        text = (await c.get("/metrics")).text
    assert value(text, "http_requests_total", handler="/v1/completions", method="POST", status="2xx") == 1
    took = value(text, "http_request_duration_seconds_sum", handler="/v1/completions", method="POST")
    assert tokens[-1] - start - 0.05 <= took <= time.monotonic() - start


async def test_the_router_has_the_http_metrics_and_the_collectors_too():
    app, _ = await _router_app()
    async with client_for(app) as c:
        await c.get("/v1/models")
        text = (await c.get("/metrics")).text
    assert value(text, "http_requests_total", handler="/v1/models", method="GET") == 1
    assert value(text, "python_info") == 1


# -- (b) every finished_reason at zero ----------------------------------------------------------


def test_every_finished_reason_of_vllm_exists_at_zero(client):
    text = client.get("/metrics").text
    reasons = {
        s.labels["finished_reason"]: s.value
        for s in families(text)["vllm:request_success"].samples
        if s.name.endswith("_total")
    }
    assert reasons == dict.fromkeys(FINISH_REASONS, 0.0)


# -- (c) aborts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
async def test_a_request_its_client_abandons_is_not_recorded_as_finished(make_state, stream):
    """vLLM drops a client-aborted request from its output processor without stats: no
    request_success{abort}, no e2e or other per-request observation. What it produced before the
    client left (its first token, its tokens) still counts, as vLLM counts those per step."""
    state = make_state(step_seconds=0.01)
    app = create_app(state)
    body = json.dumps({"prompt": "a", "max_tokens": 200, "stream": stream, "ignore_eos": True}).encode()

    async def tokens_out() -> None:
        while state.engine.engine.scheduler.num_running == 0 or state.metrics.lab(state.metrics.ttft)._sum.get() == 0:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)

    await _call(app, "/v1/completions", body, lambda _: None, leave=tokens_out)
    await _until(lambda: state.engine.num_unfinished == 0)
    async with client_for(app) as c:
        text = (await c.get("/metrics")).text
    assert value(text, "vllm:request_success_total", finished_reason="abort") == 0
    for name in PER_FINISHED_REQUEST:
        assert value(text, f"{name}_count") == 0, name
    assert value(text, "vllm:time_to_first_token_seconds_count") == 1
    assert value(text, "vllm:generation_tokens_total") > 0
    assert state.engine.stats.kv_usage == 0  # it was aborted all the same


async def test_a_request_the_server_aborts_at_its_drain_timeout_is_counted(make_state):
    """vLLM's engine counts the requests it aborts itself (a pause or shutdown in abort mode) as
    finished with reason abort, and observes them like any finished request."""
    state = make_state(step_seconds=0.01)
    app = create_app(state)
    async with client_for(app) as c:
        call = asyncio.create_task(c.post("/v1/completions", json={"prompt": "b", "max_tokens": 250}))
        await _until(lambda: state.engine.stats.num_running == 1)
        state.draining = True
        assert await drain(state, timeout=0.2) == 1
        assert (await call).json()["choices"][0]["finish_reason"] == "abort"
        text = (await c.get("/metrics")).text
    assert value(text, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(text, "vllm:e2e_request_latency_seconds_count") == 1


# -- (d) engine="0" ------------------------------------------------------------------------------


def test_every_engine_series_carries_vllms_engine_label(client):
    assert client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3}).status_code == 200
    ours = [
        s
        for f in text_string_to_metric_families(client.get("/metrics").text)
        if f.name.startswith(("vllm:", "llmfleet_"))
        for s in f.samples
    ]
    assert ours
    for sample in ours:
        assert sample.labels.get("engine") == "0", sample
        assert sample.labels.get("model_name") == "fake", sample


async def test_the_router_has_no_engine_label():
    app, _ = await _router_app()
    async with client_for(app) as c:
        text = (await c.get("/metrics")).text
    ours = [s for f in text_string_to_metric_families(text) if f.name.startswith("vllm:") for s in f.samples]
    assert ours and all("engine" not in s.labels for s in ours)


# -- (e) /load ----------------------------------------------------------------------------------


async def test_load_says_server_load_as_vllm_and_keeps_its_own_keys(make_state):
    state = make_state(step_seconds=0.01)
    app = create_app(state)
    async with client_for(app) as c:
        idle = (await c.get("/load")).json()
        assert idle == {"server_load": 0, "waiting": 0, "running": 0, "kv_usage": 0.0} | {
            "role": "colocated",
            "draining": False,
        }
        calls = [
            asyncio.create_task(c.post("/v1/completions", json={"prompt": p, "max_tokens": 40, "stream": s}))
            for p, s in (("a", True), ("b", False))
        ]
        await _until(lambda: state.engine.stats.num_running == 2)
        busy = (await c.get("/load")).json()
        assert busy["server_load"] == 2 and busy["running"] == 2
        await asyncio.gather(*calls)
        assert (await c.get("/load")).json()["server_load"] == 0


async def test_the_routers_load_says_server_load_too():
    app, state = await _router_app()
    async with client_for(app) as c:
        state.in_flight = 3
        assert (await c.get("/load")).json()["server_load"] == 3


# -- helpers ------------------------------------------------------------------------------------


async def _until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def _call(app, path: str, body: bytes, on_body, leave=None) -> None:
    """One POST straight through the ASGI app; ``leave``: the client disconnects once it returns."""
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        if leave is None:
            await asyncio.Event().wait()  # the client stays until the answer is complete
        await leave()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            on_body(message["body"])

    scope = post_scope(path, [(b"content-length", str(len(body)).encode())])
    await app(scope, receive, send)


async def _router_app():
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 64}]})
        return httpx.Response(200, json={"waiting": 0, "running": 0, "kv_usage": 0.0})

    client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    balancer = Balancer(StaticEndpoints([], [], ["http://c1:8000"]), "load", client, mode="colocated")
    await balancer.refresh()
    metrics = RouterMetrics("m", ("colocated",))
    proxy = Proxy(balancer, client, metrics, ProxySettings(), Holding(balancer, HoldSettings(), metrics))
    state = ServerState(None, None, "m", 0, metrics, role="router")
    return build_app(state, partial(install, proxy=proxy, balancer=balancer)), state
