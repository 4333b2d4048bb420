"""The router in front of a colocated pool, and requests held while a pool has no server: in
process, with the servers answered by a mock transport."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from llmfleet.server.router.balancer import Balancer
from llmfleet.server.router.hold import Holding, HoldSettings
from llmfleet.server.router.proxy import Proxy, ProxySettings
from llmfleet.server.router.router_metrics import RouterMetrics
from llmfleet.server.wire.endpoints import StaticEndpoints

LABELS = {"model_name": "m", "role": "router"}


def _answer(host: str) -> httpx.Response:
    return httpx.Response(200, json={"choices": [{"index": 0, "text": host, "finish_reason": "length"}]})


async def _chunks(body: bytes):
    """A body that arrives as a stream does, in two pieces."""
    yield body[:10]
    yield body[10:]


class Waker:
    description = "a test"

    def __init__(self) -> None:
        self.calls = 0

    async def wake(self) -> None:
        self.calls += 1


async def _colocated(handle, servers: list[str], hold: HoldSettings | None = None, waker=None):
    client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    source = StaticEndpoints([], [], servers)
    balancer = Balancer(source, "load", client, mode="colocated")
    await balancer.refresh()
    metrics = RouterMetrics("m", ("colocated",))
    holding = Holding(balancer, hold or HoldSettings(), metrics, waker)
    return Proxy(balancer, client, metrics, ProxySettings(), holding), balancer, source, metrics


async def test_a_colocated_router_relays_the_request_unchanged_to_the_least_loaded_server():
    sent = []

    def handle(request: httpx.Request) -> httpx.Response:
        sent.append((request.url.host, json.loads(request.content)))
        return _answer(request.url.host)

    proxy, balancer, _, _ = await _colocated(handle, ["http://c1:8000", "http://c2:8000"])
    balancer.servers["colocated"]["http://c1:8000"].others = 3  # another router's requests there
    body = {"prompt": "hi", "max_tokens": 2, "kv_transfer_params": {"remote_url": "http://evil"}}
    opened = await proxy._open("/v1/completions", body, False, 0.0)
    assert json.loads(opened.head[0])["choices"][0]["text"] == "c2"
    assert sent == [("c2", {"prompt": "hi", "max_tokens": 2})]  # no transfer, no client's transfer params
    assert balancer.snapshot().keys() == {"colocated"}


async def test_a_colocated_server_that_refuses_before_its_first_byte_costs_the_client_nothing():
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host == "c1":
            return httpx.Response(503, json={"error": {"message": "draining", "type": "unavailable"}})
        return _answer(request.url.host)

    proxy, balancer, _, metrics = await _colocated(handle, ["http://c1:8000", "http://c2:8000"])
    for _ in range(2):
        opened = await proxy._open("/v1/completions", {"prompt": "hi"}, False, 0.0)
        assert json.loads(opened.head[0])["choices"][0]["text"] == "c2"
    assert not balancer.servers["colocated"]["http://c1:8000"].healthy
    assert metrics.registry.get_sample_value("llmfleet_router_retries_total", LABELS | {"pool": "colocated"}) == 1


async def test_a_request_for_an_empty_pool_is_held_the_waker_asked_and_it_goes_once_a_server_is_ready():
    def handle(request: httpx.Request) -> httpx.Response:
        return _answer(request.url.host)

    waker = Waker()
    proxy, _, source, metrics = await _colocated(handle, [], HoldSettings(timeout_s=10.0), waker)
    started = time.monotonic()
    held = [asyncio.create_task(proxy._open("/v1/completions", {"prompt": str(i)}, False, 0.0)) for i in range(3)]
    await asyncio.sleep(0.3)
    assert proxy.holding.held == 3 and not any(t.done() for t in held)
    assert waker.calls == 1  # at once, once for all three
    assert metrics.registry.get_sample_value("llmfleet_router_held_requests", LABELS) == 3
    source.endpoints["colocated"] = ["http://c1:8000"]  # the first server is ready
    answers = await asyncio.wait_for(asyncio.gather(*held), 5)
    waited = time.monotonic() - started
    assert [json.loads(a.head[0])["choices"][0]["text"] for a in answers] == ["c1"] * 3
    assert proxy.holding.held == 0 and 0.3 <= proxy.holding.last_cold_start_s <= waited
    get = metrics.registry.get_sample_value
    assert get("llmfleet_router_cold_start_seconds_count", LABELS) == 1
    assert get("llmfleet_router_held_total", LABELS) == 3
    assert get("llmfleet_router_held_requests", LABELS) == 0
    await proxy._open("/v1/completions", {"prompt": "later"}, False, 0.0)  # a server there: no hold
    assert get("llmfleet_router_held_total", LABELS) == 3


async def test_a_request_whose_only_server_exited_before_its_endpoint_went_is_held_not_failed():
    """A pool scaled to zero: its last server exits while the endpoint source still lists it."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host == "c1":
            raise httpx.ConnectError("All connection attempts failed", request=request)
        return _answer(request.url.host)

    waker = Waker()
    proxy, balancer, source, metrics = await _colocated(handle, ["http://c1:8000"], HoldSettings(timeout_s=10.0), waker)
    first = asyncio.create_task(proxy._open("/v1/completions", {"prompt": "a"}, False, 0.0))
    await asyncio.sleep(0.3)
    assert not first.done() and proxy.holding.held == 1 and waker.calls == 1
    assert not balancer.has_open("colocated")  # the router knows now: later requests wait at once
    second = asyncio.create_task(proxy._open("/v1/completions", {"prompt": "b"}, False, 0.0))
    await asyncio.sleep(0.1)
    assert proxy.holding.held == 2
    source.endpoints["colocated"] = ["http://c1:8000", "http://c2:8000"]  # woken; c1 not withdrawn yet
    answers = await asyncio.wait_for(asyncio.gather(first, second), 5)
    assert [json.loads(a.head[0])["choices"][0]["text"] for a in answers] == ["c2", "c2"]
    assert metrics.registry.get_sample_value("llmfleet_router_retries_total", LABELS | {"pool": "colocated"}) == 1


