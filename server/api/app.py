"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, health,
readiness and Prometheus metrics, with SSE streaming, admission control and drain."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..core.request import SamplingParams
from ..engine.engine import InvalidRequestError, QueueFullError, RequestOutput
from .async_engine import AsyncEngine
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def error_body(message: str, type_: str, status: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: object
    model_name: str
    max_model_len: int
    metrics: ServerMetrics
    role: str = "colocated"
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class _Sub:
    """One engine request behind an API choice."""

    index: int
    request_id: str
    prompt: list[int]
    sampling: SamplingParams


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="llm-fleet", version="0.1.0", description="OpenAI-compatible LLM serving")
    app.state.server = state

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
        return JSONResponse(error_body(exc.message, exc.type, exc.status, exc.param), exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        parts, param = [], None
        for err in exc.errors():
            loc = [str(p) for p in err.get("loc", ()) if p != "body"]
            param = param or (".".join(loc) or None)
            parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}")
        return JSONResponse(error_body("; ".join(parts), "invalid_request_error", 400, param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error", exc.status_code), exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        log.exception("unhandled error")
        return JSONResponse(error_body("internal error", "internal_error", 500), 500)

    @app.middleware("http")
    async def _in_flight(request: Request, call_next):
        gauge = state.metrics.lab(state.metrics.in_flight)
        gauge.inc()
        try:
            return await call_next(request)
        finally:
            gauge.dec()

    @app.get("/health")
    async def health():
        if not state.engine.alive:
            return JSONResponse(error_body("engine loop is not running", "internal_error", 503), 503)
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if state.draining:
            return JSONResponse(error_body("draining", "unavailable", 503), 503)
        if not state.engine.alive:
            return JSONResponse(error_body("engine loop is not running", "unavailable", 503), 503)
        return {"status": "ready", "role": state.role}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/load")
    async def load():
        """Cheap load report for routers: queue depth, running requests and KV usage."""
        s = state.engine.stats
        return {"waiting": s.num_waiting, "running": s.num_running, "kv_usage": s.kv_usage, "role": state.role}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "llm-fleet",
                    "root": state.model_name,
                    "parent": None,
                    "max_model_len": state.max_model_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        _check_serving(state, body.model)
        prompts = _completion_prompts(state, body.prompt)
        subs = _subrequests(state, prompts, body, body.max_tokens, body.logprobs)
        created, cid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
        streams = await _submit(state, subs, body.priority)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(_stream_completion(state, subs, streams, cid, created, include_usage))
        results = await _collect(state, subs, streams)
        choices = []
        for sub in subs:
            result = results[sub.index]
            choice = {"index": sub.index, "text": result.text, "finish_reason": result.finish_reason, "logprobs": None}
            if body.logprobs is not None:
                choice["logprobs"] = _completion_logprobs(state, result.token_ids, result.logprobs)
            choices.append(choice)
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": state.model_name,
            "choices": choices,
            "usage": _usage(subs, results),
        }

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest):
        _check_serving(state, body.model)
        prompt = _chat_prompt(state, body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        subs = _subrequests(state, [prompt], body, max_tokens, logprobs)
        created, cid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        streams = await _submit(state, subs, body.priority)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(_stream_chat(state, subs, streams, cid, created, include_usage))
        results = await _collect(state, subs, streams)
        choices = []
        for sub in subs:
            result = results[sub.index]
            choices.append(
                {
                    "index": sub.index,
                    "message": {"role": "assistant", "content": result.text},
                    "finish_reason": result.finish_reason,
                    "logprobs": _chat_logprobs(state, result) if body.logprobs else None,
                }
            )
        return {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": state.model_name,
            "choices": choices,
            "usage": _usage(subs, results),
        }

    @app.post("/tokenize")
    async def tokenize(body: dict):
        text = body.get("prompt")
        if not isinstance(text, str):
            raise APIError(400, "prompt must be a string", param="prompt")
        ids = state.tokenizer.encode(text, add_special_tokens=False)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    return app


# --- request preparation ---------------------------------------------------------------------------
def _check_serving(state: ServerState, model: str | None) -> None:
    if state.draining:
        raise APIError(503, "server is draining; retry on another replica", "unavailable")
    if not state.engine.alive:
        raise APIError(503, "engine loop is not running", "unavailable")
    if model is not None and model != state.model_name:
        raise APIError(
            404, f"The model `{model}` does not exist. Served: `{state.model_name}`.", "NotFoundError", "model"
        )


def _completion_prompts(state: ServerState, prompt) -> list[list[int]]:
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    vocab = len(state.tokenizer)
    out = []
    for item in prompt:
        ids = state.tokenizer.encode(item, add_special_tokens=False) if isinstance(item, str) else list(item)
        if any(t < 0 or t >= vocab for t in ids):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="prompt")
        out.append(ids)
    return out


