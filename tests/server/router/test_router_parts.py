"""The router's parts without servers: endpoint sources, the balancer's choices and health, and
the stream meter that decides when a retry is no longer possible."""

from __future__ import annotations

import asyncio
import itertools
import json
import math

import httpx
import pytest

from llmfleet.server.router.balancer import SLOW_POLLS, Balancer
from llmfleet.server.router.load import Server
from llmfleet.server.router.policies import (
    CHUNK_CHARS,
    MAX_HOLDERS,
    SLACK,
    PrefixAffinity,
    least_loaded,
    prefix_hashes,
    prompt_text,
)
from llmfleet.server.router.router_metrics import RouterMetrics
from llmfleet.server.router.stream_meter import StreamMeter
from llmfleet.server.wire.endpoints import EndpointsFile, EndpointSlices, StaticEndpoints, ready_urls


def test_ready_urls_follow_the_endpoint_conditions():
    slices = [
        {
            "ports": [{"name": "metrics", "port": 9090}, {"name": "http", "port": 8000}],
            "endpoints": [
                {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
                {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},  # starting or draining
                {"addresses": ["10.0.0.3"]},  # no condition: ready
                {"addresses": ["fd00::4"], "conditions": {"ready": True}},
            ],
        },
        {"ports": [], "endpoints": [{"addresses": ["10.0.0.9"]}]},  # no port: nothing to reach
    ]
    assert ready_urls(slices) == ["http://10.0.0.1:8000", "http://10.0.0.3:8000", "http://[fd00::4]:8000"]


def test_endpoint_slices_are_listed_per_service_and_kept_on_errors():
    calls = []

    def answer(request: httpx.Request) -> httpx.Response:
        calls.append(request.url)
        if "tiny-decode" in str(request.url) and len(calls) > 2:
            return httpx.Response(500)
        ip = "10.0.0.1" if "prefill" in str(request.url) else "10.0.0.2"
        item = {"ports": [{"name": "http", "port": 8000}], "endpoints": [{"addresses": [ip]}]}
        return httpx.Response(200, json={"items": [item]})

    api = httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="https://api")
    source = EndpointSlices({"prefill": "tiny-prefill", "decode": "tiny-decode"}, "ml", api)
    first = asyncio.run(source.fetch())
    assert first == {"prefill": ["http://10.0.0.1:8000"], "decode": ["http://10.0.0.2:8000"]}
    assert "/apis/discovery.k8s.io/v1/namespaces/ml/endpointslices" in str(calls[0])
    assert calls[0].params["labelSelector"] == "kubernetes.io/service-name=tiny-prefill"
    assert asyncio.run(source.fetch()) == first  # the API failed for decode: the last good list stays


def test_the_endpoints_file_is_reread_when_it_changes(tmp_path):
    path = tmp_path / "endpoints.yaml"
    source = EndpointsFile(path)
    assert asyncio.run(source.fetch()) == {"colocated": [], "prefill": [], "decode": []}  # not written yet
    path.write_text("prefill: ['127.0.0.1:1']\ndecode: ['http://127.0.0.1:2/']\n")
    want = {"colocated": [], "prefill": ["http://127.0.0.1:1"], "decode": ["http://127.0.0.1:2"]}
    assert asyncio.run(source.fetch()) == want
    path.write_text("prefill: [unclosed")
    assert asyncio.run(source.fetch())["decode"] == ["http://127.0.0.1:2"]  # unreadable: the last good list


def servers(*specs) -> dict[str, Server]:
    return {s.url: s for s in (Server(url, "decode", **kw) for url, kw in specs)}


def balancer(policy: str = "load") -> Balancer:
    return Balancer(StaticEndpoints([], []), policy, httpx.AsyncClient())


def test_least_loaded_counts_the_routers_own_requests_and_kv():
    idle = Server("a", "decode")
    others = Server("b", "decode", others=2)  # another router's two requests, as the last poll found
    full = Server("c", "decode", kv_usage=0.9)
    assert least_loaded([others, full, idle]) is idle
    idle.assigned = 3  # sent since the last poll
    assert least_loaded([others, full, idle]) is others


def test_a_request_yet_to_start_weighs_more_than_one_decoding():
    """A new prompt waits behind the prefills ahead of it; decoding streams only share the steps."""
    decoding = Server("a", "decode", assigned=3)
    prefilling = Server("b", "decode", assigned=1, unstarted=1)
    assert least_loaded([prefilling, decoding]) is decoding
    decoding.assigned = 5
    assert least_loaded([prefilling, decoding]) is prefilling


