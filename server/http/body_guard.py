"""Bounded request bodies: every POST is read once, up to ``--max-request-body-mb`` (413 past it,
with an OpenAI-style error, before any more of it is read), and a JSON body is parsed once here,
deeper nesting than ``MAX_JSON_DEPTH`` refused with a 400 and one log line, before any parser or
validator can recurse into it. The endpoints get the parsed value (``GuardedRoute`` hands it to
FastAPI's own body reading; the router reads ``parsed_body``), so no body is parsed twice.

Bodies past ``LARGE_BODY_BYTES`` are taken one at a time, from their first byte until their
endpoint has its prompt (``done_with_body``) or answers: a small request then waits behind one
large body's work at most, never behind all of them, and only one is in memory at once."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmfleet.server.wire import json_depth
from llmfleet.server.wire.errors import error_body

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_MB = 4.0
# A body past this is worked on one at a time: parsing and validating it hold the event loop (a
# megabyte of token ids takes tens of ms), and each body's copies are megabytes
LARGE_BODY_BYTES = 1 << 20
OFF_LOOP_BYTES = 256 * 2**10  # bodies parsed off the event loop from this size
_PARSED = "llmfleet.parsed_body"  # the scope key the parsed JSON body travels under
_RELEASE = "llmfleet.release_large_body"  # and the large-body slot's release
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class BodyGuardMiddleware:
    """Reads each request's body up to ``max_bytes`` and checks a JSON body's depth."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_depth: int = json_depth.MAX_JSON_DEPTH) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_depth = max_depth
        self._large = asyncio.Semaphore(1)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, send, int(declared))
            return
        if declared.isdigit() and int(declared) <= LARGE_BODY_BYTES:
            body = await self._read(scope, receive, send)
            if body is not None:
                await self.app(scope, _replay(body, receive), send)
            return
        # A large body holds the slot from its first byte read until its endpoint is done with
        # the prompt (done_with_body) or answers: its parsing, validation and tokenizing hold the
        # event loop in turns, and its copies are megabytes. Generation does not hold it.
        await self._large.acquire()
        release = _Once(self._large.release)
        scope[_RELEASE] = release
        try:
            body = await self._read(scope, receive, send)
            if body is not None:
                await self.app(scope, _replay(body, receive), _releasing(send, release))
        finally:
            release()

    async def _read(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The body, its JSON parsed into the scope; None where it was answered here (too
        large, too deep) or the client left."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body was in
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(scope, send, size)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        del chunks
        if body and _is_json(dict(scope["headers"]).get(b"content-type")):
            try:
                if size < OFF_LOOP_BYTES:
                    scope[_PARSED] = json_depth.loads(body, self.max_depth)
                else:  # tens of ms per MiB: in a thread, so small requests get the loop meanwhile
                    scope[_PARSED] = await asyncio.to_thread(json_depth.loads, body, self.max_depth)
            except json_depth.TooDeepError as exc:
                log.warning("%s %s: refused a body nested too deep (%d bytes)", scope["method"], scope["path"], size)
                await _answer(send, 400, error_body(f"invalid request: {exc}", "invalid_request_error", 400))
                return None
            except ValueError:  # not JSON: the endpoint's own parsing says so, as it always has
                pass
        return body

    async def _too_large(self, scope: Scope, send: Send, size: int) -> None:
        limit_mb = self.max_bytes / 2**20
        log.warning(
            "%s %s: refused a body of %d bytes or more (limit %d)", scope["method"], scope["path"], size, self.max_bytes
        )
        message = f"the request body is larger than this server's limit of {limit_mb:g} MiB (--max-request-body-mb)"
        await _answer(send, 413, error_body(message, "invalid_request_error", 413))


class _Once:
    """A call made at most once, by whichever comes first: the endpoint, the answer, the end."""

    def __init__(self, call) -> None:
        self._call = call

    def __call__(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            call()


def _releasing(send: Send, release: _Once) -> Send:
    async def sent(message: Message) -> None:
        release()  # an answer (or its start): nothing of the body is worked on any more
        await send(message)

    return sent


def done_with_body(raw: Request) -> None:
    """The endpoint has what it needs of a large body (its prompt's tokens): the next large body
    may be read."""
    release = raw.scope.get(_RELEASE)
    if release is not None:
        release()


def _is_json(content_type: bytes | None) -> bool:
    """What FastAPI parses as JSON: no content type, or application/json or +json."""
    if not content_type:
        return True
    kind = content_type.split(b";", 1)[0].strip().lower()
    return kind == b"application/json" or (kind.startswith(b"application/") and kind.endswith(b"+json"))


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body as one message, then the client's own messages (a disconnect must still reach
    the endpoints that watch for it)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _answer(send: Send, status: int, body: dict) -> None:
    raw = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": raw})


async def parsed_body(raw: Request) -> Any:
    """The request's JSON body, as the guard parsed it; parsed here where it was not (not JSON:
    ValueError)."""
    if _PARSED in raw.scope:
        return raw.scope[_PARSED]
    return json_depth.loads(await raw.body())


class GuardedRoute(APIRoute):
    """A route whose handler reads the body the guard parsed, rather than parsing it again."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def guarded(request: Request):
            if _PARSED in request.scope:
                request._json = request.scope[_PARSED]  # Starlette's cache of request.json()
            return await handler(request)

        return guarded
