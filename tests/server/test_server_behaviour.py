"""Cancellation, admission control, metrics, live config and drain, on real `llm-fleet serve`
processes with builtin:tiny."""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from pathlib import Path

import httpx
import pytest

from llmfleet.server.runner.host_memory import tcmalloc_library
from tests.support import ServerProcess


def engine_yaml(path, **knobs):
    """Write the config atomically, as a ConfigMap update lands."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{k}: {v}\n" for k, v in knobs.items()))
    os.replace(tmp, path)
    return path


async def stream_completion(
    client: httpx.AsyncClient, url: str, max_tokens: int, prompt="hello", started: asyncio.Event | None = None
) -> dict:
    """One streaming completion; ``started`` is set at its first token chunk."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    text, finish, chunks = [], None, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
        if resp.status_code != 200:
            return {"status": resp.status_code, "body": json.loads(await resp.aread()), "headers": resp.headers}
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            chunks += 1
            if started is not None:
                started.set()
            text.append(chunk["choices"][0]["text"])
            finish = chunk["choices"][0]["finish_reason"] or finish
    return {"status": 200, "text": "".join(text), "finish": finish, "chunks": chunks}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("behaviour")
    config = engine_yaml(tmp / "engine.yaml", max_batch_size=2, max_queue_len=4, kv_cache_memory_mb=16)
    proc = ServerProcess("--model", "builtin:tiny", config=config, log_path=tmp / "server.log").wait_ready()
    proc.config_path = config
    yield proc
    proc.stop()


def test_the_server_runs_under_the_systems_tcmalloc(server):
    """Where the system has tcmalloc (CI's machine and the image install Debian's
    libtcmalloc-minimal4), `llm-fleet serve` starts again with it preloaded, in the same process."""
    system = tcmalloc_library({})
    if system is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI installs libtcmalloc-minimal4 (scripts/install-tools.sh)")
        pytest.skip("no tcmalloc on this system")
    process = Path(f"/proc/{server.proc.pid}")
    environ = dict(item.split("=", 1) for item in (process / "environ").read_text().split("\0") if item)
    assert environ["LD_PRELOAD"].split(":")[0] == system
    assert "tcmalloc" in (process / "maps").read_text()


def wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


async def async_wait_for(predicate, timeout=20.0) -> bool:
    return await asyncio.to_thread(wait_for, predicate, timeout)


def gauge(server, name: str) -> float:
    return server.metrics()[f"{name}{{}}"]


async def test_client_disconnect_frees_kv_and_queue_slots(server):
    """Two long streams fill the batch (max_batch_size 2), a third waits in the queue. Each
    client that leaves has its request aborted: the queued one leaves the queue, the running
    ones free their KV blocks, within a step or two. As in vLLM, none of them is counted as a
    finished request (no request_success{abort}, no end-to-end latency)."""
    body = {"prompt": "hello", "max_tokens": 1500, "stream": True, "ignore_eos": True}
    before = server.metrics()
    async with httpx.AsyncClient(timeout=60) as client:

        async def open_stream():
            request = client.build_request("POST", f"{server.url}/v1/completions", json=body)
            return await client.send(request, stream=True)

        running = [await open_stream() for _ in range(2)]
        readers = [resp.aiter_lines() for resp in running]  # keep them: a dropped reader closes its stream
        for lines in readers:
            while not (await lines.__anext__()).startswith("data: {"):
                pass
        assert gauge(server, "vllm:kv_cache_usage_perc") > 0
        queued = await open_stream()
        assert await async_wait_for(lambda: gauge(server, "vllm:num_requests_waiting") == 1)
        await queued.aclose()  # leaves before its first token
        assert await async_wait_for(lambda: gauge(server, "vllm:num_requests_waiting") == 0, 5)
        assert gauge(server, "vllm:num_requests_running") == 2
        for resp in running:
            await resp.aclose()  # mid-stream
        assert await async_wait_for(lambda: gauge(server, "vllm:kv_cache_usage_perc") == 0, 5), "KV not freed"
    metrics = server.metrics()
    assert metrics["vllm:num_requests_running{}"] == 0
    for name in ("vllm:request_success_total{finished_reason=abort}", "vllm:e2e_request_latency_seconds_count{}"):
        assert metrics[name] == before[name], name