def test_pick_prefers_healthy_falls_back_to_set_aside_and_never_draining():
    b = balancer()
    b.servers["decode"] = servers(
        ("a", {"healthy": False, "failures": 2}), ("b", {"healthy": False, "failures": 1}), ("c", {"draining": True})
    )
    assert b.pick("decode").url == "b"  # nothing healthy: the one that failed least, not a 503
    assert b.pick("decode", exclude={"b"}).url == "a"
    assert b.pick("decode", exclude={"a", "b"}) is None  # the draining one is never chosen
    b.servers["decode"]["a"].healthy = True
    assert b.pick("decode").url == "a"
    assert b.not_ready() is None
    b.servers["decode"] = servers(("c", {"draining": True}))
    assert "no decode server" in b.not_ready()


async def test_a_pool_with_no_server_left_is_rediscovered_before_giving_up():
    """The table knows one decode server, which drains; its replacement is in the source already
    (ready since the last discovery): the pick re-reads the source instead of answering 503."""
    source = StaticEndpoints([], ["http://old:8000"])
    b = Balancer(source, "load", httpx.AsyncClient())
    await b.refresh()
    b.servers["decode"]["http://old:8000"].draining = True
    source.endpoints["decode"] = ["http://new:8000"]
    assert b.pick("decode") is None
    assert (await b.pick_or_rediscover("decode")).url == "http://new:8000"
    assert await b.pick_or_rediscover("decode", exclude={"http://new:8000"}) is None


def test_round_robin_takes_turns():
    b = balancer("round-robin")
    b.servers["decode"] = servers(("a", {}), ("b", {"waiting": 9}))
    assert [b.pick("decode").url for _ in range(4)] == ["a", "b", "a", "b"]
    with pytest.raises(ValueError, match="unknown router policy"):
        balancer("random")


def conversation(*turns: str) -> dict:
    roles = itertools.cycle(["user", "assistant"])
    return {"messages": [{"role": next(roles), "content": t} for t in turns]}


def test_a_longer_conversation_shares_its_earlier_turns_prefix_hashes():
    system = "You are a terse assistant. " * 20
    first = prefix_hashes(conversation(system, "What is a KV cache?"))
    later = prefix_hashes(conversation(system, "What is a KV cache?", "Keys and values.", "And paging?"))
    assert len(first) >= len(system) // CHUNK_CHARS and later[: len(first) - 1] == first[:-1]
    other = prefix_hashes(conversation("Another system prompt entirely. " * 20, "What is a KV cache?"))
    assert not set(other) & set(first)
    assert prefix_hashes({"prompt": "x" * (CHUNK_CHARS - 1)}) == []  # no whole chunk: nothing to match
    assert prompt_text({"prompt": ["first", "second"]}) == "first"  # a batch: its first prompt
    assert prompt_text({"prompt": [1, 2, 3]}) == "[1, 2, 3]"  # token ids


def test_prefix_affinity_follows_the_prefix_while_load_allows():
    policy = PrefixAffinity()
    a, b = Server("a", "decode"), Server("b", "decode", others=1)
    system = "A long shared system prompt. " * 30
    turn = prefix_hashes({"prompt": system + "first question"})
    assert policy([a, b], turn) is a  # nothing known: the least loaded
    a.assigned = a.unstarted = 1  # now b is the least loaded, a within the slack
    assert policy([a, b], prefix_hashes({"prompt": system + "second question"})) is a
    assert policy([a, b], prefix_hashes({"prompt": "unrelated " * 40})) is b
    a.assigned = a.unstarted = 3  # a's queue is past the slack: load wins, and b takes the prefix
    assert a.score > b.score + SLACK
    assert policy([a, b], prefix_hashes({"prompt": system + "third"})) is b
    thread = system + "A conversation b took on. " * 10
    assert policy([a, b], prefix_hashes({"prompt": thread})) is b
    a.assigned = a.unstarted = 0
    # both took the system prompt: the less loaded of them; b alone took the thread's longer prefix
    assert policy([a, b], prefix_hashes({"prompt": system + "fourth"})) is a
    assert policy([a, b], prefix_hashes({"prompt": thread + "its next turn"})) is b
    assert policy([a], turn) is a  # a prefix's server gone from the candidates: another one


