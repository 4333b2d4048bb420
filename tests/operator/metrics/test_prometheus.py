"""PrometheusSource against canned Prometheus API answers (httpx MockTransport)."""

from __future__ import annotations

import json
import math
from urllib.parse import parse_qs

import httpx
import pytest

from llmfleet.operator.metrics import promql
from llmfleet.operator.metrics.prometheus import PrometheusSource
from llmfleet.operator.metrics.source import MetricSource, PoolRef, StalenessPolicy

REF = PoolRef("prod", "chat", "decode")
NOW = 1_700_000_000.0
HEALTHY = {
    "ttft:0.5": 0.08,
    "ttft:0.95": 0.31,
    "ttft:0.99": 0.6,
    "ttft:samples": 600.0,
    "itl:0.5": 0.02,
    "itl:0.95": 0.045,
    "itl:0.96": 0.05,
    "itl:0.97": 0.055,
    "itl:0.98": 0.07,
    "itl:0.99": 0.09,
    "itl:samples": 40000.0,
    "queue_time:0.5": 0.001,
    "queue_time:0.95": 0.05,
    "queue_time:0.99": 0.1,
    "queue_time:samples": 600.0,
    "prompt_length:0.5": 150.0,
    "prompt_length:0.95": 480.0,
    "prompt_length:0.99": 505.0,
    "prompt_length:samples": 600.0,
    "request_rate": 10.0,
    "prompt_tokens_per_s": 2560.0,
    "prefix_cache_hits_per_s": 512.0,
    "generation_tokens_per_s": 1280.0,
    "preemptions_per_s": 0.0,
    "steps_per_s": 90.0,
    "waiting_growth_per_s": -0.05,
    "waiting": 1.5,
    "running": 24.0,
    "kv_usage_mean": 0.3,
    "kv_usage_max": 0.55,
    "mean_batch_size": 23.5,
    "mean_step_tokens": 60.0,
    "mean_step_seconds": 0.021,
    "prompt_tokens_per_request": 200.0,
    "ready_pods": 2.0,
    "newest_sample": NOW - 3.0,
}


class FakePrometheus:
    """Answers each of a snapshot's queries from a dict keyed like promql.pool_queries."""

    def __init__(self, values: dict[str, float | None], status: int = 200, fresh_s: float = 60.0) -> None:
        queries = promql.pool_queries(promql.pool_selector(REF), 60, fresh_s)
        self.by_query = {q: values.get(field) for field, q in queries.items()}
        self.status = status
        self.seen: list[dict[str, str]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/api/v1/query"
        form = {k: v[0] for k, v in parse_qs(request.content.decode()).items()}
        self.seen.append(form)
        if self.status != 200:
            body = {"status": "error", "errorType": "unavailable", "error": "TSDB not ready"}
            return httpx.Response(self.status, json=body)
        if form["query"] not in self.by_query:
            return httpx.Response(400, json={"status": "error", "errorType": "bad_data", "error": "unknown query"})
        value = self.by_query[form["query"]]
        result = [] if value is None else [{"metric": {}, "value": [float(form["time"]), _text(value)]}]
        return httpx.Response(
            200, text=json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}})
        )


def _text(value: float) -> str:
    return "NaN" if math.isnan(value) else ("+Inf" if value == math.inf else repr(value))


def source(fake: FakePrometheus, **kw) -> PrometheusSource:
    client = httpx.AsyncClient(transport=httpx.MockTransport(fake))
    return PrometheusSource("http://prometheus:9090/", client=client, clock=lambda: NOW, **kw)


