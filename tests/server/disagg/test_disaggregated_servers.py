"""Router -> prefill -> decode as real server processes on loopback.

In float32, greedy output through the router equals a colocated server's, for mixed prompt
lengths and concurrent requests, streaming or not. Each fault of the issue is made real: a
prefill server stopped (times out), a decode server stopped before its first byte, servers of
both pools that die as a request reaches them, a prefill pool whose only server is gone
(connections refused), a decode server killed mid-stream, a prefill server of another model.
No request hangs, and no prefill server keeps KV nobody fetches.

The servers that die mid-request are stubs that answer the router's poll and drop requests:
with real killed processes, whether a request reaches one before the router's next poll sets it
aside is a race."""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.server
import json
import signal
import socket
import struct
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from llmfleet.server.openai.protocol import KVTransferParams
from llmfleet.server.wire.auth import KV_TOKEN_ENV, KV_TOKEN_HEADER
from tests.support import ServerProcess, free_port

ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # six servers share two cores
TOKEN = {KV_TOKEN_HEADER: "test-fleet-token"}  # what the fleet's own hops carry
FLEET_ENV = ONE_THREAD | {KV_TOKEN_ENV: TOKEN[KV_TOKEN_HEADER]}
MODEL = "tiny"
PROMPTS = [
    "a",
    "Disaggregation splits the prompt from the decode",
    "The quick brown fox jumps over the lazy dog. " * 12,
    "KV blocks move from prefill to decode over HTTP",
    "x y z " * 40,
    "One more: mixed lengths and concurrent requests",
]


def engine_config(tmp: Path) -> Path:
    path = tmp / "engine.yaml"
    path.write_text("dtype: float32\nkv_block_size: 8\nkv_cache_memory_mb: 16\n")
    return path


def prefill_pool(tmp: Path) -> Path:
    """The decode servers' prefill pool: every prefill server the tests start (a decode server
    fetches KV from no other)."""
    return tmp / "prefill-pool.yaml"


def server(tmp: Path, name: str, role: str, model: str = "builtin:tiny") -> ServerProcess:
    pool = ["--endpoints-file", str(prefill_pool(tmp))] if role == "decode" else []
    started = ServerProcess(
        "--role",
        role,
        "--model",
        model,
        "--served-model-name",
        MODEL,
        *pool,
        config=engine_config(tmp),
        log_path=tmp / f"{name}.log",
        env=FLEET_ENV,
    )
    if role == "prefill":
        known = prefill_pool(tmp).read_text() if prefill_pool(tmp).exists() else "prefill:\n"
        prefill_pool(tmp).write_text(known + f"- {started.url}\n")
    return started


def router(tmp: Path, prefill: list, decode: list, *extra: str) -> ServerProcess:
    args = ["--role", "router", "--served-model-name", MODEL, "--prefill-timeout", "3", "--decode-timeout", "5"]
    for p in prefill:
        args += ["--prefill-url", p.url]
    for d in decode:
        args += ["--decode-url", d.url]
    log = tmp / f"router-{len(list(tmp.glob('router*')))}.log"
    return ServerProcess(*args, *extra, log_path=log, env=FLEET_ENV).wait_ready(30)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disagg")
    servers = {
        "colocated": server(tmp, "colocated", "colocated"),
        "p1": server(tmp, "p1", "prefill"),
        "p2": server(tmp, "p2", "prefill"),
        "d1": server(tmp, "d1", "decode"),
        "d2": server(tmp, "d2", "decode"),
    }
    try:
        for s in servers.values():
            s.wait_ready(180)
        yield tmp, servers
    finally:
        for s in servers.values():
            s.terminate(signal.SIGCONT)
            s.stop()


def complete(url: str, prompt: str, max_tokens: int = 12, stream: bool = False, extra: dict | None = None) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    ask = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=extra)
    if stream:
        chunks = client.completions.create(**ask, stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)
    return client.completions.create(**ask).choices[0].text


