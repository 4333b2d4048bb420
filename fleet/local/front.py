"""The local fleet's client-facing endpoint for a colocated pool: one URL in front of the pool's
servers, like the pool's Service in a cluster. Each request goes to the least loaded server as the
router ranks them (``load_score`` over this front's own requests: those held, and of them those
whose first token has not come back, which a new prompt would queue behind); a server that
refuses the connection (starting, gone) or answers 503 (draining) is skipped and the request tried
on the next. Responses stream through unchanged, so SSE reaches the client token by token; a
client that leaves before its answer comes closes the server's connection, as it would through a
Service, and the server aborts. A server that fails mid-stream ends the client's stream with an
error event and ``[DONE]``, as the router does."""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import AsyncIterator, Callable

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llmfleet.server.router.load import load_score
from llmfleet.server.router.stream_meter import StreamMeter, flag
from llmfleet.server.wire.client_gone import CLIENT_GONE, unless_client_gone
from llmfleet.server.wire.keepalive import pooled
from llmfleet.server.wire.sse import WholeEvents, broken_stream_end

log = logging.getLogger(__name__)
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error", "code": status}}, status_code=status)


class _Hold:
    """A request's place in its server's counts: held until its answer ends, unstarted until its
    first generated token (or the whole answer) comes back."""

    def __init__(self, url: str, in_flight: dict[str, int], unstarted: dict[str, int]) -> None:
        self.url, self._in_flight, self._unstarted, self.started = url, in_flight, unstarted, False
        in_flight[url] = in_flight.get(url, 0) + 1
        unstarted[url] = unstarted.get(url, 0) + 1

    def start(self) -> None:
        if not self.started:
            self.started = True
            self._unstarted[self.url] -= 1

    def end(self) -> None:
        self.start()
        self._in_flight[self.url] -= 1


async def _relayed(response: httpx.Response, hold: _Hold, echo: bool) -> AsyncIterator[bytes]:
    """The server's body; an event stream goes out in whole events, so that the error event a
    failure mid-stream adds is not glued onto half of one. The request has started once the first
    generated token goes by (a chat's opening chunk is none), or any of a whole answer."""
    events = WholeEvents() if response.headers.get("content-type", "").startswith("text/event-stream") else None
    meter = StreamMeter(None, 0.0, echo=echo)  # read only until the first token: then no more parsing
    try:
        async for chunk in response.aiter_raw():
            whole = chunk if events is None else events.feed(chunk)
            if events is not None and not hold.started:
                meter.read(whole)
            if events is None or meter.started_content:
                hold.start()
            if whole:
                yield whole
        if events is not None and (rest := events.rest()):
            yield rest
    except httpx.HTTPError as exc:
        log.warning("server %s failed mid-answer: %r", hold.url, exc)
        if events is not None:
            yield broken_stream_end(f"the server failed mid-stream ({exc!r}); the answer is incomplete")


def _echoes(body: bytes) -> bool:
    """A completion whose first chunk per choice is its echoed prompt, not a generated token
    (``echo`` read as the servers read it, as the router reads it)."""
    try:
        return flag(json.loads(body).get("echo"))
    except (ValueError, AttributeError):
        return False


def build_front(backends: Callable[[], list[str]]) -> Starlette:
    """``backends()`` returns the ready servers' base URLs at the time of each request."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=2.0), limits=pooled())
    in_flight: dict[str, int] = {}
    unstarted: dict[str, int] = {}
    tie_break = itertools.count()

    def ordered() -> list[str]:
        urls = backends()
        turn = next(tie_break)

        def load(u: str) -> tuple[float, int, int]:
            held = in_flight.get(u, 0)
            return load_score(held, unstarted.get(u, 0), 0.0), held, (urls.index(u) - turn) % max(1, len(urls))

        return sorted(urls, key=load)

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(_: Request) -> Response:
        n = len(backends())
        return JSONResponse({"ready": n > 0, "backends": n}, status_code=200 if n else 503)

    async def forward(request: Request) -> Response:
        body = await request.body()
        echo = _echoes(body)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        tried = []
        candidates = ordered()  # the pool as the request found it: a server drained meanwhile still counts
        for url in candidates:
            upstream = client.build_request(
                request.method, url + request.url.path, params=request.query_params, headers=headers, content=body
            )
            # counted from the send: a non-streaming answer's headers come only once it is done
            hold = _Hold(url, in_flight, unstarted)
            try:
                response = await unless_client_gone(request, client.send(upstream, stream=True))
            except httpx.TransportError as exc:
                hold.end()
                tried.append(f"{url}: {type(exc).__name__}")
                continue
            if response is None:  # the client left: the cancelled send closed the connection, the server aborts
                hold.end()
                return Response(status_code=CLIENT_GONE)
            if response.status_code == 503 and len(tried) + 1 < len(candidates):
                hold.end()
                await response.aclose()
                tried.append(f"{url}: 503")
                continue

            async def relay(response=response, hold=hold):
                try:
                    async for chunk in _relayed(response, hold, echo):
                        yield chunk
                finally:
                    hold.end()
                    await response.aclose()

            out_headers = {k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS}
            return StreamingResponse(relay(), status_code=response.status_code, headers=out_headers)
        detail = "; ".join(tried) or "no server is ready yet"
        return _error(503, f"no replica could take the request ({detail}); retry shortly")

    routes = [
        Route("/health", health),
        Route("/ready", ready),
        Route("/{path:path}", forward, methods=["GET", "POST"]),
    ]

    app = Starlette(routes=routes)
    app.state.client = client  # closed by whoever stops the app
    return app