async def test_healthy_snapshot() -> None:
    fake = FakePrometheus(HEALTHY)
    src = source(fake)
    assert isinstance(src, MetricSource)
    m = await src.snapshot(REF, 60)
    assert not m.stale and m.reason == "" and m.missing == {}
    assert (m.ttft.p50, m.ttft.p95, m.ttft.p99, m.ttft.samples) == (0.08, 0.31, 0.6, 600.0)
    assert m.itl.p95 == 0.045 and m.queue_time.p95 == 0.05
    assert m.itl.between == ((0.96, 0.05), (0.97, 0.055), (0.98, 0.07))  # where a busy window reads its tail
    assert m.ttft.between == ()  # only ITL's tail is projected
    assert (m.request_rate, m.prompt_tokens_per_s, m.generation_tokens_per_s) == (10.0, 2560.0, 1280.0)
    assert (m.waiting, m.running, m.kv_usage_max, m.mean_batch_size) == (1.5, 24.0, 0.55, 23.5)
    assert m.ready_pods == 2 and m.newest_sample_age_s == pytest.approx(3.0)
    assert m.prompt_length.p95 == 480.0 and m.mean_prompt_tokens() == 200.0  # the finished requests'
    assert m.uncached_prompt_tokens_per_s() == 2048.0  # what the prefix cache held is no prompt work
    assert {s["time"] for s in fake.seen} == {f"{NOW:.3f}"}  # one instant for every query
    assert len(fake.seen) == len(HEALTHY)


async def test_no_requests_in_window_is_missing_not_zero() -> None:
    values = HEALTHY | {f"ttft:{q}": math.nan for q in ("0.5", "0.95", "0.99")} | {"ttft:samples": 0.0}
    values |= {"mean_batch_size": math.nan}
    m = await source(FakePrometheus(values)).snapshot(REF, 60)
    assert not m.stale
    assert m.ttft.p95 is None and m.ttft.samples == 0.0
    assert m.missing["ttft"] == "ttft: 0 observations in the 60 s window (< 20)"
    assert (
        m.mean_batch_size is None and m.missing["mean_batch_size"] == "mean_batch_size: no engine steps in the window"
    )


async def test_without_the_prompt_length_histogram_the_token_rates_stand_in() -> None:
    """Prompt tokens (counted as prompts run) over finished requests: 2560 / 10."""
    m = await source(FakePrometheus(HEALTHY | {"prompt_tokens_per_request": None})).snapshot(REF, 60)
    assert m.mean_prompt_tokens() == 256.0
    m = await source(FakePrometheus(HEALTHY | {"prompt_tokens_per_request": math.nan})).snapshot(REF, 60)
    assert m.missing["prompt_tokens_per_request"] == "prompt_tokens_per_request: no request finished in the window"
    assert m.mean_prompt_tokens() == 256.0


async def test_too_few_samples_drop_the_quantile() -> None:
    m = await source(FakePrometheus(HEALTHY | {"queue_time:samples": 7.0})).snapshot(REF, 60)
    assert m.queue_time.p95 is None and m.queue_time.samples == 7.0
    assert "7 observations in the 60 s window (< 20)" in m.missing["queue_time"]
    assert m.ttft.p95 == 0.31  # the others stand


async def test_missing_series_are_none_with_a_reason() -> None:
    m = await source(FakePrometheus(HEALTHY | {"prompt_tokens_per_s": None, "itl:samples": None})).snapshot(REF, 60)
    assert m.prompt_tokens_per_s is None and m.missing["prompt_tokens_per_s"] == "prompt_tokens_per_s: no series"
    assert m.itl.p95 is None and m.missing["itl"] == "itl: no histogram series"


async def test_zero_is_a_measured_zero() -> None:
    m = await source(FakePrometheus(HEALTHY | {"request_rate": 0.0, "waiting": 0.0})).snapshot(REF, 60)
    assert m.request_rate == 0.0 and m.waiting == 0.0 and "request_rate" not in m.missing


@pytest.mark.parametrize(
    ("values", "reason"),
    [
        (HEALTHY | {"newest_sample": NOW - 95.0}, "decode: newest sample 95 s old (> 60 s)"),
        (HEALTHY | {"ready_pods": None, "newest_sample": None}, "decode: 0 pods reporting (< 1)"),
        (HEALTHY | {"newest_sample": None}, "decode: age of the newest sample unknown"),
    ],
)
async def test_stale_snapshots(values, reason) -> None:
    m = await source(FakePrometheus(values)).snapshot(REF, 60)
    assert m.stale and m.reason == reason