async def test_an_unreachable_server_counts_again_once_a_poll_reaches_it():
    reachable = False

    def handle(request: httpx.Request) -> httpx.Response:
        if not reachable:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json={"waiting": 0, "running": 0, "kv_usage": 0.0})

    _, balancer, _, _ = await _colocated(handle, ["http://c1:8000"])
    await balancer._read_load(balancer.servers["colocated"]["http://c1:8000"])
    assert not balancer.has_open("colocated") and balancer.not_ready()
    reachable = True
    await balancer._read_load(balancer.servers["colocated"]["http://c1:8000"])
    assert balancer.has_open("colocated") and balancer.not_ready() is None


async def test_without_holding_a_request_whose_servers_all_refuse_is_a_502_that_says_so():
    def handle(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("All connection attempts failed", request=request)

    proxy, _, _, _ = await _colocated(handle, ["http://c1:8000", "http://c2:8000"])
    refused = await proxy._open("/v1/completions", {"prompt": "a"}, False, 0.0)
    message = json.loads(refused.body)["error"]["message"]
    assert refused.status_code == 502 and message.startswith("no server could take the request after 2 attempts")
    assert message.endswith("last: colocated server: ConnectError('All connection attempts failed')")  # no address


async def test_one_requests_refusal_fails_no_other_request_waiting_on_that_server():
    async def handle(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content)["prompt"] == "busy":
            return httpx.Response(429, json={"error": {"message": "queue full", "type": "rate_limit_exceeded"}})
        await asyncio.sleep(2.5)  # a long whole answer: past two of the router's health checks
        return _answer(request.url.host)

    proxy, _, _, _ = await _colocated(handle, ["http://c1:8000"])
    long = asyncio.create_task(proxy._open("/v1/completions", {"prompt": "long"}, False, 0.0))
    await asyncio.sleep(0.1)
    refused = await proxy._open("/v1/completions", {"prompt": "busy"}, False, 0.0)
    assert refused.status_code == 429
    opened = await asyncio.wait_for(long, 10)
    assert json.loads(opened.head[0])["choices"][0]["text"] == "c1"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_waiting_on_a_server_whose_polls_fail_goes_elsewhere_at_once(stream):
    """A stopped process (SIGSTOP, a lost node): its connections stay open and silent."""

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host == "c1":
            await asyncio.sleep(60)
        if stream:
            events = b'data: {"choices": [{"index": 0, "text": "c2"}]}\n\ndata: [DONE]\n\n'
            return httpx.Response(200, content=_chunks(events), headers={"content-type": "text/event-stream"})
        return _answer(request.url.host)

    proxy, balancer, _, _ = await _colocated(handle, ["http://c1:8000", "http://c2:8000"])
    balancer.servers["colocated"]["http://c2:8000"].others = 5  # c1 looks idler: it is picked first
    started = time.monotonic()
    waiting = asyncio.create_task(proxy._open("/v1/completions", {"prompt": "a", "stream": stream}, stream, 0.0))
    await asyncio.sleep(0.2)
    c1 = balancer.servers["colocated"]["http://c1:8000"]
    c1.poll_failures += 1  # what a streak of timed-out /load polls does
    balancer.failed(c1, "/load timed out 3 times in a row")
    opened = await asyncio.wait_for(waiting, 10)
    assert opened.server.url == "http://c2:8000" and time.monotonic() - started < 5
    assert b"c2" in b"".join(opened.head)


async def test_a_request_whose_only_server_died_under_it_is_held_not_failed():
    """kill -9 mid-request: the connection resets (no refusal yet); a poll then finds it gone."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host == "c1" and request.url.path == "/load":
            raise httpx.ConnectError("All connection attempts failed", request=request)
        if request.url.host == "c1":
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        return _answer(request.url.host)

    proxy, _, source, _ = await _colocated(handle, ["http://c1:8000"], HoldSettings(timeout_s=10.0))
    request = asyncio.create_task(proxy._open("/v1/completions", {"prompt": "a"}, False, 0.0))
    await asyncio.sleep(0.3)
    assert not request.done() and proxy.holding.held == 1
    source.endpoints["colocated"] = ["http://c2:8000"]  # its replacement
    opened = await asyncio.wait_for(request, 5)
    assert json.loads(opened.head[0])["choices"][0]["text"] == "c2"


async def test_a_servers_own_answer_keeps_its_type_and_a_busy_pools_429_is_typed_as_the_servers():
    def handle(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content)["prompt"] == "html":
            return httpx.Response(400, text="<h1>Bad Request</h1>", headers={"content-type": "text/html"})
        return httpx.Response(429, json={"error": {"message": "queue full", "type": "rate_limit_exceeded"}})

    proxy, _, _, _ = await _colocated(handle, ["http://c1:8000"])
    relayed = await proxy._open("/v1/completions", {"prompt": "html"}, False, 0.0)
    assert (relayed.status_code, relayed.media_type) == (400, "text/html")
    busy = await proxy._open("/v1/completions", {"prompt": "a"}, False, 0.0)
    assert busy.status_code == 429 and json.loads(busy.body)["error"]["type"] == "rate_limit_exceeded"


@pytest.mark.parametrize("why", ["timeout", "full"])
async def test_held_requests_are_bounded_in_time_and_number_then_503_with_retry_after(why):
    proxy, _, _, metrics = await _colocated(lambda r: _answer("x"), [], HoldSettings(timeout_s=0.5, max_held=1))
    first = asyncio.create_task(proxy._open("/v1/completions", {"prompt": "a"}, False, 0.0))
    if why == "full":
        await asyncio.sleep(0.05)
        refused = await proxy._open("/v1/completions", {"prompt": "b"}, False, 0.0)
        assert "already wait" in json.loads(refused.body)["error"]["message"]
    else:
        refused = await first
        assert "within 0.5 s" in json.loads(refused.body)["error"]["message"]
    assert refused.status_code == 503 and refused.headers["retry-after"]
    reason = {"reason": why}
    assert metrics.registry.get_sample_value("llmfleet_router_held_refused_total", LABELS | reason) == 1
    await asyncio.gather(first, return_exceptions=True)
    assert proxy.holding.held == 0


async def test_without_holding_an_empty_pool_is_a_503_at_once():
    proxy, _, _, _ = await _colocated(lambda r: _answer("x"), [])
    refused = await proxy._open("/v1/completions", {"prompt": "a"}, False, 0.0)
    assert refused.status_code == 503 and "no colocated server" in json.loads(refused.body)["error"]["message"]


async def test_a_client_that_leaves_while_held_is_no_longer_counted():
    proxy, _, _, _ = await _colocated(lambda r: _answer("x"), [], HoldSettings(timeout_s=30.0))
    task = asyncio.create_task(proxy._open("/v1/completions", {"prompt": "a"}, False, 0.0))
    await asyncio.sleep(0.1)
    assert proxy.holding.held == 1
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert proxy.holding.held == 0
    await asyncio.sleep(0.4)  # the watch sees nobody waiting and ends without a cold start
    assert proxy.holding.last_cold_start_s is None and proxy.holding._watch is None


async def test_the_wake_annotation_is_a_merge_patch_of_the_wake_config_map():
    from llmfleet.server.router.wake import ConfigMapWaker
    from llmfleet.server.wire.wake import WAKE_ANNOTATION, parse_wake_stamp

    seen = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path, request.headers["content-type"], json.loads(request.content)))
        return httpx.Response(200, json={})

    api = httpx.AsyncClient(transport=httpx.MockTransport(handle), base_url="https://api")
    await ConfigMapWaker(api, "ml", "chat-wake").wake()
    ((method, path, kind, body),) = seen
    assert (method, path, kind) == (
        "PATCH",
        "/api/v1/namespaces/ml/configmaps/chat-wake",
        "application/merge-patch+json",
    )
    assert parse_wake_stamp(body["metadata"]["annotations"][WAKE_ANNOTATION]) is not None
