"""KV cache transfer between a prefill and a decode server, over plain HTTP.

The router asks a prefill server (``kv_transfer_params.do_remote_decode``) to compute each
prompt's KV: the server runs ``prompt[:-1]`` as a one-token request whose final event carries
the KV copied out of its blocks (the blocks are freed at once), and keeps it in its
``KVExportStore`` under a fresh id. It answers with those ids. The router then sends the client's
request to a decode server with ``do_remote_prefill``, the prefill server's URL and the ids; the
decode server fetches each body (``GET /v1/kv/{id}``, one-shot), checks it against its own model,
layout and tokenization (server/core/kv_wire.py), and queues the request with the KV imported:
it computes only the last prompt token, then decodes. Its greedy output is the colocated one.

A decode server fetches only the blocks it lacks (``?first_block=N``): the leading full blocks
already in its prefix cache, such as a system prompt every request shares, or the earlier turns of
a conversation it served, stay out of the transfer, as vLLM's decode side looks up its own
prefix cache before it pulls the rest.

Trust: a decode server fetches only from the prefill servers it was given (http/prefill_peers.py),
never from an address a request names; it tells a client nothing of what a peer answered (that is
logged); and every body carries an HMAC keyed by the fleet's transfer token (core/kv_wire.py), so
KV that no fleet server made never enters its cache.

Why pull, not push or relay: the KV goes prefill -> decode directly, never through the router,
and the prefill server holds it in host memory only until the decode server took it, or a TTL
ran out, so an abandoned transfer never pins memory.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Query, Request
from fastapi.responses import StreamingResponse

from llmfleet.server.core.kv_wire import (
    KVCorruptError,
    KVForgedError,
    KVImport,
    KVMismatchError,
    body_mac,
    decode,
    encode_header,
    kv_key,
    leave_out_blocks,
    max_body_bytes,
    why_it_does_not_fit,
)
from llmfleet.server.core.request import SamplingParams
from llmfleet.server.http.errors import APIError
from llmfleet.server.http.kv_store import HeldKV
from llmfleet.server.http.state import ServerState
from llmfleet.server.openai.protocol import KVTransferParams
from llmfleet.server.openai.submission import EventStream, SubRequest, submit
from llmfleet.server.wire.auth import KV_TOKEN_HEADER, carries_kv_token
from llmfleet.server.wire.errors import error_fields

log = logging.getLogger(__name__)
KV_MEDIA_TYPE = "application/x-llmfleet-kv"
_SEND_CHUNK = 4 << 20  # bytes per write of a KV body
_PARAM = "kv_transfer_params"


async def prefill_for_remote_decode(
    state: ServerState, prompts: list[list[int]], priority: int, arrival: float
) -> dict:
    """Compute and hold the KV of every prompt but its last token; answer the ids to fetch."""
    if state.role != "prefill" or state.kv_store is None:
        raise APIError(400, f"do_remote_decode needs a prefill server; this one is {state.role}", param=_PARAM)
    one_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    subs = [
        SubRequest(i, f"prefill-{uuid.uuid4().hex}-{i}", prompt[:-1], one_token)
        for i, prompt in enumerate(prompts)
        if len(prompt) > 1  # a one-token prompt has nothing to transfer: the decode server computes it
    ]
    ids: list[str | None] = [None] * len(prompts)
    if subs:
        submission = await submit(state, subs, priority, arrival, export_kv=True)
        events = EventStream(state, submission)
        try:
            async for owner, event in events:
                if event.finished:
                    if event.kv_export is None:  # aborted (a drain timeout): no KV to hand over
                        raise APIError(503, "the prefill was aborted; retry on another server", "unavailable")
                    ids[owner.index] = state.kv_store.put(owner.prompt, event.kv_export)
        finally:
            await events.aclose()
    state.metrics.set_kv_held(state.kv_store.held_bytes)
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "id": f"prefill-{uuid.uuid4().hex}",
        "object": "kv_transfer",
        "model": state.model_name,
        "kv_transfer_params": {"do_remote_prefill": True, "remote_kv_ids": ids},
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens},
    }


def require_kv_token(state: ServerState, raw: Request) -> None:
    """The transfer paths are the fleet's own (auth.py): a 403 for a request without its token."""
    if not carries_kv_token(raw.headers, state.kv_token):
        message = f"KV transfers are the fleet's own: this server takes them only with its {KV_TOKEN_HEADER}"
        raise APIError(403, message, "permission_error", param=_PARAM)


def install_prefill_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/kv/{kv_id}")
    async def fetch_kv(raw: Request, kv_id: str, first_block: int = Query(0, ge=0)):
        """The KV body of one prefilled prompt, once: the decode server's fetch, from block
        ``first_block`` on (the ones before it are in the decode server's prefix cache)."""
        require_kv_token(state, raw)
        entry = state.kv_store.get(kv_id)
        if entry is None:
            raise APIError(404, f"no KV {kv_id} here: expired, evicted or already taken", "not_found_error")
        full_blocks = state.kv_layout.full_blocks(len(entry.token_ids))
        if first_block > full_blocks:
            message = f"first_block {first_block} is past the KV's {full_blocks} full blocks"
            raise APIError(400, message, param="first_block")
        state.kv_store.take(kv_id)
        state.metrics.set_kv_held(state.kv_store.held_bytes)
        # the copy, the checksum and the MAC read every byte (zlib and hashlib let go of the GIL):
        # off the event loop
        header, payload, mac = await asyncio.to_thread(_body, state, entry, first_block)
        return StreamingResponse(
            _send(state, header, payload, mac),
            media_type=KV_MEDIA_TYPE,
            headers={"Content-Length": str(len(header) + payload.nbytes + len(mac))},
        )


