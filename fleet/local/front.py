"""The local fleet's client-facing endpoint for a colocated pool: one URL in front of the pool's
servers, like the pool's Service in a cluster. Each request goes to the server holding the fewest
of this front's in-flight requests; a server that refuses the connection (starting, gone) or
answers 503 (draining) is skipped and the request tried on the next. Responses stream through
unchanged, so SSE reaches the client token by token; a client that leaves before its answer
comes closes the server's connection, as it would through a Service, and the server aborts. A
server that fails mid-stream ends the client's stream with an error event and ``[DONE]``, as the
router does."""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator, Callable

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llmfleet.server.api.client_gone import CLIENT_GONE, unless_client_gone
from llmfleet.server.api.keepalive import pooled
from llmfleet.server.api.sse import WholeEvents, broken_stream_end

log = logging.getLogger(__name__)
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error", "code": status}}, status_code=status)


async def _relayed(response: httpx.Response, url: str) -> AsyncIterator[bytes]:
    """The server's body; an event stream goes out in whole events, so that the error event a
    failure mid-stream adds is not glued onto half of one."""
    events = WholeEvents() if response.headers.get("content-type", "").startswith("text/event-stream") else None
    try:
        async for chunk in response.aiter_raw():
            whole = chunk if events is None else events.feed(chunk)
            if whole:
                yield whole
        if events is not None and (rest := events.rest()):
            yield rest
    except httpx.HTTPError as exc:
        log.warning("server %s failed mid-answer: %r", url, exc)
        if events is not None:
            yield broken_stream_end(f"the server failed mid-stream ({exc!r}); the answer is incomplete")


def build_front(backends: Callable[[], list[str]]) -> Starlette:
    """``backends()`` returns the ready servers' base URLs at the time of each request."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=2.0), limits=pooled())
    in_flight: dict[str, int] = {}
    tie_break = itertools.count()

    def ordered() -> list[str]:
        urls = backends()
        turn = next(tie_break)
        return sorted(urls, key=lambda u: (in_flight.get(u, 0), (urls.index(u) - turn) % max(1, len(urls))))

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(_: Request) -> Response:
        n = len(backends())
        return JSONResponse({"ready": n > 0, "backends": n}, status_code=200 if n else 503)

    async def forward(request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        tried = []
        candidates = ordered()  # the pool as the request found it: a server drained meanwhile still counts
        for url in candidates:
            upstream = client.build_request(
                request.method, url + request.url.path, params=request.query_params, headers=headers, content=body
            )
            # counted from the send: a non-streaming answer's headers come only once it is done
            in_flight[url] = in_flight.get(url, 0) + 1
            try:
                response = await unless_client_gone(request, client.send(upstream, stream=True))
            except httpx.TransportError as exc:
                in_flight[url] -= 1
                tried.append(f"{url}: {type(exc).__name__}")
                continue
            if response is None:  # the client left: the cancelled send closed the connection, the server aborts
                in_flight[url] -= 1
                return Response(status_code=CLIENT_GONE)
            if response.status_code == 503 and len(tried) + 1 < len(candidates):
                in_flight[url] -= 1
                await response.aclose()
                tried.append(f"{url}: 503")
                continue

            async def relay(response=response, url=url):
                try:
                    async for chunk in _relayed(response, url):
                        yield chunk
                finally:
                    in_flight[url] -= 1
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
