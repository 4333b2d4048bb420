"""From an API call to engine requests and back: one engine request per (prompt, choice), all
feeding one event queue; leaving the event stream early aborts whatever is unfinished."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field, replace

from llmfleet.server.core import grammar
from llmfleet.server.core.kv_wire import KVImport
from llmfleet.server.core.request import JSON_KINDS, SampledToken, SamplingParams, StructuredOutput
from llmfleet.server.core.validation import (
    InvalidRequestError,
    check_id_list,
    check_prompt_length,
    check_sequences,
    check_token_ids,
    truncation_length,
)
from llmfleet.server.engine.engine import QueueFullError, RequestOutput
from llmfleet.server.http.errors import APIError
from llmfleet.server.http.state import ServerState
from llmfleet.server.openai.prompt_work import heavy
from llmfleet.server.openai.protocol import _Sampling
from llmfleet.server.wire.errors import error_body


@dataclass
class SubRequest:
    """One engine request behind one API choice."""

    index: int  # the choice index: prompt_index * n + j
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    kv_import: KVImport | None = None  # KV of the first prompt tokens, from a prefill server


@dataclass
class Result:
    text: str
    finish_reason: str | None
    token_ids: list[int]
    logprobs: list[SampledToken]
    num_output_tokens: int
    prompt_logprobs: list[SampledToken] | None = None  # where asked: prompt tokens 1.. (see Request)
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it
    error: str | None = None  # why it ended on its own failure (finish_reason "abort"): request_error()


@dataclass
class Submission:
    subs: list[SubRequest]
    events: asyncio.Queue  # RequestOutput of every sub-request, as produced
    by_id: dict[str, SubRequest] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.by_id = {s.request_id: s for s in self.subs}

    @property
    def prompt_tokens(self) -> int:
        """The n choices of one prompt share it: count it once."""
        return sum(len(p) for p in {id(s.prompt): s.prompt for s in self.subs}.values())


async def build_subrequests(
    state: ServerState,
    prompts: list[list[int]],
    body: _Sampling,
    max_tokens: int | None,
    logprobs: int | None,
    imports: list[KVImport | None] | None = None,
    prompt_logprobs: int | None = None,
    thinking: str | None = None,
) -> list[SubRequest]:
    """One engine request per (prompt, choice); ``imports``: per prompt, KV received for it
    (the n choices of a prompt each write their own copy into their own blocks); ``thinking``:
    where a reasoning model's thinking runs free of the request's structured output (core/request.py)."""
    subs = []
    base = uuid.uuid4().hex
    limit_tokens = state.max_model_len
    if state.max_request_tokens is not None:
        limit_tokens = min(limit_tokens, state.max_request_tokens)
    if state.engine is not None:
        check_sequences(len(prompts) * body.n, state.engine.engine.config.max_queue_len)
    vocab_size = len(state.tokenizer)
    for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):  # none needs more ids than there are
        check_id_list(getattr(body, name) or [], vocab_size, name)
    logit_bias = body.logit_bias_ids()
    check_token_ids(logit_bias, vocab_size, "logit_bias", "logit_bias token ids")
    allowed = None
    if body.allowed_token_ids is not None:  # the sampler masks every other token of the logits
        check_token_ids(body.allowed_token_ids, vocab_size, "allowed_token_ids", "allowed_token_ids")
        allowed = frozenset(body.allowed_token_ids)
    structured = await _structured_output(state, body, thinking)
    defaults = state.sampling_defaults

    def given(value, key: str, neutral: float):  # the request's value, else the model's, else neutral
        return value if value is not None else defaults.get(key, neutral)

    for p_index, prompt in enumerate(prompts):
        if not prompt:
            raise APIError(400, "prompt must contain at least one token", param="prompt")
        check_prompt_length(state.max_model_len, len(prompt))
        # max_tokens past the context is cut to what is left of it, as vLLM cuts it (a client's
        # fixed max_tokens then works on any prompt); none: the rest of the context, as far as
        # the KV cache can hold it
        room = state.max_model_len - len(prompt)
        limit = min(max_tokens, room) if max_tokens is not None else max(1, limit_tokens - len(prompt))
        if max_tokens is None and "max_tokens" in defaults:  # the model's max_new_tokens, as vLLM takes it
            limit = max(1, min(limit, int(defaults["max_tokens"])))
        for j in range(body.n):
            try:
                sampling = SamplingParams(
                    max_tokens=limit,
                    temperature=given(body.temperature, "temperature", 1.0),
                    top_p=given(body.top_p, "top_p", 1.0),
                    top_k=max(0, int(given(body.top_k, "top_k", 0))),
                    seed=None if body.seed is None else body.seed + j,  # n choices differ, reproducibly
                    stop=body.stop_list(),
                    include_stop_str_in_output=body.include_stop_str_in_output,
                    skip_special_tokens=body.skip_special_tokens,
                    stop_token_ids=list(body.stop_token_ids or []),
                    ignore_eos=body.ignore_eos,
                    logprobs=logprobs,
                    prompt_logprobs=prompt_logprobs,
                    min_p=given(body.min_p, "min_p", 0.0),
                    min_tokens=body.min_tokens,
                    presence_penalty=body.presence_penalty or 0.0,
                    frequency_penalty=body.frequency_penalty or 0.0,
                    repetition_penalty=given(body.repetition_penalty, "repetition_penalty", 1.0),
                    logit_bias=logit_bias,
                    allowed_token_ids=allowed,
                    structured=structured,
                    cache_salt=body.cache_salt,
                )
            except InvalidRequestError as exc:
                raise APIError.invalid(exc) from exc
            index = p_index * body.n + j
            kv = imports[p_index] if imports is not None else None
            subs.append(SubRequest(index, f"{base}-{index}", prompt, sampling, kv))
    return subs


def truncated_prompt(state: ServerState, body: _Sampling, prompt: list[int]) -> list[int]:
    """``truncate_prompt_tokens`` as vLLM applies it: the prompt's last k tokens (-1: the context
    length); more than the context length is a 400."""
    keep = truncation_length(body.truncate_prompt_tokens, state.max_model_len)
    if keep is None:
        return prompt
    return prompt[-keep:] if keep else []


async def _structured_output(state: ServerState, body: _Sampling, thinking: str | None) -> StructuredOutput | None:
    """The request's structured output, its grammar checked here so that a 400 names the field."""
    asked = body.structured_output()  # a StructuredOutputError is that 400 already
    if asked is None:
        return None
    structured, field = asked
    structured = replace(structured, thinking=thinking)
    if state.structured_outputs_compact and structured.kind in JSON_KINDS and structured.whitespace_pattern is None:
        structured = replace(structured, whitespace_pattern="")  # the server's default; the request's pattern wins
    # compiling a large grammar takes a while: not on the event loop, which serves every request
    error = await asyncio.to_thread(grammar.check, structured)
    if error is not None:
        raise APIError(400, f"{field}: invalid {structured.kind} for structured output: {error}", param=field)
    if state.engine is not None:  # followed a step or two on the model's vocabulary: a limit shows there
        problem = await heavy(state, state.engine.engine.structured_problem, structured)
        if problem is not None:
            message = f"{field}: the {structured.kind} constraint cannot be followed: {problem}"
            raise APIError(400, message, param=field)
    return structured


