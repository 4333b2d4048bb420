"""Noticing a client that went away while its non-streaming answer is being computed: nothing
else would, and its engine requests (or a router's calls to other servers) would run on."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")

# nginx's "client closed request": logged nowhere, read by nobody, but never a 5xx
CLIENT_GONE = 499


async def unless_client_gone(raw: Request, work: Awaitable[T]) -> T | None:
    """Await ``work`` unless the client disconnects first: then cancel it (its cleanup aborts what
    it started) and return None."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        return None
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _disconnected(raw: Request) -> None:
    # the body is already read: the next ASGI message is the disconnect (or the end of the response)
    while (await raw.receive())["type"] != "http.disconnect":
        pass
