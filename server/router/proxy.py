"""One client request through the fleet: to a colocated server, or a prefill server, then a decode
server.

A colocated router relays the request to the server its policy picks and the answer back, with
the retries below (a colocated server fails as a decode server does). A disaggregated one:

1. A prefill server computes the prompt's KV (``kv_transfer_params.do_remote_decode``) and
   answers the ids it holds it under.
2. A decode server gets the client's request with those ids and the prefill server's URL; it
   fetches the KV straight from the prefill server and answers the client's request as a
   colocated server would, streaming or not. The router relays its bytes unchanged.

Faults, and what the client sees:

- a prefill server that refuses the connection, times out, is busy (429) or draining (503), or
  fails (5xx): the request goes to another one; with no healthy one left, the decode server
  computes the prompt itself (``llmfleet_router_local_prefills``). These cost no decode attempt;
- a server whose ``/load`` polls fail while a request waits on it (its process stopped, its node
  lost: nothing resets the connection) fails that request as a timeout would, at once, whether
  it waits for a prefill, a stream's first content or a whole answer. One request's refusal
  there (a 429, a 5xx) sets the server aside for new requests but fails no other;
- a decode server that fails the same ways before the first byte of content left the router:
  the request starts over on other servers (the KV is taken once);
- a decode server that cannot fetch the KV: the prefill server that held it is set aside, and
  the request starts over with another prefill (the decode server is kept);
- a decode server that fails after content went out: the stream ends with an OpenAI-style error
  event and ``[DONE]``, never a hang (every read of a stream has a timeout; a whole answer, which
  sends nothing until it is complete, is waited for as long as the server answers its polls);
- a 4xx from either server (a bad prompt, an unknown model) is the client's: relayed as is; a
  409 from the decode server (the prefill server's KV does not fit it: another model or layout)
  is a deployment error: 502 with its message.

The router never holds KV: it only passes ids. A request that finds no server of the serving
pool (the colocated or decode pool) at all waits for one first (hold.py), and so does one that
ran out of servers to try because every one it tried had gone (a pool scaled to zero whose last
server exited before the router saw its endpoint withdrawn).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

import httpx
from fastapi import Request
from fastapi.responses import Response

from llmfleet.server.http.errors import error_response
from llmfleet.server.http.sse import SSE_HEADERS, ClosingStreamingResponse
from llmfleet.server.router.balancer import Balancer, never_reached
from llmfleet.server.router.hold import Holding, HoldSettings
from llmfleet.server.router.load import Server
from llmfleet.server.router.policies import prefix_hashes
from llmfleet.server.router.router_metrics import RouterMetrics
from llmfleet.server.router.stream_meter import StreamMeter, flag
from llmfleet.server.wire.client_gone import CLIENT_GONE, unless_client_gone
from llmfleet.server.wire.errors import error_fields
from llmfleet.server.wire.sse import broken_stream_end

log = logging.getLogger(__name__)
T = TypeVar("T")
HEALTH_CHECK_S = 1.0  # how often a whole answer's wait looks at its server's health


@dataclass(frozen=True)
class ProxySettings:
    prefill_timeout_s: float = 120.0  # longest wait for a prefill server's answer
    decode_timeout_s: float = 120.0  # longest wait for any byte from a decode server
    connect_timeout_s: float = 2.0
    attempts: int = 3  # prefill + decode rounds per request


class ServerFailed(Exception):
    """The server could not serve this request now; another one may. ``kv_lost``: a decode
    server that could not fetch the KV, which is the prefill server's failure, not its own.
    ``token_refused``: a server that refuses the router's KV-transfer token (a rollout).
    ``unreached``: no connection to it could be made (it exited, or its node is gone)."""

    def __init__(
        self,
        server: Server,
        message: str,
        status: int = 502,
        kv_lost: bool = False,
        token_refused: bool = False,
        unreached: bool = False,
    ) -> None:
        super().__init__(message)
        self.server, self.message, self.status, self.kv_lost = server, message, status, kv_lost
        self.token_refused, self.unreached = token_refused, unreached


class Answered(Exception):
    """A final answer for the client (a 4xx of its own, or a deployment error)."""

    def __init__(self, response: Response) -> None:
        self.response = response


@dataclass
class _Opened:
    """A decode server's answer whose first content has arrived (or all of it, not streaming)."""

    server: Server
    response: httpx.Response
    head: list[bytes]  # what was read so far, not yet sent
    rest: AsyncIterator[bytes] | None
    meter: StreamMeter | None


