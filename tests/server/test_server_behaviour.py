"""Cancellation, admission control, metrics, live config and drain, on real server processes."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.support import ServerProcess


def engine_yaml(path, **knobs):
    path.write_text("".join(f"{k}: {v}\n" for k, v in knobs.items()))
    return path


async def stream_completion(client: httpx.AsyncClient, url: str, max_tokens: int, prompt="hello") -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    text, finish = [], None
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
        if resp.status_code != 200:
            return {"status": resp.status_code, "body": json.loads(await resp.aread())}
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text.append(chunk["choices"][0]["text"])
            finish = chunk["choices"][0]["finish_reason"] or finish
    return {"status": 200, "text": "".join(text), "finish": finish}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("behaviour")
    config = engine_yaml(tmp / "engine.yaml", max_batch_size=2, max_queue_len=4, kv_cache_memory_mb=16)
    proc = ServerProcess("--model", "builtin:tiny", config=config, log_path=tmp / "server.log").wait_ready()
    proc.config_path = config
    yield proc
    proc.stop()


def wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def kv_usage(server) -> float:
    return server.metrics()["vllm:kv_cache_usage_perc{}"]


async def test_client_disconnect_frees_kv(server):
    async with httpx.AsyncClient() as client:
        body = {"prompt": "hello", "max_tokens": 1500, "stream": True, "ignore_eos": True}
        async with client.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as resp:
            lines = resp.aiter_lines()
            for _ in range(6):
                await lines.__anext__()
            assert kv_usage(server) > 0
        # the connection is closed here, mid-stream
    assert await asyncio.to_thread(wait_for, lambda: kv_usage(server) == 0), "KV blocks not freed"
    assert server.metrics()["vllm:request_success_total{finished_reason=abort}"] >= 1


async def test_ten_times_capacity_gets_answers_or_429(server):
    # capacity: 2 running + 4 waiting; send 60 at once
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=100)) as client:
        results = await asyncio.wait_for(
            asyncio.gather(*(stream_completion(client, server.url, 24) for _ in range(60))), timeout=240
        )
    ok = [r for r in results if r["status"] == 200]
    limited = [r for r in results if r["status"] == 429]
    assert len(ok) + len(limited) == 60
    assert ok and limited
    assert all(r["finish"] == "length" for r in ok)
    assert all(r["body"]["error"]["type"] == "rate_limit_exceeded" for r in limited)
    assert httpx.get(f"{server.url}/health").status_code == 200


async def test_histograms_observe_what_requests_did(server):
    before = server.metrics()
    async with httpx.AsyncClient() as client:
        results = await asyncio.gather(*(stream_completion(client, server.url, 10, prompt="abcd") for _ in range(3)))
    assert all(r["status"] == 200 for r in results)
    after = server.metrics()

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)

    assert delta("vllm:time_to_first_token_seconds_count{}") == 3
    assert delta("vllm:e2e_request_latency_seconds_count{}") == 3
    assert delta("vllm:request_queue_time_seconds_count{}") == 3
    assert delta("vllm:request_time_per_output_token_seconds_count{}") == 3
    assert delta("vllm:time_per_output_token_seconds_count{}") == 3
    assert delta("vllm:inter_token_latency_seconds_count{}") == 3 * 9
    assert delta("vllm:generation_tokens_total{}") == 30
    prompt_len = httpx.post(f"{server.url}/tokenize", json={"prompt": "abcd"}).json()["count"]
    assert delta("vllm:prompt_tokens_total{}") == 3 * prompt_len
    assert delta("vllm:request_success_total{finished_reason=length}") == 3
    assert delta("vllm:time_to_first_token_seconds_sum{}") > 0
    assert after["llmfleet_role_info{}"] == 1
    assert after["vllm:num_requests_running{}"] == 0
    assert after["vllm:num_requests_waiting{}"] == 0


async def test_live_config_change_under_traffic(server):
    generation = server.metrics()["llmfleet_config_generation{}"]
    async with httpx.AsyncClient() as client:
        traffic = [asyncio.create_task(stream_completion(client, server.url, 40)) for _ in range(4)]
        await asyncio.sleep(0.3)
        engine_yaml(server.config_path, policy="static", max_batch_size=3, max_queue_len=4, kv_cache_memory_mb=16)
        assert await asyncio.to_thread(
            wait_for, lambda: server.metrics()["llmfleet_config_generation{}"] == generation + 1
        )
        server.config_path.write_text("policy: [not valid\n")  # kept out, counted
        assert await asyncio.to_thread(wait_for, lambda: server.metrics()["llmfleet_config_errors_total{}"] >= 1)
        engine_yaml(server.config_path, policy="continuous", max_batch_size=2, max_queue_len=4, kv_cache_memory_mb=16)
        assert await asyncio.to_thread(
            wait_for, lambda: server.metrics()["llmfleet_config_generation{}"] == generation + 2
        )
        results = await asyncio.wait_for(asyncio.gather(*traffic), timeout=120)
    assert all(r["status"] == 200 and r["finish"] == "length" for r in results)
    metrics = server.metrics()
    assert metrics["llmfleet_config_knob{knob=max_batch_size}"] == 2


async def test_sigterm_drains_live_streams(tmp_path):
    proc = ServerProcess("--model", "builtin:tiny", "--drain-timeout", "60", log_path=tmp_path / "s.log").wait_ready()
    try:
        async with httpx.AsyncClient() as client:
            streams = [asyncio.create_task(stream_completion(client, proc.url, 120)) for _ in range(8)]
            await asyncio.to_thread(wait_for, lambda: proc.metrics()["vllm:num_requests_running{}"] == 8)
            proc.terminate()
            await asyncio.to_thread(wait_for, lambda: httpx.get(f"{proc.url}/ready", timeout=2).status_code == 503, 10)
            late = await client.post(f"{proc.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert late.status_code == 503
            results = await asyncio.wait_for(asyncio.gather(*streams), timeout=120)
        assert [r["finish"] for r in results] == ["length"] * 8
        assert proc.proc.wait(30) == 0
    finally:
        proc.stop()