async def test_non_streaming_client_that_leaves_is_aborted_too(server):
    body = {"prompt": "hello", "max_tokens": 1500, "ignore_eos": True}
    aborted = server.metrics()["vllm:request_success_total{finished_reason=abort}"]
    async with httpx.AsyncClient() as client:
        call = asyncio.create_task(client.post(f"{server.url}/v1/completions", json=body, timeout=60))
        assert await async_wait_for(lambda: gauge(server, "vllm:kv_cache_usage_perc") > 0)
        call.cancel()  # the client gives up: its connection closes
        with pytest.raises(asyncio.CancelledError):
            await call
    assert await async_wait_for(lambda: gauge(server, "vllm:kv_cache_usage_perc") == 0, 5), "KV not freed"
    assert server.metrics()["vllm:request_success_total{finished_reason=abort}"] == aborted  # vLLM's: not counted


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
    assert all(r["finish"] == "length" and r["chunks"] >= 1 for r in ok)
    assert all(r["body"]["error"]["type"] == "rate_limit_exceeded" for r in limited)
    assert all(r["headers"]["retry-after"] == "1" for r in limited)
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/ready").status_code == 200
    # and it still serves normally
    async with httpx.AsyncClient() as client:
        assert (await stream_completion(client, server.url, 4))["finish"] == "length"


async def test_histograms_observe_what_requests_did(server):
    before = server.metrics()
    n_requests, n_tokens = 3, 10
    async with httpx.AsyncClient() as client:
        results = await asyncio.gather(
            *(stream_completion(client, server.url, n_tokens, prompt="abcd") for _ in range(n_requests))
        )
    assert all(r["status"] == 200 for r in results)
    after = server.metrics()

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)

    prompt_len = httpx.post(f"{server.url}/tokenize", json={"prompt": "abcd"}).json()["count"]
    per_request = [
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_time_per_output_token_seconds",
    ]
    for name in per_request:
        assert delta(f"{name}_count{{}}") == n_requests, name
        assert delta(f"{name}_bucket{{le=+Inf}}") == n_requests, name
    # vLLM observes its older name per token interval too
    per_token = ["vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"]
    for name in per_token:
        assert delta(f"{name}_count{{}}") == n_requests * (n_tokens - 1), name
    assert delta("vllm:generation_tokens_total{}") == n_requests * n_tokens
    assert delta("vllm:prompt_tokens_total{}") == n_requests * prompt_len
    assert delta("vllm:request_success_total{finished_reason=length}") == n_requests
    # the timings add up: queue + prefill = TTFT; the ITLs of a request sum to its decode time,
    # which is (tokens - 1) x its TPOT; TTFT + decode <= e2e
    sums = {name: delta(f"{name}_sum{{}}") for name in [*per_request, *per_token]}
    assert sums["vllm:time_to_first_token_seconds"] > 0
    assert math.isclose(
        sums["vllm:request_queue_time_seconds"] + sums["vllm:request_prefill_time_seconds"],
        sums["vllm:time_to_first_token_seconds"],
        rel_tol=1e-6,
    )
    for name in per_token:
        assert math.isclose(sums[name], sums["vllm:request_decode_time_seconds"], rel_tol=1e-6), name
    assert math.isclose(
        sums["vllm:request_time_per_output_token_seconds"] * (n_tokens - 1),
        sums["vllm:request_decode_time_seconds"],
        rel_tol=1e-6,
    )
    assert (
        sums["vllm:time_to_first_token_seconds"] + sums["vllm:request_decode_time_seconds"]
        <= sums["vllm:e2e_request_latency_seconds"] + 1e-9
    )
    # per step: every request is in one batch per token (short prompts prefill in one step);
    # the tokens computed are the prompts plus every generated token but the last
    assert delta("llmfleet_batch_size_sum{}") == n_requests * n_tokens
    assert delta("vllm:iteration_tokens_total_sum{}") == n_requests * (prompt_len + n_tokens - 1)
    steps = delta("llmfleet_batch_size_count{}")
    assert n_tokens <= steps <= n_requests * n_tokens
    assert delta("vllm:iteration_tokens_total_count{}") == steps
    assert delta("llmfleet_step_duration_seconds_count{}") == steps
    assert delta("llmfleet_scheduler_duration_seconds_count{}") == steps
    assert after["llmfleet_role_info{}"] == 1
    assert after["vllm:num_requests_running{}"] == 0
    assert after["llmfleet_requests_in_flight{}"] == 0