def chat(url: str, content: str | list[dict], stream: bool, extra: dict | None = None) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": content}] if isinstance(content, str) else content
    ask = dict(model=MODEL, messages=messages, max_tokens=10, temperature=0, extra_body=extra)
    if stream:
        chunks = client.chat.completions.create(**ask, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return client.chat.completions.create(**ask).choices[0].message.content


def respond(url: str, text: str, stream: bool) -> tuple[str, str, int]:
    """A Response's text, status and output tokens, streamed or not."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    ask = dict(model=MODEL, input=text, max_output_tokens=10, temperature=0)
    if stream:
        events = list(client.responses.create(**ask, stream=True))
        joined = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert joined == events[-1].response.output_text
        answer = events[-1].response
    else:
        answer = client.responses.create(**ask)
    return answer.output_text, answer.status, answer.usage.output_tokens


def expected(fleet_servers, prompts=PROMPTS) -> dict[str, str]:
    return {p: complete(fleet_servers["colocated"].url, p) for p in prompts}


def all_through(url: str, prompts: list[str], stream: bool = False) -> dict[str, str]:
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = {p: pool.submit(complete, url, p, 12, stream) for p in prompts}
        return {p: f.result() for p, f in futures.items()}


@contextlib.contextmanager
def stopped(server: ServerProcess):
    """SIGSTOP for the block: the server is alive and accepts connections, but answers nothing."""
    server.terminate(signal.SIGSTOP)
    try:
        yield
    finally:
        server.terminate(signal.SIGCONT)


class _Dying(http.server.BaseHTTPRequestHandler):
    """Answers the router's /load poll as a healthy idle server; drops every request's
    connection without a byte, as a process that crashed the moment it read it."""

    def do_GET(self):
        body = json.dumps({"waiting": 0, "running": 0, "kv_usage": 0.0}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.server.dropped += 1
        self.close_connection = True
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST

    def log_message(self, *args):
        pass


class DyingServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Dying)
        self.url = f"http://127.0.0.1:{self.server_port}"
        self.dropped = 0


@contextlib.contextmanager
def dying_server():
    httpd = DyingServer()
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()


def held_kv(*prefill: ServerProcess) -> float:
    return sum(p.metrics()["llmfleet_kv_export_held_bytes{}"] for p in prefill)


def test_greedy_through_the_router_is_the_colocated_output(fleet):
    tmp, s = fleet
    want = expected(s)
    # No timeout may trip here: a retry or a local prefill would break the counts asserted below,
    # and a loaded CI host can stall a one-thread server for seconds (later flags win).
    patient = ("--prefill-timeout", "60", "--decode-timeout", "60")
    with router(tmp, [s["p1"], s["p2"]], [s["d1"], s["d2"]], *patient) as r:
        assert all_through(r.url, PROMPTS) == want  # concurrent, mixed lengths (one too short to transfer)
        assert all_through(r.url, PROMPTS, stream=True) == want
        for stream in (False, True):
            assert chat(r.url, "hello there", stream) == chat(s["colocated"].url, "hello there", stream)
        for stream in (False, True):  # the Responses API: relayed as a chat completion
            assert respond(r.url, "hello there", stream) == respond(s["colocated"].url, "hello there", stream)
        opened = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
        going_on = {"add_generation_prompt": False, "continue_final_message": True, "echo": True}
        assert chat(r.url, opened, True, going_on) == chat(s["colocated"].url, opened, True, going_on)
        scored = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1}
        answers = [
            httpx.post(f"{url}/v1/completions", json=scored, timeout=60).json()["choices"][0]
            for url in (r.url, s["colocated"].url)
        ]
        assert answers[0]["text"] == answers[1]["text"]  # the decode server computes a scored prompt itself
        assert answers[0]["logprobs"]["token_logprobs"][1:] == pytest.approx(
            answers[1]["logprobs"]["token_logprobs"][1:], abs=1e-4
        )
        for path, body in (("/tokenize", {"messages": opened}), ("/detokenize", {"tokens": [40, 41, 42]})):
            answers = [httpx.post(f"{url}{path}", json=body).json() for url in (r.url, s["d1"].url)]
            assert answers[0] == answers[1], answers
        processed = {"repetition_penalty": 1.4, "presence_penalty": 0.5, "logit_bias": {"40": 3.0}, "min_tokens": 4}
        assert complete(r.url, PROMPTS[2], extra=processed) == complete(s["colocated"].url, PROMPTS[2], extra=processed)
        constrained = {"guided_regex": "[a-f]{2,6}-[0-9]{2}"}  # the decode server samples under the grammar
        colocated = complete(s["colocated"].url, PROMPTS[2], extra=constrained)
        assert complete(r.url, PROMPTS[2], extra=constrained) == colocated
        client = openai.OpenAI(base_url=f"{r.url}/v1", api_key="unused")
        card = client.models.list().data[0]
        assert card.id == MODEL and card.max_model_len == 2048
        metrics = r.metrics()
        assert metrics["vllm:time_to_first_token_seconds_count{}"] >= len(PROMPTS) + 1  # streams, as clients see them
        assert metrics["vllm:inter_token_latency_seconds_count{}"] > 0
        assert metrics["llmfleet_router_local_prefills_total{}"] == 0
    # a burst spreads over the decode servers: each counts from the pick, before its prefill returns
    per_server = [s[d].metrics().get("llmfleet_kv_transfer_bytes_count{}", 0) for d in ("d1", "d2")]
    assert all(per_server), per_server
    received = sum(per_server)
    assert received >= 2 * (len(PROMPTS) - 1) + 2  # every prompt of two tokens or more, and the chats
    assert held_kv(s["p1"], s["p2"]) == 0  # everything computed was fetched


def grown(before: list[dict], after: list[dict], name: str) -> list[float]:
    """Per server, how much a metric grew."""
    return [a.get(name, 0) - b.get(name, 0) for b, a in zip(before, after, strict=True)]


def test_a_conversation_stays_on_its_servers_and_moves_only_new_kv(fleet):
    """A conversation going on, routed by prefix affinity: each turn goes to the prefill and
    decode servers that took the one before, the earlier turns are in the decode server's prefix
    cache, so the next turn's transfer leaves their blocks out, and the answer is unchanged."""
    tmp, s = fleet
    opening = "A conversation that goes on, turn after turn. " * 8  # no other test sends it
    turns = [opening, opening + "And then the dog woke up", opening + "And then the dog woke up and ran"]
    want = expected(s, turns)
    patient = ("--prefill-timeout", "60", "--decode-timeout", "60", "--router-policy", "prefix")
    decoders, prefillers = (s["d1"], s["d2"]), (s["p1"], s["p2"])
    with router(tmp, list(prefillers), list(decoders), *patient) as r:
        cached, sent, fetched, prefill_hits = [], [], [], []
        for turn in turns:
            before = [server.metrics() for server in (*decoders, *prefillers)]
            assert complete(r.url, turn) == want[turn]
            after = [server.metrics() for server in (*decoders, *prefillers)]
            prefill_hits.append(grown(before[2:], after[2:], "vllm:prefix_cache_hits_total{}"))
            before, after = before[:2], after[:2]
            fetched.append(grown(before, after, "llmfleet_kv_transfer_bytes_count{}"))
            cached.append(sum(grown(before, after, "llmfleet_kv_transfer_cached_tokens_total{}")))
            sent.append(sum(grown(before, after, "llmfleet_kv_transfer_bytes_sum{}")))
        assert r.metrics()["llmfleet_router_local_prefills_total{}"] == 0
    assert fetched[0] in ([1, 0], [0, 1]) and fetched[1] == fetched[2] == fetched[0]  # one decode server
    assert prefill_hits[0] == [0, 0] and all(sum(h) > 0 and 0 in h for h in prefill_hits[1:])  # one prefill server
    shared = httpx.post(f"{s['d1'].url}/tokenize", json={"model": MODEL, "prompt": opening}).json()["count"]
    assert cached[0] == 0 and cached[1] >= shared // 8 * 8 - 8 and cached[2] > cached[1]  # whole 8-token blocks
    assert sent[1] < sent[0] / 4 and sent[2] < sent[0] / 4, sent
    assert held_kv(s["p1"], s["p2"]) == 0


def test_a_router_with_its_own_model_name_relays_under_the_servers_name(fleet):
    """vLLM's --served-model-name on the router alone (or none, and --model left at its default):
    clients name the router's model, the servers are asked for theirs."""
    tmp, s = fleet
    for names in (("--served-model-name", "team-model", "alias"), ()):
        args = ["--role", "router", *names, "--prefill-url", s["p1"].url, "--decode-url", s["d1"].url]
        with ServerProcess(*args, log_path=tmp / f"router-names-{len(names)}.log", env=FLEET_ENV) as r:
            r.wait_ready(30)
            name = names[1] if names else "builtin:tiny"
            client = openai.OpenAI(base_url=f"{r.url}/v1", api_key="unused", max_retries=0, timeout=60)
            ask = dict(model=name, prompt=PROMPTS[1], max_tokens=12, temperature=0)
            assert client.completions.create(**ask).choices[0].text == complete(s["colocated"].url, PROMPTS[1])
            tokens = httpx.post(f"{r.url}/tokenize", json={"model": name, "prompt": "hi"}, timeout=10)
            assert tokens.status_code == 200 and tokens.json()["tokens"]
            assert [m.id for m in client.models.list().data] == (list(names[1:]) if names else [name])
            card = client.models.retrieve(name)  # with the servers' context length
            assert card.id == name and card.max_model_len == client.models.list().data[0].max_model_len > 0


def test_an_x_request_id_names_the_answer_through_the_router(fleet):
    tmp, s = fleet
    ask = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2}
    with router(tmp, [s["p1"]], [s["d1"]]) as r:
        answer = httpx.post(f"{r.url}/v1/completions", json=ask, headers={"X-Request-Id": "trace-7"}, timeout=60)
        listed = httpx.post(f"{r.url}/v1/completions", json={**ask, "model": [MODEL]}, timeout=60)
    assert answer.status_code == 200 and answer.json()["id"] == "cmpl-trace-7", answer.text
    # a model that is no string is the server's 400, as a colocated server answers, not a 404
    assert listed.status_code == 400 and "model" in listed.json()["error"]["message"], listed.text


