"""Bounded request bodies: every POST is read once, up to ``--max-request-body-mb`` (413 past it,
with an OpenAI-style error, before any more of it is read), and a JSON body is parsed once here,
deeper nesting than ``MAX_JSON_DEPTH`` refused with a 400 and one log line, before any parser or
validator can recurse into it. The endpoints get the parsed value (``GuardedRoute`` hands it to
FastAPI's own body reading; the router reads ``parsed_body``), so no body is parsed twice.

Bodies past ``LARGE_BODY_BYTES`` are worked on one at a time, from their last byte's arrival
until their endpoint has its prompt (``done_with_body``) or answers: a small request then waits
behind one large body's work at most, never behind all of them, and only one is parsed at once;
each turn rests after it as long as it was held (``_resting``).
Arriving holds no turn: a slow upload, or a client that stops sending, delays only itself; one that
sends nothing for ``BODY_IDLE_S`` gets a 408, as nginx's ``client_body_timeout`` answers."""

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
BODY_IDLE_S = 60.0  # the longest a body may stop arriving before the request is answered 408
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
        body = await self._receive(scope, receive, send)
        if body is None:
            return
        if len(body) <= LARGE_BODY_BYTES:
            if await self._parse(scope, send, body):
                await self.app(scope, _replay(body, receive), send)
            return
        # A large body holds the turn from its last byte until its endpoint is done with the
        # prompt (done_with_body) or answers: its parsing, validation and tokenizing hold the
        # event loop in turns, and its copies are megabytes. Generation does not hold it.
        await self._large.acquire()
        release = _Once(self._resting(asyncio.get_running_loop()))
        scope[_RELEASE] = release
        try:
            if await self._parse(scope, send, body):
                await self.app(scope, _replay(body, receive), _releasing(send, release))
        finally:
            release()

    def _resting(self, loop: asyncio.AbstractEventLoop):
        """The large-body turn's release, after a rest as long as the turn was held: its work
        holds the GIL in calls of tens of ms, which the engine's thread and the small requests
        wait out, so back-to-back large bodies would starve them; with the rest they get at least
        half of the time."""
        started = loop.time()
        return lambda: loop.call_later(loop.time() - started, self._large.release)

    async def _receive(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body; None where it was answered here (too large, stopped arriving) or the
        client left."""
        chunks, size = [], 0
        while True:
            try:
                async with asyncio.timeout(BODY_IDLE_S):
                    message = await receive()
            except TimeoutError:
                log.warning("%s %s: the body stopped arriving after %d bytes", scope["method"], scope["path"], size)
                message = f"the request body stopped arriving for {BODY_IDLE_S:g} s"
                await _answer(send, 408, error_body(message, "invalid_request_error", 408))
                return None
            if message["type"] != "http.request":  # the client left before its body was in
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(scope, send, size)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _parse(self, scope: Scope, send: Send, body: bytes) -> bool:
        """A JSON body parsed into the scope; False where it was answered here (too deep)."""
        if body and _is_json(dict(scope["headers"]).get(b"content-type")):
            try:
                if len(body) < OFF_LOOP_BYTES:
                    scope[_PARSED] = json_depth.loads(body, self.max_depth)
                else:  # tens of ms per MiB: in a thread, so small requests get the loop meanwhile
                    scope[_PARSED] = await asyncio.to_thread(json_depth.loads, body, self.max_depth)
            except json_depth.TooDeepError as exc:
                log.warning(
                    "%s %s: refused a body nested too deep (%d bytes)", scope["method"], scope["path"], len(body)
                )
                await _answer(send, 400, error_body(f"invalid request: {exc}", "invalid_request_error", 400))
                return False
            except ValueError:  # not JSON: the endpoint's own parsing says so, as it always has
                pass
        return True

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