class Proxy:
    def __init__(
        self,
        balancer: Balancer,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        settings: ProxySettings,
        holding: Holding | None = None,
    ) -> None:
        self.balancer = balancer
        self.client = client
        self.metrics = metrics
        self.settings = settings
        self.holding = holding or Holding(balancer, HoldSettings(), metrics)

    async def serve(self, path: str, body: dict, raw: Request) -> Response:
        started = time.monotonic()
        stream = flag(body.get("stream"))
        opened = await unless_client_gone(raw, self._open(path, body, stream, started))
        if opened is None:  # the servers abort what they started; like them, no finished request
            return Response(status_code=CLIENT_GONE)
        if isinstance(opened, Response):
            return opened
        if stream:
            relay = _Relay(opened, self.metrics, started)
            return ClosingStreamingResponse(relay, media_type="text/event-stream", headers=SSE_HEADERS)
        return self._whole(opened, started)

    # --- choosing servers, with retries ----------------------------------------------------------
    async def _open(self, path: str, body: dict, stream: bool, started: float) -> _Opened | Response:
        # Transfer parameters are the router's to set: a client's would reach the decode server
        # whenever it prefills itself, and have it fetch "KV" from any URL the client names.
        body = {key: value for key, value in body.items() if key != "kv_transfer_params"}
        serving = self.balancer.serving_pool
        refused = await self.holding.wait(serving)  # a pool with no server: wait for its first
        if refused is not None:
            return refused
        tried: dict[str, set[str]] = {pool: set() for pool in self.balancer.pools}
        last: ServerFailed | None = None
        prefixes = prefix_hashes(body) if self.balancer.reads_prefixes else []  # only a prefix policy reads them
        made = holds = 0
        while made < self.settings.attempts:
            decode = await self.balancer.pick_or_rediscover(serving, tried[serving], prefixes)
            if decode is None and await self._holds_again(serving, tried[serving], holds):
                holds += 1  # its servers exited before their endpoints went: as at zero, wait for one
                refused = await self.holding.wait(serving)
                if refused is not None:
                    return refused
                continue
            if decode is None:  # before any prefill: KV nobody can decode would only wait for its TTL
                break
            made += 1
            prefill = None
            try:
                if "prefill" in tried:
                    decode.hold(+1)  # from the pick: a burst spreads before its prefills return
                    try:
                        prefill = await self._prefill(path, body, tried, prefixes)
                    finally:
                        decode.hold(-1)  # _decode takes it over, with no await in between
                params = None if prefill is None else prefill[0]
                try:
                    return await self._decode(decode, path, body, params, stream, started)
                except ServerFailed as failure:
                    if not (failure.token_refused and params is not None):
                        raise
                    self.metrics.lab(self.metrics.fallbacks).inc()  # it computes the prompt itself
                    return await self._decode(decode, path, body, None, stream, started)
            except ServerFailed as failure:
                if failure.kv_lost and prefill is not None:  # the decode server is fine: keep it
                    failure = ServerFailed(prefill[1], failure.message, failure.status)
                self._set_aside(failure, tried, made)
                last = failure
            except Answered as answer:
                return answer.response
        if last is None:
            return error_response(503, f"no {serving} server is available; retry later", "unavailable")
        status = last.status if last.status in (429, 503) else 502
        message = f"no server could take the request after {made} attempt{'s' * (made > 1)}; last: {_public(last)}"
        return error_response(status, message, _ERROR_TYPES[status])

    async def _holds_again(self, pool: str, tried: set[str], holds: int) -> bool:
        """A request that ran out of servers to try because none of ``pool`` takes requests any
        more (each refuses connections, or drains) is held as one that found the pool at zero, a
        few times at most. The servers it tried are polled first: one that failed it by exiting
        (a reset connection) refuses connections by now."""
        if not self.holding.settings.enabled or holds >= self.settings.attempts:
            return False
        if self.balancer.has_open(pool):
            await self.balancer.recheck([s for s in self.balancer.servers[pool].values() if s.url in tried])
        return not self.balancer.has_open(pool)

    def _set_aside(self, failure: ServerFailed, tried: dict[str, set[str]], attempt: int) -> None:
        """``attempt``: which one failed, counting from 1."""
        pool = failure.server.pool
        tried[pool].add(failure.server.url)
        self.balancer.failed(failure.server, failure.message, unreachable=failure.unreached)
        self.metrics.lab(self.metrics.retries, pool=pool).inc()
        log.warning("attempt %d: %s", attempt, failure.message)

    async def _prefill(
        self, path: str, body: dict, tried: dict[str, set[str]], prefixes: list[int]
    ) -> tuple[dict, Server] | None:
        """The KV transfer parameters for the decode server and the prefill server that holds
        the KV, or None when the decode server must compute the prompt itself: the prompt is
        scored, or no healthy prefill server is left to try (one set aside is worth less than
        the decode server's own prefill). Prefill failures cost no decode attempt."""
        if _scores_the_prompt(path, body):
            return None  # the prompt's logprobs come from the server that computes it: the decode server
        for attempt in range(self.settings.attempts):
            server = self.balancer.pick("prefill", tried["prefill"], prefixes, healthy_only=True)
            if server is None:
                break
            try:
                return await self._prefill_on(server, path, body), server
            except ServerFailed as failure:
                self._set_aside(failure, tried, attempt + 1)
        self.metrics.lab(self.metrics.fallbacks).inc()
        return None

    async def _prefill_on(self, server: Server, path: str, body: dict) -> dict:
        ask = {**body, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        ask.pop("stream_options", None)
        timeout = httpx.Timeout(self.settings.prefill_timeout_s, connect=self.settings.connect_timeout_s)
        server.hold(+1)  # a prefill server's whole answer is the client's wait for a first token
        try:
            response = await _while_polled(
                server, self.client.post(f"{server.url}{path}", **json_request(ask), timeout=timeout)
            )
        except httpx.HTTPError as exc:
            raise ServerFailed(server, f"prefill server {server.url}: {exc!r}", unreached=never_reached(exc)) from exc
        finally:
            server.hold(-1)
        if response.status_code == 200:
            try:
                params = dict(response.json()["kv_transfer_params"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ServerFailed(server, f"prefill server {server.url} answered no KV ids") from exc
            return {**params, "do_remote_prefill": True, "remote_url": server.url}
        raise _refusal(server, response)

    async def _decode(
        self, server: Server, path: str, body: dict, params: dict | None, stream: bool, started: float
    ) -> _Opened:
        send = {**body, "kv_transfer_params": params} if params is not None else body
        # A whole answer sends no byte before it is complete: no read timeout can tell a long
        # generation from a lost server, so the balancer's /load polls tell instead.
        read = self.settings.decode_timeout_s if stream else None
        timeout = httpx.Timeout(read, connect=self.settings.connect_timeout_s)
        server.hold(+1)
        response = None
        try:
            request = self.client.build_request("POST", f"{server.url}{path}", **json_request(send), timeout=timeout)
            response = await _while_polled(server, self.client.send(request, stream=True))
            if response.status_code != 200:
                await response.aread()
                raise _refusal(server, response)
            if not stream:
                return _Opened(server, response, [await _while_polled(server, response.aread())], None, None)
            meter = StreamMeter(self.metrics, started, echo=flag(body.get("echo")))
            rest = response.aiter_raw()
            head = await _while_polled(server, _first_content(rest, meter))
            return _Opened(server, response, head, rest, meter)
        except httpx.HTTPError as exc:
            server.assigned -= 1
            if response is not None:
                await response.aclose()
            message = f"{server.pool} server {server.url}: {exc!r}"
            raise ServerFailed(server, message, unreached=never_reached(exc)) from exc
        except BaseException:
            server.assigned -= 1
            if response is not None:
                await response.aclose()
            raise
        finally:  # its first content came (or the whole answer), or this attempt is over
            server.unstarted -= 1

    # --- relaying the answer -------------------------------------------------------------------
    def _whole(self, opened: _Opened, started: float) -> Response:
        opened.server.assigned -= 1
        content = opened.head[0]
        try:
            reasons = [c.get("finish_reason") for c in json.loads(content).get("choices") or []]
        except (ValueError, AttributeError):
            reasons = []
        self.metrics.finished(started, next((r for r in reasons if r), None))
        return Response(content, 200, media_type="application/json")


class _Relay:
    """The decode server's stream, relayed. Its cleanup (the server's count, the upstream
    connection, the request's metrics) runs exactly once in ``aclose``, which the response calls
    even when the client left before the first chunk was sent."""

    def __init__(self, opened: _Opened, metrics: RouterMetrics, started: float) -> None:
        self.opened = opened
        self.metrics = metrics
        self.started = started
        self._chunks = self._body()
        self._closed = False

    def __aiter__(self) -> _Relay:
        return self

    async def __anext__(self) -> bytes:
        return await self._chunks.__anext__()

    async def _body(self) -> AsyncIterator[bytes]:
        opened, meter = self.opened, self.opened.meter
        try:
            for chunk in opened.head:
                yield chunk
            async for chunk in opened.rest:
                whole = meter.feed(chunk)
                if whole:
                    yield whole
            if not meter.done:  # the decode server closed the stream early
                raise httpx.RemoteProtocolError("the stream ended without [DONE]")
        except httpx.HTTPError as exc:
            self.metrics.lab(self.metrics.broken_streams).inc()
            log.warning("%s server %s failed mid-stream: %r", opened.server.pool, opened.server.url, exc)
            message = f"the {opened.server.pool} server failed mid-stream ({exc!r}); the answer is incomplete"
            yield broken_stream_end(message)
            meter.finish_reason = meter.finish_reason or "abort"

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._chunks.aclose()
        self.opened.server.assigned -= 1
        await self.opened.response.aclose()  # a client that left: the decode server aborts its work
        if self.opened.meter.finish_reason is not None:  # not a client that left (server_metrics.py)
            self.metrics.finished(self.started, self.opened.meter.finish_reason)


_ERROR_TYPES = {429: "rate_limit_exceeded", 503: "unavailable", 502: "bad_gateway"}  # as the servers type them


def _refusal(server: Server, response: httpx.Response) -> ServerFailed | Answered:
    """What a server's non-200 answer (read whole) means for the request: try elsewhere, or
    answer the client."""
    status, content = response.status_code, response.content
    message, kind = _error_fields(content)
    message = message or f"status {status}"
    where = f"{server.pool} server {server.url}"
    if status in (429, 503) or status >= 500:
        kv_lost = server.pool == "decode" and kind == "kv_transfer_failed"
        return ServerFailed(server, f"{where} answered {status}: {message}", status, kv_lost=kv_lost)
    if status == 403 and kind == "permission_error":  # our transfer, not the client's doing (a
        # rollout that set or rotated the token, a decode server that does not know the prefill
        # server): a prefill server is skipped; a decode server is asked again without the
        # transfer, and computes the prompt itself
        log.error("%s refuses the router's KV transfer: %s", where, message)
        return ServerFailed(server, f"{where} refuses the router's KV transfer", 502, token_refused=True)
    if status == 409 and server.pool == "decode":
        answer = f"the decode server cannot use the prefill server's KV: {message}"
        log.error("%s cannot use the prefill server's KV: %s", where, message)
        return Answered(error_response(502, answer, "bad_gateway"))
    return Answered(Response(content, status, media_type=response.headers.get("content-type", "application/json")))


def _public(failure: ServerFailed) -> str:
    """A failure's message for the client: the servers' addresses are the fleet's own (the log
    and the router's /load have them)."""
    url = failure.server.url
    return failure.message.replace(f" {url}", "").replace(url, "the server")


def _error_fields(content: bytes) -> tuple[str | None, str | None]:
    """An OpenAI-style error's message and type; or the start of the body, and no type."""
    fields = error_fields(content)
    if fields is not None:
        return str(fields[0]), fields[1]
    text = content.decode(errors="replace").strip()
    return text[:300] or None, None


async def _while_polled(server: Server, work: Awaitable[T]) -> T:
    """``work``, for as long as the balancer's polls find its server alive. One they fail from
    now on (its node gone, or its process stopped: no connection reset tells) fails it as a read
    timeout would. Another request's failure there (a 429, a 5xx) is that request's alone."""
    failures = server.poll_failures
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=HEALTH_CHECK_S)
            if done:
                return task.result()
            if server.poll_failures > failures and not server.healthy:
                raise httpx.ReadTimeout(f"{server.url} stopped answering its /load polls")
    finally:
        task.cancel()


async def _first_content(rest: AsyncIterator[bytes], meter: StreamMeter) -> list[bytes]:
    """The stream's events up to its first content, held back: until then a retry is free."""
    head = []
    async for chunk in rest:
        if whole := meter.feed(chunk):
            head.append(whole)
        if meter.started_content:
            break
    return head


def json_request(body: dict) -> dict:
    """The body as the servers parse it: Python's json, where NaN and Infinity are numbers their
    models then refuse with a 400 (httpx's own encoder raises on them)."""
    return {"content": json.dumps(body).encode(), "headers": {"Content-Type": "application/json"}}


def _scores_the_prompt(path: str, body: dict) -> bool:
    """vLLM's prompt_logprobs, or a completion's echo with logprobs."""
    echoed = path == "/v1/completions" and flag(body.get("echo")) and body.get("logprobs") is not None
    return body.get("prompt_logprobs") is not None or bool(echoed)
