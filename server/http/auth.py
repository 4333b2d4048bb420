"""The ``--api-key`` check as ASGI middleware: a ``/v1`` request without a key gets 401 before
it reaches a route (the rules are in :mod:`llmfleet.server.wire.auth`)."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send


def api_keys(keys: Iterable[str | None]) -> tuple[str, ...]:
    """The keys given, empty ones left out (as vLLM leaves them); none: no check."""
    return tuple(key for key in keys if key)


class APIKeyMiddleware:
    """Answers 401 to a ``/v1`` request without one of the keys, before it reaches a route.

    As vLLM's: the scheme is ``Bearer`` in any case, and the token is compared with every key in
    constant time (their SHA-256 digests, so that neither a key's length nor which key matched
    shows in the time taken)."""

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...]) -> None:
        self.app = app
        self.digests = [hashlib.sha256(key.encode()).digest() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _route_path(scope).startswith("/v1") and not self._authorized(scope):
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
        scheme, _, token = given.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        digest = hashlib.sha256(token).digest()
        matched = False
        for expected in self.digests:  # every one, whichever matches
            matched |= hmac.compare_digest(digest, expected)
        return matched


def _route_path(scope: Scope) -> str:
    """The path the routes see: without ``--root-path``'s prefix where the proxy kept it (as
    Starlette routes it), so that ``/prefix/v1/...`` needs the key as ``/v1/...`` does."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root) :]
    return path