def _chat_prompt(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        text = state.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # a template that rejects the conversation is the client's error
        raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
    return state.tokenizer.encode(text, add_special_tokens=False)


def _subrequests(state, prompts, body, max_tokens, logprobs) -> list[_Sub]:
    subs = []
    base = uuid.uuid4().hex
    for p_index, prompt in enumerate(prompts):
        if not prompt:
            raise APIError(400, "prompt must contain at least one token", param="prompt")
        if len(prompt) >= state.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {state.max_model_len} tokens, "
                f"but the prompt has {len(prompt)} tokens.",
                param="prompt",
            )
        limit = max_tokens if max_tokens is not None else state.max_model_len - len(prompt)
        for j in range(body.n):
            seed = None if body.seed is None else body.seed + j
            try:
                sampling = SamplingParams(
                    max_tokens=limit,
                    temperature=1.0 if body.temperature is None else body.temperature,
                    top_p=1.0 if body.top_p is None else body.top_p,
                    top_k=max(0, body.top_k or 0),
                    seed=seed,
                    stop=body.stop_list(),
                    stop_token_ids=list(body.stop_token_ids or []),
                    ignore_eos=body.ignore_eos,
                    logprobs=logprobs,
                )
            except ValueError as exc:
                raise APIError(400, str(exc)) from exc
            index = p_index * body.n + j
            subs.append(_Sub(index, f"{base}-{index}", prompt, sampling))
    return subs


async def _submit(state: ServerState, subs: list[_Sub], priority: int) -> dict[int, asyncio.Queue]:
    streams: dict[int, asyncio.Queue] = {}
    try:
        for sub in subs:
            streams[sub.index] = await state.engine.add(sub.request_id, sub.prompt, sub.sampling, priority)
    except InvalidRequestError as exc:
        _abort_all(state, subs, streams)
        raise APIError(400, str(exc), param="max_tokens" if "max_tokens" in str(exc) else "prompt") from exc
    except QueueFullError as exc:
        _abort_all(state, subs, streams)
        raise APIError(429, str(exc), "rate_limit_exceeded") from exc
    except RuntimeError as exc:
        _abort_all(state, subs, streams)
        raise APIError(503, str(exc), "unavailable") from exc
    return streams


def _abort_all(state: ServerState, subs: list[_Sub], streams: dict) -> None:
    for sub in subs:
        if sub.index in streams:
            state.engine.abort(sub.request_id)


async def _events(subs: list[_Sub], streams, state: ServerState) -> AsyncIterator[tuple[_Sub, RequestOutput]]:
    """Merge the sub-requests' event streams; abort whatever is unfinished if the consumer leaves."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(sub: _Sub):
        while True:
            event = await streams[sub.index].get()
            await merged.put((sub, event))
            if event.finished:
                return

    tasks = [asyncio.create_task(pump(sub)) for sub in subs]
    remaining = len(subs)
    finished: set[int] = set()
    try:
        while remaining:
            sub, event = await merged.get()
            if event.finished:
                remaining -= 1
                finished.add(sub.index)
            yield sub, event
    finally:
        for task in tasks:
            task.cancel()
        for sub in subs:
            if sub.index not in finished:
                state.engine.abort(sub.request_id)


@dataclass
class _Result:
    text: str
    finish_reason: str | None
    token_ids: list[int]
    logprobs: list
    num_output_tokens: int


async def _collect(state: ServerState, subs: list[_Sub], streams) -> dict[int, _Result]:
    """Wait for every sub-request's last event; returns index -> result."""
    text: dict[int, list[str]] = {s.index: [] for s in subs}
    tokens: dict[int, list[int]] = {s.index: [] for s in subs}
    lps: dict[int, list] = {s.index: [] for s in subs}
    done: dict[int, tuple[str | None, int]] = {}
    async for sub, event in _events(subs, streams, state):
        text[sub.index].append(event.new_text)
        tokens[sub.index].extend(event.new_token_ids)
        lps[sub.index].extend(event.logprobs or [])
        if event.finished:
            done[sub.index] = (_api_finish(event.finish_reason), event.num_output_tokens)
    return {i: _Result("".join(text[i]), done[i][0], tokens[i], lps[i], done[i][1]) for i in text}