def test_a_prefill_server_that_times_out_is_retried_on_another(fleet):
    tmp, s = fleet
    want = expected(s)
    with router(tmp, [s["p1"], s["p2"]], [s["d1"]], "--router-policy", "round-robin") as r, stopped(s["p1"]):
        started = time.monotonic()
        assert all_through(r.url, PROMPTS[1:5]) == {p: want[p] for p in PROMPTS[1:5]}
        assert time.monotonic() - started < 30
        assert r.metrics()["llmfleet_router_retries_total{pool=prefill}"] >= 1


def test_a_decode_server_silent_before_its_first_byte_is_retried(fleet):
    tmp, s = fleet
    want = expected(s)
    with router(tmp, [s["p2"]], [s["d1"], s["d2"]], "--router-policy", "round-robin") as r, stopped(s["d1"]):
        assert all_through(r.url, PROMPTS[1:5], stream=True) == {p: want[p] for p in PROMPTS[1:5]}
        assert r.metrics()["llmfleet_router_retries_total{pool=decode}"] >= 1


def test_servers_that_die_before_the_first_byte_are_retried(fleet):
    """Servers that die between the router's last poll and the request: the poll found them
    well, so the router sends them requests, and each connection drops without a byte."""
    tmp, s = fleet
    want = expected(s)
    with dying_server() as p_victim, dying_server() as d_victim:
        with router(tmp, [p_victim, s["p2"]], [d_victim, s["d2"]], "--router-policy", "round-robin") as r:
            assert all_through(r.url, PROMPTS[1:5]) == {p: want[p] for p in PROMPTS[1:5]}
            metrics = r.metrics()
        assert metrics["llmfleet_router_retries_total{pool=prefill}"] >= 1
        assert metrics["llmfleet_router_retries_total{pool=decode}"] >= 1
        assert p_victim.dropped and d_victim.dropped