def _body(state: ServerState, entry: HeldKV, first_block: int) -> tuple[bytes, memoryview, bytes]:
    payload = leave_out_blocks(entry.payload, state.kv_layout, len(entry.token_ids), first_block)
    header = encode_header(state.model_name, state.kv_layout, entry.token_ids, payload, first_block)
    return header, payload, body_mac(kv_key(state.kv_token), header, payload)


async def _send(state: ServerState, header: bytes, payload: memoryview, mac: bytes) -> AsyncIterator[bytes]:
    started = time.perf_counter()
    yield header
    for start in range(0, payload.nbytes, _SEND_CHUNK):
        yield bytes(payload[start : start + _SEND_CHUNK])
    yield mac
    state.metrics.observe_kv_transfer(len(header) + payload.nbytes + len(mac), time.perf_counter() - started)


# --- the decode side -------------------------------------------------------------------------------
async def receive(
    state: ServerState, params: KVTransferParams, prompts: list[list[int]], salt: str | None = None
) -> list[KVImport | None]:
    """Fetch and check the KV of every prompt from the prefill server named in ``params``, which
    must be one of this server's prefill pool (a 403, with no connection made, where it is not).

    A body that does not fit this server (another model, layout or tokenization) is a 409 that
    says what differs; a prefill server that cannot be reached, no longer holds the KV, or sends
    a body that fails its MAC, is a 502 the router answers by retrying the request elsewhere. What
    the peer answered is logged, never told to the client."""
    if state.role != "decode":
        raise APIError(400, f"do_remote_prefill needs a decode server; this one is {state.role}", param=_PARAM)
    ids = params.remote_kv_ids
    if not params.remote_url or ids is None or len(ids) != len(prompts):
        raise APIError(400, "do_remote_prefill needs remote_url and one remote_kv_ids entry per prompt", param=_PARAM)
    base = params.remote_url.rstrip("/")
    if state.prefill_peers is None or not await state.prefill_peers.knows(base):
        state.metrics.count_kv_failure("unknown_peer")
        log.warning("refused a KV transfer from %s: not one of this server's prefill servers", base)
        message = (
            "remote_url is not one of this decode server's prefill servers (--prefill-url, --prefill-host, "
            "--endpoints-file): it fetches KV from no other address"
        )
        raise APIError(403, message, "permission_error", param=_PARAM)
    client = state.http_client()
    key = kv_key(state.kv_token)

    async def one(kv_id: str | None, prompt: list[int]) -> KVImport | None:
        if kv_id is None:
            return None
        started = time.perf_counter()
        cached = state.engine.cached_prefix_blocks(prompt[:-1], salt, len(prompt))
        query = f"?first_block={cached}" if cached else ""
        limit = max_body_bytes(state.kv_layout, len(prompt) - 1, cached)
        try:
            async with client.stream("GET", f"{base}/v1/kv/{kv_id}{query}") as response:
                if response.status_code != 200:
                    await response.aread()
                    raise _transfer_failed(f"answered {response.status_code}{_their_error(response)}")
                body = await _read_at_most(response, limit)
        except httpx.HTTPError as exc:
            raise _transfer_failed(f"cannot be reached: {exc!r}") from exc
        try:
            if len(body) > limit:
                why_it_does_not_fit(memoryview(body)[:limit], state.model_name, state.kv_layout, prompt[:-1])
                raise KVCorruptError(f"KV body is over the {limit} bytes a body for this prompt can have")
            payload = await asyncio.to_thread(decode, body, state.model_name, state.kv_layout, prompt[:-1], cached, key)
        except KVMismatchError as exc:
            state.metrics.count_kv_failure("mismatch")
            raise APIError(409, f"KV from {base} does not fit this server: {exc}", "kv_transfer_mismatch") from exc
        except KVForgedError as exc:
            state.metrics.count_kv_failure("forged")
            raise _transfer_failed(f"sent KV that fails its MAC: {exc}") from exc
        except KVCorruptError as exc:
            raise _transfer_failed(f"sent unusable KV: {exc}") from exc
        state.metrics.observe_kv_transfer(len(body), time.perf_counter() - started)
        state.metrics.count_kv_cached_tokens(cached * state.kv_layout.block_size)
        return KVImport(len(prompt) - 1, payload, cached)

    def _transfer_failed(why: str) -> APIError:
        """The client's 502 says which server failed, not what it said: that goes to the log."""
        state.metrics.count_kv_failure("fetch")
        log.warning("KV transfer from the prefill server at %s failed: it %s", base, why)
        return APIError(502, f"the prefill server at {base} could not hand over the KV", "kv_transfer_failed")

    return list(await asyncio.gather(*(one(kv_id, prompt) for kv_id, prompt in zip(ids, prompts, strict=True))))


def _their_error(response: httpx.Response) -> str:
    """A peer's OpenAI-style error message, and nothing else of its body, for the log."""
    message = (error_fields(response.content) or (None,))[0]
    return f": {message[:200]}" if isinstance(message, str) else ""


async def _read_at_most(response: httpx.Response, limit: int) -> bytearray:
    """The body, or its first bytes past ``limit`` where it is longer: a bad peer cannot make this
    server hold more than one body's worth."""
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > limit:
            break
    return body