async def test_live_config_change_under_traffic(server):
    generation = gauge(server, "llmfleet_config_generation")
    errors = gauge(server, "llmfleet_config_errors_total")
    async with httpx.AsyncClient() as client:
        traffic = [asyncio.create_task(stream_completion(client, server.url, 40)) for _ in range(4)]
        await asyncio.sleep(0.3)
        # a policy and batch-size change lands without a restart
        engine_yaml(server.config_path, policy="static", max_batch_size=3, max_queue_len=4, kv_cache_memory_mb=16)
        assert await async_wait_for(lambda: gauge(server, "llmfleet_config_generation") == generation + 1)
        knobs = server.metrics()
        assert knobs["llmfleet_config_knob{knob=max_batch_size}"] == 3
        # an invalid file is kept out and counted (swapped in whole too: a truncated file the
        # watcher saw empty twice would apply the defaults, a generation of its own)
        engine_yaml(server.config_path, policy="[not valid")
        assert await async_wait_for(lambda: gauge(server, "llmfleet_config_errors_total") == errors + 1)
        engine_yaml(server.config_path, policy="continuous", max_batch_size=0, max_queue_len=4)
        assert await async_wait_for(lambda: gauge(server, "llmfleet_config_errors_total") == errors + 2)
        assert gauge(server, "llmfleet_config_generation") == generation + 1
        # back to continuous batching
        engine_yaml(server.config_path, policy="continuous", max_batch_size=2, max_queue_len=4, kv_cache_memory_mb=16)
        assert await async_wait_for(lambda: gauge(server, "llmfleet_config_generation") == generation + 2)
        results = await asyncio.wait_for(asyncio.gather(*traffic), timeout=120)
    assert all(r["status"] == 200 and r["finish"] == "length" for r in results), results
    metrics = server.metrics()
    assert metrics["llmfleet_config_knob{knob=max_batch_size}"] == 2
    assert httpx.get(f"{server.url}/ready").status_code == 200


async def test_sigterm_drains_live_streams(tmp_path):
    proc = ServerProcess("--model", "builtin:tiny", "--drain-timeout", "60", log_path=tmp_path / "s.log").wait_ready()
    try:
        async with httpx.AsyncClient() as client:
            started = [asyncio.Event() for _ in range(8)]
            streams = [
                asyncio.create_task(stream_completion(client, proc.url, 150, prompt=f"p{i}", started=started[i]))
                for i in range(8)
            ]
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)  # all 8 mid-stream
            proc.terminate()
            assert await async_wait_for(lambda: httpx.get(f"{proc.url}/ready", timeout=2).status_code == 503, 10)
            late = await client.post(f"{proc.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert late.status_code == 503 and late.json()["error"]["type"] == "unavailable"
            assert not any(s.done() for s in streams), "streams ended before the drain was tested"
            results = await asyncio.wait_for(asyncio.gather(*streams), timeout=120)
        # every stream ran to its max_tokens ("length"), none was cut by the shutdown
        assert [r["finish"] for r in results] == ["length"] * 8
        assert await asyncio.to_thread(proc.proc.wait, 30) == 0
    finally:
        proc.stop()