def test_a_dead_prefill_pool_is_tried_then_the_decode_server_prefills(fleet):
    """A killed server refuses connections: once a request or a poll has set it aside, the decode
    server computes each prompt itself, the same tokens, and no request fails."""
    tmp, s = fleet
    want = expected(s)
    dead = SimpleNamespace(url=f"http://127.0.0.1:{free_port()}")  # nothing listens there
    with router(tmp, [dead], [s["d2"]]) as r:
        assert all_through(r.url, PROMPTS[1:3]) == {p: want[p] for p in PROMPTS[1:3]}
        metrics = r.metrics()
    assert metrics["llmfleet_router_local_prefills_total{}"] == 2


def test_a_decode_server_killed_mid_stream_ends_the_stream_with_an_error(fleet):
    tmp, s = fleet
    victim = server(tmp, "d-mid-stream", "decode").wait_ready(180)
    with router(tmp, [s["p2"]], [victim]) as r:
        body = {"model": MODEL, "prompt": "long answer", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        lines = []
        started = time.monotonic()
        with httpx.stream("POST", f"{r.url}/v1/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                lines.append(line)
                if len(lines) == 10:
                    victim.stop()
        assert time.monotonic() - started < 30  # never a hang
        data = [line for line in lines if line.startswith("data: ")]
        assert data[-1] == "data: [DONE]"
        assert '"error"' in data[-2] and "mid-stream" in data[-2]
        assert r.metrics()["llmfleet_router_broken_streams_total{}"] == 1

        # the only decode server is gone: a clear error at once, not a hang
        reply = httpx.post(f"{r.url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=30)
        assert reply.status_code in (502, 503) and reply.json()["error"]["message"]


def test_kv_from_another_model_is_refused_with_a_clear_error(fleet):
    tmp, s = fleet
    other = server(tmp, "p-other-model", "prefill", model="builtin:tiny-qwen2").wait_ready(180)
    try:
        with router(tmp, [other], [s["d1"]]) as r:
            reply = httpx.post(f"{r.url}/v1/completions", json={"model": MODEL, "prompt": "hello there"}, timeout=30)
        assert reply.status_code == 502
        message = reply.json()["error"]["message"]
        assert "cannot use the prefill server's KV" in message and "differs from this server" in message
        assert s["d1"].metrics()["llmfleet_kv_transfer_failures_total{reason=mismatch}"] >= 1
    finally:
        other.stop()


def test_roles_refuse_transfers_that_are_not_theirs_and_kv_is_taken_once(fleet):
    _, s = fleet
    ask = {"model": MODEL, "prompt": "hello there", "kv_transfer_params": {"do_remote_decode": True}}
    refused = httpx.post(f"{s['d1'].url}/v1/completions", json=ask, headers=TOKEN, timeout=30)
    assert refused.status_code == 400 and "needs a prefill server" in refused.json()["error"]["message"]

    # a prefill the timeout test gave up on may still wait for its TTL, or expire meanwhile
    before = held_kv(s["p1"])
    held = httpx.post(f"{s['p1'].url}/v1/completions", json=ask, headers=TOKEN, timeout=30).json()
    (kv_id,) = held["kv_transfer_params"]["remote_kv_ids"]
    assert held_kv(s["p1"]) > 0
    past = httpx.get(f"{s['p1'].url}/v1/kv/{kv_id}?first_block=9", headers=TOKEN, timeout=30)  # one partial block
    assert past.status_code == 400 and past.json()["error"]["param"] == "first_block"
    fetched = httpx.get(f"{s['p1'].url}/v1/kv/{kv_id}", headers=TOKEN, timeout=30)  # a refused fetch took nothing
    assert fetched.status_code == 200 and fetched.content.startswith(b"LLMFKV")
    assert httpx.get(f"{s['p1'].url}/v1/kv/{kv_id}", headers=TOKEN, timeout=30).status_code == 404  # taken once
    assert held_kv(s["p1"]) <= before

    gone = {
        **ask,
        "kv_transfer_params": {"do_remote_prefill": True, "remote_url": s["p1"].url, "remote_kv_ids": [kv_id]},
    }
    reply = httpx.post(f"{s['d1'].url}/v1/completions", json=gone, headers=TOKEN, timeout=30)
    assert reply.status_code == 502 and "could not hand over" in reply.json()["error"]["message"]


def test_the_router_follows_the_pools_endpoint_slices(fleet):
    """In a cluster the router reads the pools' EndpointSlices (here from the emulated API server,
    as `--kube-api` without credentials): pods join and leave as their readiness changes."""
    from tests.operator.emulator import make_cluster, serve

    tmp, s = fleet
    running = serve(make_cluster())
    slices = f"{running.url}/apis/discovery.k8s.io/v1/namespaces/ml/endpointslices"

    def endpoint_slice(service: str, server: ServerProcess, ready: bool) -> dict:
        return {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": f"{service}-x1", "namespace": "ml", "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": server.port, "protocol": "TCP"}],
            "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": ready}}],
        }

    try:
        httpx.post(slices, json=endpoint_slice("rag-prefill", s["p1"], True)).raise_for_status()
        httpx.post(slices, json=endpoint_slice("rag-decode", s["d1"], True)).raise_for_status()
        args = [
            "--role",
            "router",
            "--served-model-name",
            MODEL,
            "--prefill-service",
            "rag-prefill",
            "--decode-service",
            "rag-decode",
            "--kube-api",
            running.url,
        ]
        with ServerProcess(*args, log_path=tmp / "router-slices.log", env=FLEET_ENV | {"POD_NAMESPACE": "ml"}) as r:
            prompt = PROMPTS[1]
            assert complete(r.url, prompt) == complete(s["colocated"].url, prompt)
            servers = httpx.get(f"{r.url}/load", timeout=5).json()["servers"]
            assert [x["url"] for x in servers["prefill"]] == [s["p1"].url]
            assert [x["url"] for x in servers["decode"]] == [s["d1"].url]

            gone = endpoint_slice("rag-decode", s["d1"], False)  # the decode pod turns unready
            name = gone["metadata"]["name"]
            httpx.put(f"{slices}/{name}", json=gone).raise_for_status()
            deadline = time.monotonic() + 15
            while httpx.get(f"{r.url}/ready", timeout=5).status_code == 200:
                assert time.monotonic() < deadline, "the router still routes to an unready decode pod"
                time.sleep(0.3)
            assert "no decode server" in httpx.get(f"{r.url}/ready", timeout=5).json()["error"]["message"]
    finally:
        running.stop()