async def submit(
    state: ServerState, subs: list[SubRequest], priority: int, arrival_time: float, export_kv: bool = False
) -> Submission:
    """Hand every sub-request to the engine, or none: a rejection aborts those already in.
    ``export_kv``: each one's final event carries its KV (a prefill server's work)."""
    events: asyncio.Queue = asyncio.Queue()
    added: list[SubRequest] = []
    engine = state.engine
    try:
        for sub in subs:
            # vLLM's API: lower priority values are served first; the engine serves larger first
            await engine.add(
                sub.request_id, sub.prompt, sub.sampling, -priority, arrival_time, events, sub.kv_import, export_kv
            )
            added.append(sub)
    except InvalidRequestError:
        _abort(state, added)
        raise
    except QueueFullError as exc:
        _abort(state, added)
        raise APIError(429, str(exc), "rate_limit_exceeded") from exc
    except RuntimeError as exc:  # the engine loop is gone
        _abort(state, added)
        raise APIError(503, str(exc), "unavailable") from exc
    except BaseException:
        _abort(state, added)
        raise
    return Submission(subs, events)


def _abort(state: ServerState, subs: list[SubRequest]) -> None:
    for sub in subs:
        state.engine.abort(sub.request_id)


class EventStream:
    """Events of all sub-requests as produced: ``async for owner, event in stream``. Closing it
    (``aclose``) aborts the unfinished ones, which frees their KV blocks before the engine's
    next step; a plain class rather than a generator, so that a stream closed before its first
    event (the client left during the opening chunks) aborts them too.

    A consumer that falls behind the engine (a slow client, a busy event loop) gets the events
    that piled up merged into one per request, as vLLM does: fewer, larger chunks instead of a
    backlog that grows with the engine's speed."""

    def __init__(self, state: ServerState, sub: Submission) -> None:
        self._state = state
        self._queue = sub.events
        self._unfinished = dict(sub.by_id)
        self._ready: deque[tuple[SubRequest, RequestOutput]] = deque()
        # per prompt (its n choices share one list), for vLLM's parallel-sampling histograms: its n,
        # how many are unfinished, and the most tokens one has generated
        self._n = Counter(id(s.prompt) for s in sub.subs)
        self._left = dict(self._n)
        self._most: dict[int, int] = {}

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> tuple[SubRequest, RequestOutput]:
        while not self._ready:
            if not self._unfinished:
                raise StopAsyncIteration
            pending = [await self._queue.get()]
            while not self._queue.empty():
                pending.append(self._queue.get_nowait())
            for event in merge_events(pending):
                owner = self._unfinished.get(event.request_id)
                if owner is None:
                    continue
                if event.finished:
                    del self._unfinished[event.request_id]
                    self._observe_finished(owner, event.num_output_tokens)
                self._ready.append((owner, event))
        return self._ready.popleft()

    def _observe_finished(self, owner: SubRequest, generated: int) -> None:
        key = id(owner.prompt)
        self._most[key] = max(self._most.get(key, 0), generated)
        self._left[key] -= 1
        if not self._left[key]:
            self._state.metrics.observe_parallel_sampling(self._n[key], self._most[key])

    async def aclose(self) -> None:
        _abort(self._state, list(self._unfinished.values()))
        self._unfinished.clear()