def test_prefix_affinity_remembers_the_most_recent_servers_of_a_prefix():
    # pods come and go under autoscaling: a prefix every request shares keeps its latest takers
    policy = PrefixAffinity()
    shared = prefix_hashes({"prompt": "s" * (2 * CHUNK_CHARS)})
    gone = [Server(f"http://10.0.{i // 250}.{i % 250}:8000", "decode") for i in range(MAX_HOLDERS + 10)]
    for server in gone:
        assert policy([server], shared) is server
    assert len(policy._servers_of[shared[-1]]) == MAX_HOLDERS
    assert gone[0].url not in policy._servers_of[shared[-1]] and gone[-1].url in policy._servers_of[shared[-1]]
    # a holder taken again moves to the most recent end: the oldest other one goes next
    assert policy([gone[10]], shared) is gone[10]
    policy([Server("http://new:8000", "decode")], shared)
    assert gone[10].url in policy._servers_of[shared[-1]] and gone[11].url not in policy._servers_of[shared[-1]]


@pytest.mark.parametrize(("max_prefixes", "remembered"), [(100, True), (3, False)])
def test_prefix_affinity_forgets_the_least_recent_prefixes_first(max_prefixes, remembered):
    policy = PrefixAffinity(max_prefixes=max_prefixes)
    a, b = Server("a", "decode"), Server("b", "decode", others=1)
    old = prefix_hashes({"prompt": "o" * (3 * CHUNK_CHARS)})  # three prefixes
    assert policy([a, b], old) is a
    a.others = 2  # b is the least loaded now, a within the slack
    assert policy([a, b], prefix_hashes({"prompt": "n" * (3 * CHUNK_CHARS)})) is b  # three more
    assert policy([a, b], old) is (a if remembered else b)


def test_polls_set_servers_aside_and_back():
    state = {"mode": "ok"}

    def answer(request: httpx.Request) -> httpx.Response:
        if state["mode"] == "slow":
            raise httpx.ReadTimeout("slow", request=request)
        if state["mode"] == "refused":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json={"waiting": 3, "running": 2, "kv_usage": 0.5, "draining": False})

    b = Balancer(StaticEndpoints([], ["http://d"]), "load", httpx.AsyncClient(transport=httpx.MockTransport(answer)))

    async def scenario():
        await b.refresh()
        server = b.servers["decode"]["http://d"]
        await b._poll_one(server)
        assert (server.waiting, server.running, server.kv_usage, server.healthy) == (3, 2, 0.5, True)
        assert server.others == 5  # this router sent none of the five
        server.assigned = 4
        await b._poll_one(server)
        assert server.others == 1
        server.assigned = 7  # two more sent while the poll was under way
        await b._poll_one(server)
        assert server.others == 0
        server.assigned = 0
        state["mode"] = "slow"
        for _ in range(SLOW_POLLS - 1):
            await b._poll_one(server)
        assert server.healthy  # busy is not dead
        await b._poll_one(server)
        assert not server.healthy
        state["mode"] = "ok"
        await b._poll_one(server)
        assert server.healthy
        state["mode"] = "refused"
        await b._poll_one(server)
        assert not server.healthy  # refused at once

    asyncio.run(scenario())


def sse(chunk) -> bytes:
    data = chunk if isinstance(chunk, str) else json.dumps(chunk)
    return f"data: {data}\n\n".encode()


def test_the_stream_meter_sees_content_across_split_chunks():
    metrics = RouterMetrics("m")
    meter = StreamMeter(metrics, started=0.0)
    role = sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
    meter.feed(role)
    assert not meter.started_content  # the role chunk is no content: a retry is still free
    token = sse({"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]})
    meter.feed(token[:10])
    assert not meter.started_content
    meter.feed(token[10:])
    assert meter.started_content and meter.first_at is not None
    meter.feed(sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}) + sse("[DONE]"))
    assert meter.finish_reason == "length" and meter.done
    called = StreamMeter(metrics, started=0.0)  # a forced tool call's arguments are its content
    called.feed(
        sse({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}}]})
    )
    assert called.started_content
    thinking = StreamMeter(metrics, started=0.0)  # a reasoning model's thinking streams at once
    thinking.feed(sse({"choices": [{"index": 0, "delta": {"reasoning_content": "Hmm"}, "finish_reason": None}]}))
    assert thinking.started_content