def test_an_api_key_guards_v1_and_rides_every_hop(tmp_path):
    """vLLM's --api-key, here from VLLM_API_KEY for every role: clients need it on /v1 paths, and
    the router's requests and the decode server's KV fetch carry it; probes and scrapes do not."""
    keyed = FLEET_ENV | {"VLLM_API_KEY": "sesame"}
    common = ("--served-model-name", MODEL, "--config", str(engine_config(tmp_path)))
    prefill = ServerProcess("--role", "prefill", *common, log_path=tmp_path / "p.log", env=keyed)
    pool = ("--prefill-url", prefill.url)
    decode = ServerProcess("--role", "decode", *common, *pool, log_path=tmp_path / "d.log", env=keyed)
    with prefill, decode:
        urls = ("--prefill-url", prefill.url, "--decode-url", decode.url)
        routing = ServerProcess(
            "--role", "router", "--served-model-name", MODEL, *urls, log_path=tmp_path / "r.log", env=keyed
        )
        with routing as r:
            body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 4, "temperature": 0}
            for url in (r.url, decode.url, prefill.url):
                refused = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
                assert refused.status_code == 401, refused.text
                assert refused.json()["error"]["type"] == "authentication_error"
                wrong = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer x"})
                assert wrong.status_code == 401
                for path in ("/health", "/ready", "/metrics", "/load", "/version"):
                    assert httpx.get(f"{url}{path}").status_code == 200, path
            client = openai.OpenAI(base_url=f"{r.url}/v1", api_key="sesame", max_retries=0)
            assert client.completions.create(**body).usage.completion_tokens == 4
            assert decode.metrics()["llmfleet_kv_transfer_bytes_count{}"] == 1  # fetched with the key
            assert r.metrics().get("llmfleet_router_local_prefills_total{}", 0) == 0


