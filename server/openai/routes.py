"""The OpenAI endpoints served from a local engine (roles colocated, and the base of prefill and
decode): ``/v1/completions``, ``/v1/chat/completions`` (plain and SSE), ``/v1/responses`` (as a chat
completion, responses.py), ``/tokenize`` and ``/detokenize``."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from fastapi import FastAPI, Request, Response
from pydantic import ValidationError

from llmfleet.server.core.request import SampledToken
from llmfleet.server.core.validation import (
    InvalidRequestError,
    check_prompt_chars,
    check_token_ids,
    truncation_chars,
    truncation_length,
)
from llmfleet.server.http.body_guard import done_with_body
from llmfleet.server.http.errors import APIError, invalid_request
from llmfleet.server.http.sse import SSE_HEADERS, ClosingStreamingResponse, EventStreamResponse
from llmfleet.server.http.state import ServerState, check_model, check_serving
from llmfleet.server.openai import kv_transfer
from llmfleet.server.openai.prompt_work import off_loop
from llmfleet.server.openai.protocol import (
    ERROR_RESPONSES,
    GENERATION_RESPONSES,
    TOKENIZE_RESPONSES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from llmfleet.server.openai.response_events import ResponseStream, whole_response
from llmfleet.server.openai.responses import ResponsesRequest, in_responses_terms
from llmfleet.server.openai.submission import (
    EventStream,
    Result,
    Submission,
    SubRequest,
    api_finish_reason,
    build_subrequests,
    collect,
    request_error,
    submit,
    truncated_prompt,
)
from llmfleet.server.openai.tool_calls import AutoToolCalls, ForcedToolCalls
from llmfleet.server.parsers.reasoning import Reasoning
from llmfleet.server.wire.client_gone import CLIENT_GONE, unless_client_gone

TokenNames = Callable[[int], str]  # a token id -> how logprobs show it


def install(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, raw: Request):
        arrival = state.engine.now()
        check_serving(state, body.model)
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens 0 returns the prompt alone: it needs echo", param="max_tokens")
        chars = _prompt_size(body.prompt)
        prompts, prompt_texts = await off_loop(state, chars, _completion_prompts, state, body)  # seconds for a long one
        done_with_body(raw)
        # As vLLM (and lm-evaluation-harness's loglikelihood): echo with logprobs scores the prompt too
        scored = _most(body.prompt_logprobs, body.logprobs if body.echo else None)
        generate = max(body.max_tokens, 1)  # 0: one token, not shown
        if _remote_decode(state, body, raw):
            await build_subrequests(state, prompts, body, generate, body.logprobs)  # refuse what decode would
            return await _prefill_unless_gone(raw, state, prompts, body.priority, arrival)
        imports = await _received_kv(state, body, prompts, scored)
        subs = await build_subrequests(state, prompts, body, generate, body.logprobs, imports, prompt_logprobs=scored)
        submission = await submit(state, subs, body.priority, arrival)
        reply = _Reply(
            state, submission, _answer_id(raw, body, "cmpl"), want_logprobs=body.logprobs is not None, body=body
        )
        echo = {s.index: prompt_texts[s.index // body.n] for s in subs} if body.echo else {}
        echo_only = body.max_tokens == 0
        if body.stream:
            echo_logprobs = body.logprobs if body.echo else None  # (prompt_logprobs do not stream)
            return EventStreamResponse(reply.stream_completion(echo, echo_logprobs, echo_only))
        results = await collect_unless_gone(raw, state, submission)
        if results is None:
            return Response(status_code=CLIENT_GONE)
        if echo_only:
            results = {
                i: replace(r, text="", finish_reason="length", token_ids=[], logprobs=[], num_output_tokens=0)
                for i, r in results.items()
            }
        choices = []
        for sub in subs:
            result = results[sub.index]
            text = echo.get(sub.index, "")
            choice = {
                "index": sub.index,
                "text": text + result.text,
                "logprobs": None,
                "finish_reason": result.finish_reason,
                "stop_reason": result.stop_reason,
            }
            if result.error is not None:
                choice["error"] = request_error(result.error)["error"]
            if body.logprobs is not None:
                generated = completion_logprobs(reply.names, result.token_ids, result.logprobs, len(text))
                if body.echo:
                    echoed = prompt_logprobs_of(reply.names, sub, result.prompt_logprobs or [], body.logprobs)
                    generated = _joined(echoed, generated)
                choice["logprobs"] = generated
            if body.prompt_logprobs is not None:
                scores = result.prompt_logprobs or []
                choice["prompt_logprobs"] = vllm_prompt_logprobs(reply.names, scores, body.prompt_logprobs)
            if body.return_token_ids:  # vLLM's, for clients that must not re-tokenize (RL, agents)
                choice |= {"prompt_token_ids": sub.prompt, "token_ids": result.token_ids}
            choices.append(choice)
        return reply.envelope("text_completion", choices, usage=reply.usage(results))

    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat(body: ChatCompletionRequest, raw: Request):
        answer = await chat_answer(body, raw)
        return EventStreamResponse(answer) if isinstance(answer, AsyncIterator) else answer

    @app.post("/v1/responses", responses=GENERATION_RESPONSES)
    async def responses(body: ResponsesRequest, raw: Request):
        """OpenAI's Responses API, answered from a streamed chat completion (responses.py)."""
        check_serving(state, body.model)
        try:
            chat_body = ChatCompletionRequest.model_validate(body.chat_request())
            chunks = await chat_answer(chat_body, raw)
        except ValidationError as exc:
            raise in_responses_terms(invalid_request(exc)) from exc
        except APIError as exc:
            raise in_responses_terms(exc) from exc
        except InvalidRequestError as exc:
            raise in_responses_terms(APIError.invalid(exc)) from exc
        assert isinstance(chunks, AsyncIterator)  # a streamed chat, with no transfer asked
        if body.stream:
            return ClosingStreamingResponse(
                ResponseStream(body, chunks), media_type="text/event-stream", headers=SSE_HEADERS
            )
        answer = await unless_client_gone(raw, whole_response(body, chunks))
        return Response(status_code=CLIENT_GONE) if answer is None else answer

    async def chat_answer(body: ChatCompletionRequest, raw: Request) -> dict | Response | AsyncIterator[dict]:
        """A chat completion: the answer, its chunks when streamed, or a response for the router."""
        arrival = state.engine.now()
        check_serving(state, body.model)
        tool_calls = body.tool_call_replies(state.tool_call_parser)  # refused: a 400 naming the field
        if isinstance(tool_calls, AutoToolCalls) and tool_calls.parser.keeps_special_tokens:
            body = body.model_copy(update={"skip_special_tokens": False})  # its tags are special tokens
        # templating and tokenizing a long conversation take seconds: not on the event loop
        chars = sum(_prompt_size(m.content) for m in body.messages)
        prompt_text = await off_loop(state, chars, chat_prompt_text, state, body)
        prompt = await off_loop(state, len(prompt_text), encoded, state, prompt_text, body.special_tokens(), body)
        done_with_body(raw)
        prompt = truncated_prompt(state, body, prompt)
        reasoning = Reasoning.of(state.reasoning_parser, prompt_text, body.include_reasoning)
        # vLLM's default: a grammar holds the answer, after the thinking
        thinking = reasoning.thinking_mode if reasoning and not state.structured_outputs_in_reasoning else None
        max_tokens = body.max_completion_tokens or body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        if _remote_decode(state, body, raw):
            # refuse what the decode server would
            await build_subrequests(state, [prompt], body, max_tokens, logprobs, thinking=thinking)
            return await _prefill_unless_gone(raw, state, [prompt], body.priority, arrival)
        scored = body.prompt_logprobs
        imports = await _received_kv(state, body, [prompt], scored)
        subs = await build_subrequests(state, [prompt], body, max_tokens, logprobs, imports, scored, thinking)
        submission = await submit(state, subs, body.priority, arrival)
        reply = _Reply(state, submission, _answer_id(raw, body, "chatcmpl"), want_logprobs=body.logprobs, body=body)
        if body.stream:
            return reply.stream_chat(body.response_role(), body.echoed(), tool_calls, reasoning)
        results = await collect_unless_gone(raw, state, submission)
        if results is None:
            return Response(status_code=CLIENT_GONE)
        choices, thoughts = [], []
        for sub in subs:
            result = results[sub.index]
            thinking, answer = reasoning.split(result.text) if reasoning else (None, result.text)
            thoughts.append(thinking or "")
            message, finish = {"role": body.response_role(), "content": answer}, result.finish_reason
            if tool_calls is not None:
                message, finish = tool_calls.message(answer or "", finish)
            if reasoning:
                message |= reasoning.fields(thinking)
            if body.echoed():  # streamed, the echo is the first chunk's content whatever follows
                message["content"] = body.echoed() + (message["content"] or "")
            logprobs = chat_logprobs(reply.names, result) if body.logprobs else None
            choices.append(
                {
                    "index": sub.index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                    "stop_reason": result.stop_reason,
                }
            )
            if result.error is not None:
                choices[-1]["error"] = request_error(result.error)["error"]
            if body.return_token_ids:
                choices[-1]["token_ids"] = result.token_ids
        extra = {"prompt_token_ids": subs[0].prompt} if body.return_token_ids else {}
        if scored is not None:  # vLLM puts them beside the choices: the n choices share one prompt
            scores = results[subs[0].index].prompt_logprobs or []
            extra["prompt_logprobs"] = vllm_prompt_logprobs(reply.names, scores, scored)
        usage = reply.usage(results) | (await reply.reasoning_usage(thoughts) if reasoning else {})
        return reply.envelope("chat.completion", choices, usage=usage, **extra)

    @app.post("/tokenize", responses=TOKENIZE_RESPONSES, operation_id="tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(state, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if body.prompt is not None:
            ids = await off_loop(state, len(body.prompt), encoded, state, body.prompt, body.special_tokens())
        else:
            chars = sum(_prompt_size(m.content) for m in body.messages)
            ids = await off_loop(state, chars, chat_prompt, state, body)
        strs = _token_strs(state.tokenizer, ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize", responses=ERROR_RESPONSES, operation_id="detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(state, body.model)
        check_token_ids(body.tokens, len(state.tokenizer), "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}


def _prompt_size(prompt) -> int:
    """A prompt's size as the work it makes: characters of text, one per token id."""
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        if not prompt or type(prompt[0]) is int:  # token ids (the model checked they all are)
            return len(prompt)
        return sum(_prompt_size(item) for item in prompt)
    if isinstance(prompt, dict):
        return len(str(prompt.get("text", "")))
    return 0


def _token_strs(tokenizer, ids: list[int]) -> list[str]:
    """vLLM's ``token_strs``: the tokenizer's own token strings ("Ġworld", "▁Hello"), not their text."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    if convert is None:
        return [tokenizer.decode([token]) for token in ids]
    return list(convert(ids))


async def collect_unless_gone(raw: Request, state: ServerState, submission: Submission) -> dict[int, Result] | None:
    """``collect``, unless the client disconnects first: then its requests are aborted (freeing
    their KV) and None is returned. A non-streaming client has nothing else that notices."""
    return await unless_client_gone(raw, collect(state, submission))


async def _prefill_unless_gone(raw: Request, state: ServerState, prompts, priority: int, arrival: float):
    """A prefill server's answer to the router; a router that gave up (its timeout) gets nothing
    held for it: the prefill is aborted."""
    reply = await unless_client_gone(raw, kv_transfer.prefill_for_remote_decode(state, prompts, priority, arrival))
    return Response(status_code=CLIENT_GONE) if reply is None else reply


def _answer_id(raw: Request, body, prefix: str) -> str:
    """vLLM's: ``<prefix>-<X-Request-Id header>``, else the body's ``request_id``, else a random one
    (the engine's own request ids stay unique whatever a client sends)."""
    return f"{prefix}-{raw.headers.get('X-Request-Id') or body.request_id or uuid.uuid4().hex}"


def _remote_decode(state: ServerState, body, raw: Request) -> bool:
    """Whether a prefill server is asked to hold the prompts' KV for a decode server; a request
    that asks either side of a transfer must carry the fleet's transfer token."""
    params = body.kv_transfer_params
    if params is None or not (params.do_remote_decode or params.do_remote_prefill):
        return False
    kv_transfer.require_kv_token(state, raw)
    if params.do_remote_decode and params.do_remote_prefill:
        raise APIError(400, "do_remote_decode and do_remote_prefill exclude each other", param="kv_transfer_params")
    return params.do_remote_decode


async def _received_kv(state: ServerState, body, prompts: list[list[int]], scored: int | None):
    """KV a prefill server computed for the prompts, or None: computed here, as on a colocated
    server, whatever the role; always so for a scored prompt, whose logprobs come from its logits."""
    params = body.kv_transfer_params
    if params is None or not params.do_remote_prefill or scored is not None:
        return None
    return await kv_transfer.receive(state, params, prompts, body.cache_salt)


# --- prompts -------------------------------------------------------------------------------------
def _completion_prompts(state: ServerState, body: CompletionRequest) -> tuple[list[list[int]], list[str]]:
    """Token ids per prompt (and the prompt texts, for echo)."""
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):  # the model checked the rest
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    ids_list, texts = [], []
    for item in prompt:
        if isinstance(item, str):
            ids = encoded(state, item, body.add_special_tokens, body)
        else:
            ids = item
        given = len(ids)
        ids = list(truncated_prompt(state, body, ids))  # first: the ids it drops need no copy nor check
        check_token_ids(ids, len(state.tokenizer), "prompt", "prompt token ids")
        ids_list.append(ids)
        if body.echo:  # what the model was given: a truncated prompt echoes its kept tokens
            texts.append(item if isinstance(item, str) and len(ids) == given else state.tokenizer.decode(ids))
    return ids_list, texts


def _check_prompt_chars(state: ServerState, chars: int, body: object, param: str = "prompt") -> None:
    """Text too long for the context, refused before it is tokenized; not with
    ``truncate_prompt_tokens``: a long document cut to its last tokens is what a client asks for
    then (as vLLM takes it), and only its tail is tokenized (``encoded``)."""
    if _kept_tokens(state, body) is None:
        check_prompt_chars(chars, state.max_model_len, param)


def _kept_tokens(state: ServerState, body: object) -> int | None:
    return truncation_length(getattr(body, "truncate_prompt_tokens", None), state.max_model_len)


def encoded(state: ServerState, text: str, add_special_tokens: bool, body: object = None) -> list[int]:
    """A prompt's token ids (slow for a long text: call it off the event loop). Text too long for
    the context is refused; with ``truncate_prompt_tokens`` only the tail that can hold the kept
    tokens is tokenized (truncation_chars), so no text costs more than the context's worth."""
    keep = _kept_tokens(state, body)
    if keep is None:
        check_prompt_chars(len(text), state.max_model_len)
    elif len(text) > truncation_chars(keep):
        text = text[-truncation_chars(keep) :]
    return state.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def chat_prompt(state: ServerState, body: ChatCompletionRequest | TokenizeRequest) -> list[int]:
    return encoded(state, chat_prompt_text(state, body), body.special_tokens(), body)


def chat_prompt_text(state: ServerState, body: ChatCompletionRequest | TokenizeRequest) -> str:
    conversation = [m.for_template() for m in body.messages or []]
    # the messages' text alone too long: refused before the template renders it all
    _check_prompt_chars(state, sum(len(m["content"]) for m in conversation), body, "messages")
    try:
        return state.tokenizer.apply_chat_template(conversation, tokenize=False, **body.template_arguments())
    except Exception as exc:  # a template that rejects the conversation is the client's error
        raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc


# --- responses -----------------------------------------------------------------------------------
class _Reply:
    """Formats one call's choices, chunks and usage."""

    def __init__(self, state: ServerState, submission: Submission, id_: str, want_logprobs: bool, body) -> None:
        self.state = state
        self.submission = submission
        self.id = id_
        self.created = int(time.time())
        self.want_logprobs = want_logprobs
        self.names = token_names(state, body)
        # vLLM's return_token_ids, streamed: each chunk carries the token ids that came since the
        # choice's last chunk (text held back holds its ids too); the prompt's go with the first
        self.return_token_ids = bool(body.return_token_ids)
        self._unsent: dict[int, list[int]] = {s.index: [] for s in submission.subs}
        self._prompt_sent: set[int] = set()  # choices (chat: the call) whose prompt ids went out
        options = body.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.continuous_usage = self.include_usage and options.continuous_usage_stats

    def envelope(self, obj: str, choices: list[dict], **extra) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.state.model_name,
            "choices": choices,
            **extra,
        }

    def chunk(self, obj: str, choice: dict, sub: SubRequest, completion: int = 0) -> dict:
        """One choice's chunk; with continuous usage stats, the usage of that choice so far (vLLM's)."""
        extra = self._token_ids(obj, choice, sub) if self.return_token_ids else {}
        if self.continuous_usage:
            extra["usage"] = _usage(len(sub.prompt), completion)
        return self.envelope(obj, [choice], **extra)

    def _token_ids(self, obj: str, choice: dict, sub: SubRequest) -> dict:
        """Adds the choice's new token ids to ``choice``, and the prompt's to the first chunk: on the
        choice for a completion, beside the choices for a chat (its n choices share the prompt)."""
        choice["token_ids"], self._unsent[sub.index] = self._unsent[sub.index], []
        key = sub.index if obj == "text_completion" else -1
        if key in self._prompt_sent:
            return {}
        self._prompt_sent.add(key)
        if obj == "text_completion":
            choice["prompt_token_ids"] = sub.prompt
            return {}
        return {"prompt_token_ids": sub.prompt}

    def usage(self, results: dict[int, Result] | None = None, completion: int | None = None) -> dict:
        if completion is None:
            completion = sum(r.num_output_tokens for r in results.values())
        return _usage(self.submission.prompt_tokens, completion)

    async def reasoning_usage(self, thoughts: list[str]) -> dict:
        """OpenAI's ``completion_tokens_details.reasoning_tokens``: the tokens of each choice's
        thinking, the text between its tags (what vLLM counts), tokenized again off the event loop."""
        encode = self.state.tokenizer.encode

        def count() -> int:
            return sum(len(encode(text, add_special_tokens=False)) for text in thoughts if text)

        return {"completion_tokens_details": {"reasoning_tokens": await asyncio.to_thread(count)}}

    async def stream_completion(
        self, echo: dict[int, str], echo_logprobs: int | None, echo_only: bool
    ) -> AsyncIterator[dict]:
        """``echo_logprobs``: the echoed prompt carries its logprobs (with this many top entries),
        so it goes out with the first token (when they are known) rather than at once;
        ``echo_only`` (max_tokens 0): the generated token is not shown."""
        scored = echo_logprobs is not None
        state, completion = self.state, 0
        offsets = {s.index: len(echo.get(s.index, "")) for s in self.submission.subs}
        events = EventStream(state, self.submission)
        try:  # from the first chunk on: a client that leaves at any point aborts the requests
            for sub in self.submission.subs:
                if sub.index in echo and not scored:
                    yield self.chunk("text_completion", _text_choice(sub.index, echo[sub.index], None, None), sub)
            async for owner, event in events:
                if scored and event.prompt_logprobs is not None:
                    logprobs = prompt_logprobs_of(self.names, owner, event.prompt_logprobs, echo_logprobs)
                    yield self.chunk(
                        "text_completion", _text_choice(owner.index, echo[owner.index], logprobs, None), owner
                    )
                if echo_only:
                    if event.finished:
                        yield self.chunk("text_completion", _text_choice(owner.index, "", None, "length"), owner)
                    continue
                self._hold_token_ids(owner, event)
                if event.finished:
                    completion += event.num_output_tokens
                if not self._worth_a_chunk(event):
                    continue
                logprobs = None
                if self.want_logprobs and event.logprobs:
                    at = offsets[owner.index]
                    logprobs = completion_logprobs(self.names, event.new_token_ids, event.logprobs, at)
                    # counted by the tokens' own text, as the whole answer counts them: a token
                    # whose text was held back (half a character) still takes its place
                    offsets[owner.index] = at + sum(map(len, logprobs["tokens"]))
                finish = api_finish_reason(event.finish_reason) if event.finished else None
                choice = _text_choice(owner.index, event.new_text, logprobs, finish, event.stop_reason)
                yield self.chunk("text_completion", choice, owner, event.num_output_tokens)
                if event.error is not None:
                    yield request_error(event.error, owner.index)
        finally:
            await events.aclose()
        if self.include_usage:
            yield self.envelope("text_completion", [], usage=self.usage(completion=completion))

    async def stream_chat(
        self,
        role: str = "assistant",
        echo: str = "",
        tool_calls: ForcedToolCalls | AutoToolCalls | None = None,
        reasoning: Reasoning | None = None,
    ) -> AsyncIterator[dict]:
        """``role``: the first chunk's, with the ``echo``; ``reasoning``: each choice's thinking goes
        apart (reasoning.py); ``tool_calls``: the rest of its text becomes content and tool-call
        deltas (tool_calls.py)."""
        state, completion = self.state, 0
        subs = self.submission.subs
        calls = {sub.index: tool_calls.stream() for sub in subs} if tool_calls is not None else {}
        splitters = {sub.index: reasoning.splitter() for sub in subs} if reasoning is not None else {}
        thoughts: dict[int, str] = {}  # each choice's thinking, as it came
        events = EventStream(state, self.submission)
        try:  # from the first chunk on: a client that leaves at any point aborts the requests
            for sub in self.submission.subs:
                yield self._chat_chunk(sub, {"role": role, "content": echo}, None, None)
            async for owner, event in events:
                self._hold_token_ids(owner, event)
                if event.finished:
                    completion += event.num_output_tokens
                if not self._worth_a_chunk(event):
                    continue
                text, thought = event.new_text, {}
                logprobs = None
                if self.want_logprobs and event.logprobs:
                    logprobs = {"content": _chat_token_logprobs(self.names, event.new_token_ids, event.logprobs)}
                finish = api_finish_reason(event.finish_reason) if event.finished else None
                if splitters:
                    thinking, text = splitters[owner.index].feed(text, final=event.finished)
                    if thinking:
                        thought = reasoning.fields(thinking)
                        thoughts[owner.index] = thoughts.get(owner.index, "") + thinking
                if calls:
                    deltas, finish = calls[owner.index].deltas(text, finish)
                else:
                    deltas = [{"content": text}] if text else []
                deltas = [thought | first for first in deltas[:1]] + deltas[1:] if deltas else [thought]
                if (calls or splitters) and not (deltas[0] or finish or logprobs):
                    continue  # held: a tag or a call not yet told apart
                for i, delta in enumerate(deltas):  # one chunk each: words and calls keep their order
                    last = i == len(deltas) - 1
                    yield self._chat_chunk(
                        owner,
                        delta,
                        logprobs if i == 0 else None,
                        finish if last else None,
                        event.num_output_tokens,
                        event.stop_reason if last else None,
                    )
                if event.error is not None:
                    yield request_error(event.error, owner.index)
        finally:
            await events.aclose()
        if self.include_usage:
            thinking_usage = await self.reasoning_usage(list(thoughts.values())) if reasoning else {}
            usage = self.usage(completion=completion) | thinking_usage
            yield self.envelope("chat.completion.chunk", [], usage=usage)

    def _hold_token_ids(self, owner: SubRequest, event) -> None:
        """With return_token_ids, an event's token ids wait for its choice's next chunk."""
        if self.return_token_ids:
            self._unsent[owner.index].extend(event.new_token_ids)

    def _worth_a_chunk(self, event) -> bool:
        # text held back (a partial UTF-8 sequence, a possible stop string) waits for the next token
        return bool(event.new_text or event.finished or (self.want_logprobs and event.logprobs))

    def _chat_chunk(
        self,
        sub: SubRequest,
        delta: dict,
        logprobs: dict | None,
        finish: str | None,
        completion: int = 0,
        stopped_by: str | int | None = None,
    ) -> dict:
        choice = {"index": sub.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:  # vLLM's: the last chunk of a choice carries its stop_reason
            choice["stop_reason"] = stopped_by
        return self.chunk("chat.completion.chunk", choice, sub, completion)


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _text_choice(
    index: int, text: str, logprobs: dict | None, finish: str | None, stopped_by: str | int | None = None
) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stopped_by}


def token_names(state: ServerState, body) -> TokenNames:
    """How logprobs name tokens: their text, or with vLLM's ``return_tokens_as_token_ids``
    ``token_id:<id>`` (for clients that must map them back to ids exactly)."""
    if getattr(body, "return_tokens_as_token_ids", False):
        return lambda token: f"token_id:{token}"
    decode = state.tokenizer.decode
    return lambda token: decode([token])


def completion_logprobs(
    name: TokenNames, tokens: list[int], lps: list[SampledToken | None], start: int = 0, top_n: int | None = None
) -> dict:
    """OpenAI's legacy logprobs of ``tokens``; a None entry (a prompt's first token) has none.
    Each position's top entries are its own token's and its ``top_n`` most likely (all it has where
    None), as vLLM's: up to N + 1, and the chosen token even with ``logprobs: 0``."""
    pieces = [name(t) for t in tokens]
    offsets, pos = [], start
    for piece in pieces:
        offsets.append(pos)
        pos += len(piece)
    return {
        "tokens": pieces,
        "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
        "top_logprobs": [
            None if lp is None else _top_entries(name, t, lp, top_n) for t, lp in zip(tokens, lps, strict=True)
        ],
        "text_offset": offsets,
    }


def _top_entries(name: TokenNames, token: int, lp: SampledToken, top_n: int | None) -> dict[str, float]:
    entries = {name(token): lp.logprob}
    for other, logprob in itertools.islice((lp.top_logprobs or {}).items(), top_n):
        entries.setdefault(name(other), logprob)
    return entries


def prompt_logprobs_of(name: TokenNames, sub: SubRequest, scores: list[SampledToken], top_n: int) -> dict:
    """The echoed prompt's logprobs, with the ``logprobs`` count's top entries (the prompt may have
    been scored with more, for ``prompt_logprobs``): its first token has none (nothing comes before it)."""
    return completion_logprobs(name, sub.prompt, [None, *scores], top_n=top_n)


def vllm_prompt_logprobs(name: TokenNames, scores: list[SampledToken], top_n: int) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (the first has none), its own entry and the
    top ``top_n``'s, each token id -> logprob, rank and decoded text."""
    out: list[dict | None] = [None]
    for score in scores:
        entry = {score.token_id: {"logprob": score.logprob, "rank": score.rank, "decoded_token": name(score.token_id)}}
        for rank, (token, logprob) in enumerate(itertools.islice((score.top_logprobs or {}).items(), top_n), 1):
            entry.setdefault(token, {"logprob": logprob, "rank": rank, "decoded_token": name(token)})
        out.append(entry)
    return out


def _most(*counts: int | None) -> int | None:
    known = [c for c in counts if c is not None]
    return max(known) if known else None


def _joined(first: dict, then: dict) -> dict:
    return {key: first[key] + then[key] for key in first}


def chat_logprobs(name: TokenNames, result: Result) -> dict:
    return {"content": _chat_token_logprobs(name, result.token_ids, result.logprobs)}


def _chat_token_logprobs(name: TokenNames, tokens: list[int], lps: list[SampledToken]) -> list[dict]:
    content = []
    for token, lp in zip(tokens, lps, strict=False):
        top = [_chat_entry(name(t), v) for t, v in (lp.top_logprobs or {}).items()]
        content.append(_chat_entry(name(token), lp.logprob) | {"top_logprobs": top})
    return content


def _chat_entry(text: str, logprob: float) -> dict:
    """One chat logprob entry, with OpenAI's (and vLLM's) ``bytes``: the token text's UTF-8."""
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", errors="replace"))}