async def test_server_error_makes_it_stale() -> None:
    m = await source(FakePrometheus(HEALTHY, status=503)).snapshot(REF, 60)
    assert m.stale and "503 unavailable: TSDB not ready" in m.reason


async def test_unreachable_prometheus_makes_it_stale() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    client = httpx.AsyncClient(transport=httpx.MockTransport(refuse))
    m = await PrometheusSource("http://prometheus:9090", client=client, clock=lambda: NOW).snapshot(REF, 60)
    assert m.stale and "unreachable" in m.reason and m.ttft.p95 is None
    malformed = PrometheusSource("http://[::1", clock=lambda: NOW)  # an operator flag's typo: stale, no crash
    m = await malformed.snapshot(REF, 60)
    await malformed.aclose()
    assert m.stale and "InvalidURL" in m.reason


async def test_what_reaches_status_shows_no_password_and_no_long_answer() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    client = httpx.AsyncClient(transport=httpx.MockTransport(refuse))
    secret = PrometheusSource("http://admin:hunter2@prometheus:9090", client=client, clock=lambda: NOW)
    m = await secret.snapshot(REF, 60)
    assert "prometheus at http://***@prometheus:9090 unreachable" in m.reason and "hunter2" not in m.reason

    def chatty(request: httpx.Request) -> httpx.Response:
        return httpx.Response(422, json={"status": "error", "errorType": "bad_data", "error": "x" * 300_000})

    client = httpx.AsyncClient(transport=httpx.MockTransport(chatty))
    m = await PrometheusSource("http://prometheus:9090", client=client, clock=lambda: NOW).snapshot(REF, 60)
    assert m.stale and "x" * 297 + "..." in m.reason and len(m.reason) < 2000


async def test_a_snapshot_waits_no_longer_than_its_timeout_for_all_its_queries() -> None:
    """A Prometheus that would answer after 30 s: the snapshot is stale once timeout_s has passed
    for its queries together (8 at a time: per query, 4 rounds of them would wait 4 times as long)."""
    import asyncio

    async def late(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(30)
        return httpx.Response(200, json={"status": "success", "data": {"resultType": "vector", "result": []}})

    client = httpx.AsyncClient(transport=httpx.MockTransport(late))
    prometheus = PrometheusSource("http://prometheus:9090", client=client, clock=lambda: NOW, timeout_s=0.2)
    m = await asyncio.wait_for(prometheus.snapshot(REF, 60), timeout=20)  # not the 30 s a query takes
    assert m.stale and m.reason == "decode: prometheus at http://prometheus:9090 did not answer within 0.2 s"


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ([1, 2], "JSON that is not an API answer"),
        ({"status": "success", "data": "x"}, "malformed"),
        ({"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}}]}}, "malformed"),
        ({"status": "success", "data": {"resultType": "vector", "result": [{"value": [1, "n/a"]}]}}, "malformed"),
    ],
)
async def test_a_malformed_answer_makes_it_stale(body, says) -> None:
    """A proxy or a look-alike in front of Prometheus: the tuner holds, the operator does not crash."""
    client = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(200, json=body)))
    m = await PrometheusSource("http://prometheus:9090", client=client, clock=lambda: NOW).snapshot(REF, 60)
    assert m.stale and says in m.reason


async def test_policy_is_configurable() -> None:
    policy = StalenessPolicy(max_sample_age_s=2.0, min_samples=1000)
    m = await source(FakePrometheus(HEALTHY, fresh_s=2.0), policy=policy).snapshot(REF, 60)
    assert m.stale and "3 s old (> 2 s)" in m.reason
    assert m.ttft.p95 is None and "600 observations" in m.missing["ttft"]
