"""Admission control and drain in-process on the real engine loop: a full queue's 429, priority,
in-flight counting, clients that leave, and a drain that finishes what it accepted."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from llmfleet.server.config import EngineConfig
from llmfleet.server.http.drain import drain
from llmfleet.server.openai.app import create_app
from tests.server.openai.helpers import assert_openai_error, post_scope


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

    scope = post_scope(path, [(b"host", b"test")])
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
