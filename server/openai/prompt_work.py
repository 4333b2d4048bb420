"""How many large prompts (and other heavy checks) are worked on at once. Templating and
tokenizing a long text take seconds of a worker thread, and memory in proportion; six concurrent
5 MB prompts once made an unrelated 4-token request wait 19 s. A prompt past ``LARGE_CHARS``
waits for one of the server's few slots (ServerState.large_prompts); a small one never waits."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from llmfleet.server.http.state import ServerState

T = TypeVar("T")

LARGE_CHARS = 64 * 1024


async def off_loop(state: ServerState, chars: int, work: Callable[..., T], *args) -> T:
    """``work(*args)`` in a worker thread; where the prompt is large (``chars`` characters or
    token ids), once one of the server's large-prompt slots is free."""
    if chars <= LARGE_CHARS:
        return await asyncio.to_thread(work, *args)
    async with state.large_prompts:
        return await asyncio.to_thread(work, *args)


async def heavy(state: ServerState, work: Callable[..., T], *args) -> T:
    """``work(*args)`` in a worker thread, once a slot is free: work that may take seconds of CPU
    whatever the request's size (following a pathological grammar)."""
    async with state.large_prompts:
        return await asyncio.to_thread(work, *args)
