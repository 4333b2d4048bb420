"""The body guard at the ASGI level: a large body's turn starts when its last byte is in, so a
client whose upload stalls delays nobody else, one that stops sending gets a 408, and each turn
rests after it as long as it was held, so the engine and small requests get half the time."""

from __future__ import annotations

import asyncio
import json

from llmfleet.server.http import body_guard
from llmfleet.server.http.body_guard import LARGE_BODY_BYTES, BodyGuardMiddleware

LARGE = json.dumps({"prompt": "x" * (LARGE_BODY_BYTES + 10)}).encode()


async def _answered(scope: dict, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _scope() -> dict:
    return {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}  # chunked: no length


class _Client:
    """A client's side of one request: the body in ``parts``, then (if ``stall``) nothing more."""

    def __init__(self, parts: list[bytes], stall: bool = False) -> None:
        self.parts, self.stall = list(parts), stall
        self.sent: list[dict] = []

    async def receive(self) -> dict:
        if not self.parts:
            await asyncio.Event().wait()  # a client that stopped sending, or waits for its answer
        part = self.parts.pop(0)
        return {"type": "http.request", "body": part, "more_body": bool(self.parts) or self.stall}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int | None:
        return next((m["status"] for m in self.sent if m["type"] == "http.response.start"), None)


async def test_a_stalled_large_upload_does_not_hold_up_another_large_body():
    guard = BodyGuardMiddleware(_answered, max_bytes=4 << 20)
    stalled = _Client([LARGE[:1000]], stall=True)
    stalled_task = asyncio.create_task(guard(_scope(), stalled.receive, stalled.send))
    await asyncio.sleep(0.05)
    whole = _Client([LARGE[: len(LARGE) // 2], LARGE[len(LARGE) // 2 :]])
    await asyncio.wait_for(guard(_scope(), whole.receive, whole.send), 5)
    assert whole.status == 200 and stalled.status is None
    stalled_task.cancel()
    await asyncio.gather(stalled_task, return_exceptions=True)


async def test_a_body_that_stops_arriving_is_answered_408(monkeypatch):
    monkeypatch.setattr(body_guard, "BODY_IDLE_S", 0.1)
    guard = BodyGuardMiddleware(_answered, max_bytes=4 << 20)
    stalled = _Client([b'{"prompt": "x'], stall=True)
    await asyncio.wait_for(guard(_scope(), stalled.receive, stalled.send), 5)
    body = json.loads(next(m["body"] for m in stalled.sent if m["type"] == "http.response.body"))
    assert stalled.status == 408 and "stopped arriving" in body["error"]["message"]


async def test_large_bodies_are_still_worked_on_one_at_a_time():
    working, most = 0, 0

    async def slow(scope: dict, receive, send) -> None:
        nonlocal working, most
        working += 1
        most = max(most, working)
        await asyncio.sleep(0.05)
        working -= 1
        await _answered(scope, receive, send)

    guard = BodyGuardMiddleware(slow, max_bytes=4 << 20)
    clients = [_Client([LARGE]) for _ in range(3)]
    await asyncio.gather(*(guard(_scope(), c.receive, c.send) for c in clients))
    assert [c.status for c in clients] == [200] * 3 and most == 1


async def test_a_large_bodys_turn_rests_as_long_as_it_was_held_and_small_bodies_pass():
    loop = asyncio.get_running_loop()
    started: dict[str, float] = {}

    async def working(scope: dict, receive, send) -> None:
        started[scope["path"]] = loop.time()
        if scope["path"].startswith("/large"):
            await asyncio.sleep(0.2)  # standing for the large body's parse, validation, tokenizing
        await _answered(scope, receive, send)

    guard = BodyGuardMiddleware(working, max_bytes=4 << 20)
    small = _Client([b'{"prompt": "hi"}'])
    large = [_Client([LARGE]) for _ in range(2)]
    first = asyncio.create_task(guard(_scope() | {"path": "/large-1"}, large[0].receive, large[0].send))
    await asyncio.sleep(0.01)
    second = asyncio.create_task(guard(_scope() | {"path": "/large-2"}, large[1].receive, large[1].send))
    await asyncio.sleep(0.25)  # the first body is answered: its turn rests now
    await asyncio.wait_for(guard(_scope() | {"path": "/small"}, small.receive, small.send), 1)
    await asyncio.gather(first, second)
    assert [c.status for c in (*large, small)] == [200] * 3
    assert started["/large-2"] - started["/large-1"] >= 0.4  # 0.2 s held, then as long again
    assert started["/small"] < started["/large-2"]  # the rest holds no small request
