"""Keep-alive timing between our own HTTP hops (router to servers, decode to prefill). A client
that reuses a pooled connection in the instant the server closes it for idleness gets a
ReadError before any byte: the request fails, or burns a retry. With both
sides at their libraries' default of 5 s, a retry sent 5 s after the last request (a decode
timeout of 5 s, say) hits that instant. So our servers keep idle connections longer than our
clients pool them."""

from __future__ import annotations

import httpx

SERVER_KEEP_ALIVE_S = 30.0  # uvicorn's timeout_keep_alive on every server of ours (default 5)
CLIENT_KEEPALIVE_EXPIRY_S = 10.0  # httpx's keepalive_expiry on our clients of them (default 5)


def pooled(**limits: int) -> httpx.Limits:
    """Connection limits for a client of our servers: idle connections go before the server drops them."""
    return httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S, **limits)