def test_echoed_text_is_no_first_token():
    metrics = RouterMetrics("m")
    chat = StreamMeter(metrics, started=0.0, echo=True)
    chat.feed(sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Once"}}]}))
    assert not chat.started_content  # the echoed message: held, and a retry is still free
    chat.feed(sse({"choices": [{"index": 0, "delta": {"content": " upon"}}]}))
    assert chat.started_content
    completion = StreamMeter(metrics, started=0.0, echo=True)
    for index in (0, 1):  # n=2: each choice opens with the echoed prompt
        completion.feed(sse({"choices": [{"index": index, "text": "Tell me", "finish_reason": None}]}))
    assert not completion.started_content
    completion.feed(sse({"choices": [{"index": 1, "text": " a", "finish_reason": None}]}))
    assert completion.started_content
    labels = {"model_name": "m", "role": "router"}
    assert metrics.registry.get_sample_value("vllm:time_to_first_token_seconds_count", labels) == 2


def test_a_scored_prompt_skips_the_prefill_pool():
    from llmfleet.server.router.proxy import _scores_the_prompt

    assert _scores_the_prompt("/v1/completions", {"echo": True, "logprobs": 0})
    assert _scores_the_prompt("/v1/chat/completions", {"prompt_logprobs": 1})
    assert not _scores_the_prompt("/v1/completions", {"echo": True})
    assert not _scores_the_prompt("/v1/chat/completions", {"echo": True, "logprobs": False})  # chat's echo is text


def test_our_clients_let_idle_connections_go_before_our_servers_do():
    """Else a pooled connection reused in the instant the server closes it fails before a byte."""
    from llmfleet.server.wire.keepalive import CLIENT_KEEPALIVE_EXPIRY_S, SERVER_KEEP_ALIVE_S, pooled

    assert CLIENT_KEEPALIVE_EXPIRY_S < SERVER_KEEP_ALIVE_S
    assert pooled(max_connections=4).keepalive_expiry == CLIENT_KEEPALIVE_EXPIRY_S


async def _proxy(handle, prefill: list[str], decode: list[str]):
    """A Proxy over ``handle`` (request -> response) for every server, without polls."""
    from llmfleet.server.router.proxy import Proxy, ProxySettings

    client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    b = Balancer(StaticEndpoints(prefill, decode), "load", client)
    await b.refresh()
    metrics = RouterMetrics("m")
    return Proxy(b, client, metrics, ProxySettings()), b, metrics


def _kv_ids(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"kv_transfer_params": {"remote_kv_ids": ["k"]}})


