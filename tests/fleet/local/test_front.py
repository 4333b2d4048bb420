"""The colocated pool's front (the local stand-in for a Service), over real sockets in-process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llmfleet.local.front import build_front


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def serving(app):
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    server.install_signal_handlers = lambda: None
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


async def test_a_client_that_leaves_before_a_non_streaming_answer_reaches_the_server():
    """A non-streaming answer's headers come only when it is done; a client gone before then must
    close the server's connection (the server aborts the work), as it would through a Service."""
    seen: list[str] = []

    async def complete(request: Request) -> Response:
        for _ in range(300):  # a 3 s generation that stops when the client goes
            if await request.is_disconnected():
                seen.append("disconnected")
                return Response(status_code=499)
            await asyncio.sleep(0.01)
        seen.append("ran to the end")
        return JSONResponse({"choices": []})

    backend = Starlette(routes=[Route("/v1/completions", complete, methods=["POST"])])
    async with serving(backend) as server_url, serving(build_front(lambda: [server_url])) as front_url:
        async with httpx.AsyncClient() as client:
            with contextlib.suppress(httpx.TimeoutException):
                await client.post(f"{front_url}/v1/completions", json={"prompt": "hi"}, timeout=0.3)
        for _ in range(1000):  # either ends it: the disconnect seen, or the 3 s generation run out
            if seen:
                break
            await asyncio.sleep(0.01)
    assert seen == ["disconnected"]


async def test_a_server_that_fails_mid_stream_ends_the_clients_stream_with_an_error_event():
    """As the router does: whole events, then an OpenAI-style error event and [DONE], never a
    stream cut off (the OpenAI client would raise a bare protocol error) nor half an event."""

    async def stream(_: Request) -> Response:
        async def events():
            yield b'data: {"n": 1}\n\n'
            yield b'data: {"n": 2'  # half an event, then the server dies
            await asyncio.sleep(0.05)
            raise RuntimeError("the server died")

        return StreamingResponse(events(), media_type="text/event-stream")

    backend = Starlette(routes=[Route("/v1/completions", stream, methods=["POST"])])
    async with (
        serving(backend) as server_url,
        serving(build_front(lambda: [server_url])) as front_url,
        httpx.AsyncClient() as client,
    ):
        response = await client.post(f"{front_url}/v1/completions", json={"stream": True}, timeout=10)
    events = [e for e in response.text.split("\n\n") if e]
    assert events[0] == 'data: {"n": 1}'
    assert json.loads(events[1].removeprefix("data: "))["error"]["code"] == 502
    assert events[2:] == ["data: [DONE]"]


async def test_a_server_drained_while_its_request_was_on_the_way_passes_it_to_another():
    """The scale-down took the draining server out of the pool between the pick and its 503: the
    front counted the servers left after that, found none to try, and the client got the 503."""

    def answering(status: int):
        async def answer(_: Request) -> Response:
            return JSONResponse({"status": status}, status_code=status)

        return Starlette(routes=[Route("/v1/completions", answer, methods=["POST"])])

    async with serving(answering(503)) as draining, serving(answering(200)) as staying:
        pools = [[draining, staying]]  # as the request found the pool; then the draining one is gone

        def backends() -> list[str]:
            return pools.pop(0) if pools else [staying]

        async with serving(build_front(backends)) as front_url, httpx.AsyncClient() as client:
            response = await client.post(f"{front_url}/v1/completions", json={}, timeout=10)
    assert response.status_code == 200 and response.json() == {"status": 200}


def _sse(delta: dict, finish: str | None = None) -> bytes:
    return f"data: {json.dumps({'choices': [{'index': 0, 'delta': delta, 'finish_reason': finish}]})}\n\n".encode()


async def test_a_request_yet_to_produce_its_first_token_weighs_more_than_one_decoding():
    """The front ranks servers as the router does (load_score): a new prompt queues behind the
    prefills ahead of it, while decoding streams only share the steps with it. A chat's opening
    chunk (its role) is no token."""
    first_token, end = asyncio.Event(), asyncio.Event()
    picked: list[str] = []

    def backend(name: str) -> Starlette:
        async def chat(request: Request) -> Response:
            body = await request.json()
            picked.append(name)

            async def events():
                yield _sse({"role": "assistant", "content": ""})
                if body.get("slow_prefill"):
                    await first_token.wait()
                yield _sse({"content": "x"})
                await end.wait()
                yield _sse({}, "stop") + b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])

    async def until_token(chunks) -> None:
        async for chunk in chunks:
            if b'"x"' in chunk:
                return

    ready: list[str] = []
    front_app = build_front(lambda: ready)
    async with (
        serving(backend("a")) as a,
        serving(backend("b")) as b,
        serving(front_app) as front,
        httpx.AsyncClient(timeout=10) as client,
        contextlib.AsyncExitStack() as streams,
    ):
        open_streams = []  # each stream's reader, kept: a dropped one closes its stream

        async def chat(**extra):
            body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, **extra}
            response = await streams.enter_async_context(
                client.stream("POST", f"{front}/v1/chat/completions", json=body)
            )
            open_streams.append(response.aiter_bytes())
            return open_streams[-1]

        ready[:] = [a]
        waiting = await chat(slow_prefill=True)  # a: one request, no token yet
        ready[:] = [b]
        for _ in range(3):  # b: three decoding
            await until_token(await chat())
        ready[:] = [a, b]
        await until_token(await chat())
        assert picked[-1] == "b"  # held alone, a's one request would have won (1 < 3)
        first_token.set()
        await until_token(waiting)
        await until_token(await chat())
        assert picked[-1] == "a"  # decoding now: 1 held against 4
        end.set()


def test_echo_is_read_as_the_servers_and_the_router_read_it():
    from llmfleet.local.front import _echoes

    assert _echoes(b'{"echo": true}') and _echoes(b'{"echo": "true"}')
    assert not _echoes(b'{"echo": "no"}') and not _echoes(b'{"echo": "maybe"}') and not _echoes(b"[1]")
    assert not _echoes(b"") and not _echoes(b"{}")