def test_the_transfer_paths_take_only_the_fleets_token(tmp_path):
    """A client holding the API key could send a decode server KV of its own making (it entered
    the prefix cache other requests read) or have it fetch from any URL and path."""
    fleet_env = ONE_THREAD | {KV_TOKEN_ENV: "fleet-secret"}
    common = ("--served-model-name", MODEL, "--config", str(engine_config(tmp_path)))
    prefill = ServerProcess("--role", "prefill", *common, log_path=tmp_path / "p.log", env=fleet_env)
    pool = ("--prefill-url", prefill.url)
    decode = ServerProcess("--role", "decode", *common, *pool, log_path=tmp_path / "d.log", env=fleet_env)
    with prefill, decode:
        urls = ("--prefill-url", prefill.url, "--decode-url", decode.url)
        args = ("--role", "router", "--served-model-name", MODEL, *urls)
        with ServerProcess(*args, log_path=tmp_path / "r.log", env=fleet_env) as r:
            body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 4, "temperature": 0}
            assert httpx.post(f"{r.url}/v1/completions", json=body, timeout=60).status_code == 200
            assert decode.metrics()["llmfleet_kv_transfer_bytes_count{}"] == 1  # our hops carry the token

        held = {**body, "kv_transfer_params": {"do_remote_decode": True}}
        assert httpx.post(f"{prefill.url}/v1/completions", json=held, timeout=30).status_code == 403
        token = {KV_TOKEN_HEADER: "fleet-secret"}
        (kv_id,) = httpx.post(f"{prefill.url}/v1/completions", json=held, headers=token, timeout=30).json()[
            "kv_transfer_params"
        ]["remote_kv_ids"]
        assert httpx.get(f"{prefill.url}/v1/kv/{kv_id}", timeout=30).status_code == 403
        forged = {
            **body,
            "kv_transfer_params": {"do_remote_prefill": True, "remote_url": prefill.url, "remote_kv_ids": [kv_id]},
        }
        refused = httpx.post(f"{decode.url}/v1/completions", json=forged, timeout=30)
        assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error"
        assert httpx.post(f"{decode.url}/v1/completions", json=forged, headers=token, timeout=30).status_code == 200

    for params in ({"remote_url": "http://127.0.0.1:1/metrics#"}, {"remote_kv_ids": ["../../admin?x="]}):
        steered = {"do_remote_prefill": True, "remote_url": "http://127.0.0.1:1", "remote_kv_ids": [kv_id]} | params
        with pytest.raises(ValueError):
            KVTransferParams.model_validate(steered)
