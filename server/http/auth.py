"""The ``--api-key`` check as ASGI middleware: a ``/v1`` request without the key gets 401 before
it reaches a route (the rules are in :mod:`llmfleet.server.wire.auth`)."""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send


class APIKeyMiddleware:
    """Answers 401 to a ``/v1`` request without the key, before it reaches a route."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and not self._authorized(scope):
            body = json.dumps(
                {
                    "error": {
                        "message": "invalid or missing API key (Authorization: Bearer <key>)",
                        "type": "authentication_error",
                        "param": None,
                        "code": 401,
                    }
                }
            )
            headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": body.encode()})
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        given = dict(scope["headers"]).get(b"authorization", b"")
        return hmac.compare_digest(given, self.expected)
