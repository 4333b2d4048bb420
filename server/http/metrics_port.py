"""A second listening port for what scrapers and the operator read (``/metrics``, ``/load``, the
probes, ``/version``), and nothing else: every other path is a 404 there. In a cluster a
NetworkPolicy then opens this port to Prometheus and the operator while the API port takes only
the router's requests (``serve --metrics-port``; the API port serves these paths too)."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send

from llmfleet.server.wire.errors import error_body

READ_ONLY_PATHS = frozenset({"/metrics", "/load", "/health", "/ready", "/ping", "/version"})


class MetricsPortOnly:
    """ASGI middleware: requests that came in on ``port`` reach only ``READ_ONLY_PATHS`` (GET)."""

    def __init__(self, app: ASGIApp, port: int) -> None:
        self.app = app
        self.port = port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        here = scope["type"] == "http" and (scope.get("server") or (None, None))[1] == self.port
        if here and (scope["path"] not in READ_ONLY_PATHS or scope["method"] not in ("GET", "HEAD")):
            body = error_body(f"{scope['path']} is not served on the metrics port", "not_found", 404)
            await _json(send, 404, body)
            return
        await self.app(scope, receive, send)


async def _json(send: Send, status: int, body: dict) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