def merge_events(events: list[RequestOutput]) -> list[RequestOutput]:
    """One event per request, in first-seen order: tokens, text and logprobs concatenated; the
    state (finished, reason, counts, timings) of the latest."""
    merged: dict[str, RequestOutput] = {}
    for event in events:
        into = merged.get(event.request_id)
        if into is None:
            merged[event.request_id] = event
            continue
        logprobs = None
        if into.logprobs is not None or event.logprobs is not None:
            logprobs = (into.logprobs or []) + (event.logprobs or [])
        merged[event.request_id] = replace(
            event,
            new_token_ids=into.new_token_ids + event.new_token_ids,
            new_text=into.new_text + event.new_text,
            logprobs=logprobs,
            prompt_logprobs=into.prompt_logprobs if into.prompt_logprobs is not None else event.prompt_logprobs,
        )
    return list(merged.values())


async def collect(state: ServerState, sub: Submission) -> dict[int, Result]:
    """Wait for every sub-request's last event; returns choice index -> result."""
    text: dict[int, list[str]] = {s.index: [] for s in sub.subs}
    tokens: dict[int, list[int]] = {s.index: [] for s in sub.subs}
    lps: dict[int, list] = {s.index: [] for s in sub.subs}
    prompt_lps: dict[int, list[SampledToken]] = {}
    done: dict[int, tuple[str | None, int, str | int | None, str | None]] = {}
    events = EventStream(state, sub)
    try:
        async for owner, event in events:
            text[owner.index].append(event.new_text)
            tokens[owner.index].extend(event.new_token_ids)
            lps[owner.index].extend(event.logprobs or [])
            if event.prompt_logprobs is not None:
                prompt_lps[owner.index] = event.prompt_logprobs
            if event.finished:
                reason = api_finish_reason(event.finish_reason)
                done[owner.index] = (reason, event.num_output_tokens, event.stop_reason, event.error)
    finally:
        await events.aclose()
    return {
        i: Result("".join(text[i]), done[i][0], tokens[i], lps[i], done[i][1], prompt_lps.get(i), *done[i][2:])
        for i in text
    }


def api_finish_reason(reason: str | None) -> str | None:
    # "stop" | "length"; "abort" (as vLLM reports it) only when the engine failed under the
    # request, the request failed on its own (request_error) or a drain timed out: the text is
    # cut, and the client must be able to tell
    return reason


GENERATION_ERROR = "generation_error"


def request_error(message: str, index: int | None = None) -> dict:
    """What a client reads of a request that failed on its own mid-generation (no token could be
    sampled for it, its constraint could not go on): beside finish_reason "abort", the choice's
    ``error`` in a whole answer, or an error event after the choice's last chunk in a stream. Code
    400: only its own parameters fail it; other requests in its step go on."""
    body = error_body(f"the generation failed: {message}", GENERATION_ERROR, 400)
    if index is not None:
        body["error"]["choice_index"] = index
    return body