def _api_finish(reason: str | None) -> str | None:
    # "abort" only reaches a client when the engine failed under it; OpenAI has no such value
    return "stop" if reason == "abort" else reason


def _usage(subs: list[_Sub], results: dict[int, _Result]) -> dict:
    prompt = _prompt_tokens(subs)
    completion = sum(r.num_output_tokens for r in results.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _chat_logprobs(state: ServerState, result: _Result) -> dict:
    decode = state.tokenizer.decode
    content = []
    for token, lp in zip(result.token_ids, result.logprobs, strict=False):
        top = [{"token": decode([t]), "logprob": v} for t, v in (lp.top_logprobs or {}).items()]
        content.append({"token": decode([token]), "logprob": lp.logprob, "top_logprobs": top})
    return {"content": content}


def _prompt_tokens(subs: list[_Sub]) -> int:
    """Prompt tokens of a call: the n choices of one prompt share (and count) it once."""
    return sum(len(p) for p in {id(s.prompt): s.prompt for s in subs}.values())


def _completion_logprobs(state: ServerState, tokens: list[int], lps: list) -> dict:
    decode = state.tokenizer.decode
    pieces = [decode([t]) for t in tokens]
    offsets, pos = [], 0
    for piece in pieces:
        offsets.append(pos)
        pos += len(piece)
    return {
        "tokens": pieces,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{decode([t]): v for t, v in (lp.top_logprobs or {}).items()} for lp in lps],
        "text_offset": offsets,
    }


# --- streaming ---------------------------------------------------------------------------------------
def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
        except Exception as exc:  # after headers went out, an error must end the stream visibly
            log.exception("stream failed")
            yield f"data: {json.dumps(error_body(str(exc), 'internal_error', 500))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _stream_completion(state, subs, streams, cid, created, include_usage) -> AsyncIterator[dict]:
    completion = 0
    async for sub, event in _events(subs, streams, state):
        if event.finished:
            completion += event.num_output_tokens
        if not event.new_text and not event.finished:
            continue
        choice = {
            "index": sub.index,
            "text": event.new_text,
            "logprobs": None,
            "finish_reason": _api_finish(event.finish_reason) if event.finished else None,
        }
        yield {"id": cid, "object": "text_completion", "created": created, "model": state.model_name,
               "choices": [choice]}  # fmt: skip
    if include_usage:
        yield _usage_chunk(state, subs, cid, created, "text_completion", completion)


async def _stream_chat(state, subs, streams, cid, created, include_usage) -> AsyncIterator[dict]:
    completion = 0
    for sub in subs:
        yield _chat_chunk(state, cid, created, sub.index, {"role": "assistant", "content": ""}, None)
    async for sub, event in _events(subs, streams, state):
        if event.finished:
            completion += event.num_output_tokens
        if not event.new_text and not event.finished:
            continue
        delta = {"content": event.new_text} if event.new_text else {}
        finish = _api_finish(event.finish_reason) if event.finished else None
        yield _chat_chunk(state, cid, created, sub.index, delta, finish)
    if include_usage:
        yield _usage_chunk(state, subs, cid, created, "chat.completion.chunk", completion)


def _chat_chunk(state, cid, created, index, delta, finish) -> dict:
    return {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": state.model_name,
        "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


def _usage_chunk(state, subs, cid, created, obj, completion) -> dict:
    prompt = _prompt_tokens(subs)
    return {
        "id": cid,
        "object": obj,
        "created": created,
        "model": state.model_name,
        "choices": [],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    }