def _answer() -> httpx.Response:
    return httpx.Response(200, json={"choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]})


async def test_a_kv_fetch_failure_sets_the_prefill_server_aside_not_the_decode_server():
    fetched_from = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host.startswith("p"):
            return _kv_ids(request)
        remote = json.loads(request.content)["kv_transfer_params"]["remote_url"]
        fetched_from.append(remote)
        if remote == "http://p1:8000":  # it answered ids, then lost the KV (died, evicted)
            error = {"message": "cannot fetch the KV from the prefill server", "type": "kv_transfer_failed"}
            return httpx.Response(502, json={"error": error})
        return _answer()

    proxy, b, _ = await _proxy(handle, ["http://p1:8000", "http://p2:8000"], ["http://d1:8000"])
    opened = await proxy._open("/v1/completions", {"prompt": "hi"}, False, 0.0)
    assert json.loads(opened.head[0])["choices"][0]["text"] == "ok"
    assert fetched_from == ["http://p1:8000", "http://p2:8000"]  # the one decode server, kept
    assert b.servers["decode"]["http://d1:8000"].healthy
    assert not b.servers["prefill"]["http://p1:8000"].healthy


async def test_a_failing_prefill_pool_falls_back_to_the_decode_servers_prefill():
    """Three prefill servers fail: they cost no decode attempt, and the decode server computes the
    prompt itself rather than the client getting a 502."""
    prefilled_elsewhere = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host.startswith("p"):
            raise httpx.ConnectError("connection refused", request=request)
        prefilled_elsewhere.append(json.loads(request.content).get("kv_transfer_params"))
        return _answer()

    prefill = ["http://p1:8000", "http://p2:8000", "http://p3:8000"]
    proxy, b, metrics = await _proxy(handle, prefill, ["http://d1:8000"])
    opened = await proxy._open("/v1/completions", {"prompt": "hi"}, False, 0.0)
    assert json.loads(opened.head[0])["choices"][0]["text"] == "ok"
    assert prefilled_elsewhere == [None]
    assert not any(s.healthy for s in b.servers["prefill"].values())
    labels = {"model_name": "m", "role": "router"}
    assert metrics.registry.get_sample_value("llmfleet_router_local_prefills_total", labels) == 1
    opened = await proxy._open("/v1/completions", {"prompt": "hi"}, False, 0.0)  # set aside: not tried again
    assert prefilled_elsewhere == [None, None]
    assert metrics.registry.get_sample_value("llmfleet_router_retries_total", labels | {"pool": "prefill"}) == 3


async def test_a_decode_server_that_breaks_off_mid_event_leaves_no_half_event_in_the_stream():
    from llmfleet.server.router.proxy import _Relay

    token = sse({"choices": [{"index": 0, "text": "Hello", "finish_reason": None}]})

    class BreaksOff(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield token + token[:25]
            raise httpx.RemoteProtocolError("peer closed connection")

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=BreaksOff(), headers={"content-type": "text/event-stream"})

    proxy, _, metrics = await _proxy(handle, [], ["http://d1:8000"])
    opened = await proxy._open("/v1/completions", {"prompt": "hi", "stream": True}, True, 0.0)
    relay = _Relay(opened, metrics, 0.0)
    relayed = b"".join([chunk async for chunk in relay])
    await relay.aclose()
    events = [e for e in relayed.split(b"\n\n") if e]
    assert events[0] + b"\n\n" == token
    assert json.loads(events[1].removeprefix(b"data: "))["error"]["code"] == 502  # whole, parseable
    assert events[2] == b"data: [DONE]" and len(events) == 3
    abort = {"model_name": "m", "role": "router", "finished_reason": "abort"}
    assert metrics.registry.get_sample_value("vllm:request_success_total", abort) == 1  # the router's own abort


async def test_a_request_counts_as_unstarted_until_its_first_content_and_assigned_until_it_ends():
    from llmfleet.server.router.proxy import _Relay

    seen: dict[str, tuple[int, int]] = {}
    role = sse({"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
    token = sse({"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": "stop"}]})
    proxy_ready = asyncio.Event()

    class Stream(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield role  # a chat's opening chunk: no token yet
            await proxy_ready.wait()
            yield token + b"data: [DONE]\n\n"

    def handle(request: httpx.Request) -> httpx.Response:
        decode = b.servers["decode"]["http://d1:8000"]
        if request.url.host == "p1":
            seen["during prefill: prefill, decode"] = (
                b.servers["prefill"]["http://p1:8000"].unstarted,
                decode.unstarted,
            )
            return _kv_ids(request)
        return httpx.Response(200, stream=Stream(), headers={"content-type": "text/event-stream"})

    proxy, b, metrics = await _proxy(handle, ["http://p1:8000"], ["http://d1:8000"])
    decode = b.servers["decode"]["http://d1:8000"]
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    opening = asyncio.create_task(proxy._open("/v1/chat/completions", body, True, 0.0))
    while not decode.unstarted or "during prefill: prefill, decode" not in seen:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert (decode.assigned, decode.unstarted) == (1, 1)  # the opening chunk came: still no token
    proxy_ready.set()
    relay = _Relay(await opening, metrics, 0.0)
    assert seen["during prefill: prefill, decode"] == (1, 1)
    assert (decode.assigned, decode.unstarted) == (1, 0)  # streaming: started, not finished
    assert b"Hi" in b"".join([chunk async for chunk in relay])
    await relay.aclose()
    assert (decode.assigned, decode.unstarted) == (0, 0)
    assert b.servers["prefill"]["http://p1:8000"].unstarted == 0


def test_the_router_exports_no_engine_gauges_and_the_engines_finish_reasons():
    metrics = RouterMetrics("m")
    metrics.finished(0.0, "tool_calls")
    text = metrics.registry.get_sample_value
    labels = {"model_name": "m", "role": "router"}
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert text(gauge, labels) is None, gauge  # a 0 here would pull the servers' averages down
    assert text("vllm:request_success_total", labels | {"finished_reason": "stop"}) == 1
    assert text("vllm:request_success_total", labels | {"finished_reason": "tool_calls"}) is None


async def test_bodies_pythons_json_reads_reach_the_servers_for_their_own_400():
    """NaN and a lone surrogate parse, but httpx's encoder refuses them: the router answered 500."""
    seen = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.content)
        return httpx.Response(400, json={"error": {"message": "temperature: Input should be a finite number"}})

    proxy, _, _ = await _proxy(handle, [], ["http://d1:8000"])
    for body in ({"prompt": "hi", "temperature": math.nan}, {"prompt": "\ud800"}):
        answered = await proxy._open("/v1/completions", body, False, 0.0)
        assert answered.status_code == 400
    assert b"NaN" in seen[0] and b"\\ud800" in seen[1]


async def test_a_clients_kv_transfer_params_never_reach_a_decode_server():
    """With no prefill server, the decode server prefills itself; the client's own transfer
    parameters would have had it fetch "KV" from a URL of the client's choosing."""
    sent = []

    def handle(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return _answer()

    proxy, _, _ = await _proxy(handle, [], ["http://d1:8000"])
    forged = {"do_remote_prefill": True, "remote_url": "http://internal:9000/admin#", "remote_kv_ids": ["x"]}
    await proxy._open("/v1/completions", {"prompt": "hi", "kv_transfer_params": forged}, False, 0.0)
    assert sent == [{"prompt": "hi"}]


@pytest.mark.parametrize(("value", "streams"), [("false", False), ("0", False), ("no", False), ("on", True), (1, True)])
def test_stream_is_read_as_the_servers_read_it(value, streams):
    from llmfleet.server.router.stream_meter import flag

    assert flag(value) is streams
    assert flag(None) is False and flag("maybe") is False  # the server's 400 says what is wrong


async def test_a_whole_answer_is_waited_for_past_the_read_timeout_while_its_server_answers_polls(monkeypatch):
    """A non-streaming answer sends nothing until it is complete: the per-read decode timeout cut
    off every generation longer than it (a 502, and the request run again elsewhere)."""
    from llmfleet.server.router import proxy as proxy_module
    from llmfleet.server.router.proxy import Proxy, ProxySettings

    monkeypatch.setattr(proxy_module, "HEALTH_CHECK_S", 0.05)

    async def handle(request: httpx.Request) -> httpx.Response:
        assert request.extensions["timeout"]["read"] is None
        await asyncio.sleep(0.3)  # a long generation
        return _answer()

    client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    b = Balancer(StaticEndpoints([], ["http://d1:8000", "http://d2:8000"]), "load", client)
    await b.refresh()
    proxy = Proxy(b, client, RouterMetrics("m"), ProxySettings(decode_timeout_s=0.1))
    opened = await proxy._open("/v1/completions", {"prompt": "hi"}, False, 0.0)
    assert json.loads(opened.head[0])["choices"][0]["text"] == "ok"

    # a server the polls lose meanwhile (its node gone: no reset) fails it, and another takes it
    async def lose_the_first_picked():
        await asyncio.sleep(0.1)
        first = next(s for s in b.servers["decode"].values() if s.assigned)
        b.failed(first, "/load: ConnectTimeout")

    loser = asyncio.create_task(lose_the_first_picked())
    opened = await proxy._open("/v1/completions", {"prompt": "hi"}, False, 0.0)
    await loser
    assert json.loads(opened.head[0])["choices"][0]["text"] == "ok"
    assert [s.healthy for s in b.servers["decode"].values()].count(False) == 1


async def test_the_502_counts_the_attempts_made():
    def handle(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    proxy, _, _ = await _proxy(handle, [], ["http://d1:8000"])
    answered = await proxy._open("/v1/completions", {"prompt": "hi"}, False, 0.0)
    assert answered.status_code == 502
    assert "after 1 attempt;" in json.loads(answered.body)["error"]["message"]  # not 2: nothing else was tried


async def test_a_client_gone_before_the_answer_opened_is_no_finished_request():
    """As the servers count it, and vLLM: no request_success{abort}, no end-to-end latency."""
    from llmfleet.server.router.proxy import Proxy, ProxySettings

    async def handle(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(10)  # a long prefill: the client leaves first
        return _kv_ids(request)

    client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    b = Balancer(StaticEndpoints(["http://p1:8000"], ["http://d1:8000"]), "load", client)
    await b.refresh()
    metrics = RouterMetrics("m")
    proxy = Proxy(b, client, metrics, ProxySettings())

    class Gone:
        async def receive(self):
            await asyncio.sleep(0.05)
            return {"type": "http.disconnect"}

    response = await proxy.serve("/v1/completions", {"prompt": "hi"}, Gone())
    assert response.status_code == 499
    labels = {"model_name": "m", "role": "router", "finished_reason": "abort"}
    assert metrics.registry.get_sample_value("vllm:request_success_total", labels) == 0
    e2e = metrics.registry.get_sample_value(
        "vllm:e2e_request_latency_seconds_count", {"model_name": "m", "role": "router"}
    )
    assert e2e == 0
    assert b.servers["prefill"]["http://p1:8000"].assigned == 0


@pytest.mark.parametrize("refusing", ["prefill", "decode"])
async def test_a_server_refusing_the_routers_transfer_token_costs_the_client_nothing(refusing):
    """During a rollout that sets or rotates the token, servers refuse the router's old one (403):
    the client got that 403; now the decode server computes the prompt itself."""
    sent = []

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        transfer = body.get("kv_transfer_params")
        sent.append((request.url.host[0], transfer is not None))
        if transfer is not None and request.url.host.startswith(refusing[0]):
            error = {"message": "KV transfers are the fleet's own", "type": "permission_error", "code": 403}
            return httpx.Response(403, json={"error": error})
        return _kv_ids(request) if request.url.host.startswith("p") else _answer()

    prefill = [f"http://p{i}:8000" for i in range(1, 5)]  # more than the router's 3 attempts
    proxy, b, _ = await _proxy(handle, prefill, ["http://d1:8000"])
    opened = await proxy._open("/v1/completions", {"prompt": "hi"}, False, 0.0)
    assert json.loads(opened.head[0])["choices"][0]["text"] == "ok"
    assert sent[-1] == ("d", False)  # the decode server prefilled itself
    assert b.servers["decode"]["http://d1:8000"].healthy
    if refusing == "decode":  # asked again at once, without the transfer: one prefill spent, not three
        assert [host for host, _ in sent] == ["p", "d", "d"]


async def test_round_robin_takes_turns_between_requests_through_the_routes():
    """Each request first asked a decode server for the model's names, through the policy: that
    took a round-robin turn, so every generation landed on the same decode server."""
    from fastapi import FastAPI

    from llmfleet.server.http.state import ServerState
    from llmfleet.server.router.proxy import Proxy, ProxySettings
    from llmfleet.server.router.routes import install

    decoded_on = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 64}]})
        if request.url.host.startswith("p"):
            return _kv_ids(request)
        decoded_on.append(request.url.host)
        return _answer()

    client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    b = Balancer(StaticEndpoints(["http://p1:8000"], ["http://d1:8000", "http://d2:8000"]), "round-robin", client)
    await b.refresh()
    metrics = RouterMetrics("m")
    app = FastAPI()
    install(app, ServerState(None, None, "m", 0, metrics, role="router"), Proxy(b, client, metrics, ProxySettings()), b)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as router:
        for _ in range(4):
            reply = await router.post("/v1/completions", json={"model": "m", "prompt": "hi"})
            assert reply.status_code == 200, reply.text
    assert sorted(decoded_on) == ["d1", "d1", "d2", "d2"]


async def test_a_stream_its_client_closes_is_no_finished_request():
    """A client that leaves mid-stream: the decode server aborts, and neither it nor the router
    counts a finished request (vLLM's rule; a stream a server breaks off is one, an abort)."""
    from llmfleet.server.router.proxy import _Relay

    token = sse({"choices": [{"index": 0, "text": "Hello", "finish_reason": None}]})

    class Endless(httpx.AsyncByteStream):
        async def __aiter__(self):
            while True:
                yield token
                await asyncio.sleep(0.01)

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=Endless(), headers={"content-type": "text/event-stream"})

    proxy, _, metrics = await _proxy(handle, [], ["http://d1:8000"])
    opened = await proxy._open("/v1/completions", {"prompt": "hi", "stream": True}, True, 0.0)
    relay = _Relay(opened, metrics, 0.0)
    async for _ in relay:  # the client reads one chunk and leaves
        break
    await relay.aclose()
    labels = {"model_name": "m", "role": "router"}
    assert metrics.registry.get_sample_value("vllm:e2e_request_latency_seconds_count", labels) == 0
    assert metrics.registry.get_sample_value("vllm:request_success_total", labels | {"finished_reason": "abort"}) == 0
