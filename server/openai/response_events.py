"""A streamed chat answer's chunks as OpenAI's Responses stream: each output item (reasoning, a
message, a function call) is added, its text or arguments stream as deltas, and it is done before
the next one starts, in the order the model wrote them; the last event holds the whole Response.
Not streamed, the Response is that last event's, so the two never disagree (responses.py makes
the chat request)."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from llmfleet.server.http.errors import APIError
from llmfleet.server.openai.responses import ResponsesRequest
from llmfleet.server.parsers.tools import openai_call_id
from llmfleet.server.wire.sse import WholeEvents, encode_event, event_data

log = logging.getLogger(__name__)

ABORTED = "the generation was stopped before it finished (the server drained or its engine failed)"


def response_id(chat_id: str) -> str:
    """The chat answer's id as a Response id: the X-Request-Id or request_id it was made of."""
    name = chat_id.removeprefix("chatcmpl-")
    return name if name.startswith("resp_") else f"resp_{name}"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not usage:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    thinking = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": thinking},
        "total_tokens": usage["total_tokens"],
    }


def _logprobs(chat_logprobs: dict[str, Any] | None) -> list[dict[str, Any]]:
    return list((chat_logprobs or {}).get("content") or [])


class ResponseEvents:
    """Chat chunks in (``feed``, in order), Responses events out; ``finished`` or ``failed`` ends."""

    def __init__(self, request: ResponsesRequest) -> None:
        self.request = request
        self.sequence = 0
        self.rid, self.created, self.model = _item_id("resp"), time.time(), request.model or ""
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed, with its part
        self.calls: dict[int, dict[str, Any]] = {}  # the chat's tool-call index -> its item
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.started = False
        self.ended = False
        self.error: dict[str, Any] | None = None  # what broke the stream off

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if "error" in chunk:
            return self.failed(chunk["error"])
        events = [] if self.started else self._start(chunk)
        self.usage = chunk.get("usage") or self.usage
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if thinking := delta.get("reasoning_content") or delta.get("reasoning"):
                events += self._text("reasoning", thinking)
            if delta.get("content"):
                events += self._text("message", delta["content"], _logprobs(choice.get("logprobs")))
            for call in delta.get("tool_calls") or []:
                events += self._call_delta(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    def finished(self) -> list[dict[str, Any]]:
        """The chat stream's end: the open item is done, then response.completed, or .incomplete
        at max_output_tokens (the item it cut is incomplete too), or .failed if it was aborted."""
        if self.finish_reason == "abort":
            return self.failed({"message": ABORTED})
        if self.finish_reason is None:  # the chat stream stopped short of its answer's end
            return self.failed({"message": "the answer ended without finishing"})
        events = [] if self.started else self._start({})
        cut = self.finish_reason == "length"
        events += self._close("incomplete" if cut else "completed")
        status, incomplete = ("incomplete", {"reason": "max_output_tokens"}) if cut else ("completed", None)
        final = self._response(status, incomplete=incomplete)
        self.ended = True
        return [*events, self._event(f"response.{status}", response=final)]

    def failed(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """A chat stream that broke off: an error event, then response.failed with what came."""
        self.error = error
        events = [] if self.started else self._start({})
        message = str(error.get("message", "the stream failed"))
        events += self._close("incomplete")
        events.append(
            self._event(
                "error", code=str(error.get("type") or "server_error"), message=message, param=error.get("param")
            )
        )
        failed = self._response("failed", error={"code": "server_error", "message": message})
        self.ended = True
        return [*events, self._event("response.failed", response=failed)]

    def _start(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        self.started = True
        if chunk.get("id"):
            self.rid = response_id(chunk["id"])
        self.created = chunk.get("created", self.created)
        self.model = chunk.get("model", self.model)
        return [
            self._event(f"response.{kind}", response=self._response("in_progress"))
            for kind in ("created", "in_progress")
        ]

    def _response(self, status: str, incomplete=None, error=None) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": status,
            "completed_at": time.time() if status == "completed" else None,
            "output": [dict(item) for item in self.output],
            "usage": _usage(self.usage),
            "incomplete_details": incomplete,
            "error": error,
            **self.request.echoed(),
        }

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["item"]["id"], "output_index": self.open["index"]}

    def _text(self, kind: Literal["message", "reasoning"], text: str, logprobs=()) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open["item"]["type"] != kind:
            events += self._close("completed")
            if kind == "message":
                item = {
                    "type": "message",
                    "id": _item_id("msg"),
                    "role": "assistant",
                    "status": "in_progress",
                    "content": [],
                }
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            else:
                item = {
                    "type": "reasoning",
                    "id": _item_id("rs"),
                    "summary": [],
                    "status": "in_progress",
                    "content": [],
                }
                part = {"type": "reasoning_text", "text": ""}
            events += self._open(item, part)
            events.append(self._event("response.content_part.added", **self._where(), content_index=0, part=dict(part)))
        assert self.open is not None
        part = self.open["part"]
        part["text"] += text
        if kind == "message":
            part["logprobs"] = [*part["logprobs"], *logprobs]
            events.append(
                self._event(
                    "response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=list(logprobs)
                )
            )
        else:
            events.append(self._event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text))
        return events

    def _call_delta(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        index = call.get("index", len(self.calls))
        function = call.get("function") or {}
        if index not in self.calls:
            events += self._close("completed")
            item = {
                "type": "function_call",
                "id": _item_id("fc"),
                "call_id": call.get("id") or openai_call_id(),
                "name": function.get("name") or "",
                "arguments": "",
                "status": "in_progress",
            }
            events += self._open(item)
            self.calls[index] = item
        if arguments := function.get("arguments"):
            self.calls[index]["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta", **self._where(), delta=arguments))
        return events

    def _open(self, item: dict[str, Any], part: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        self.open = {"item": item, "index": len(self.output), "part": part}
        return [self._event("response.output_item.added", output_index=len(self.output), item=dict(item))]

    def _close(self, status: str) -> list[dict[str, Any]]:
        """The open item's done events, with ``status``; it joins the output."""
        if self.open is None:
            return []
        item, part, where = self.open["item"], self.open["part"], self._where()
        item["status"] = status
        events = []
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", **where, arguments=item["arguments"]))
        else:
            item["content"] = [part]
            if item["type"] == "message":
                events.append(
                    self._event(
                        "response.output_text.done",
                        **where,
                        content_index=0,
                        text=part["text"],
                        logprobs=part["logprobs"],
                    )
                )
            else:
                events.append(self._event("response.reasoning_text.done", **where, content_index=0, text=part["text"]))
            events.append(self._event("response.content_part.done", **where, content_index=0, part=dict(part)))
        events.append(self._event("response.output_item.done", output_index=self.open["index"], item=dict(item)))
        self.output.append(item)
        self.open = None
        return events


class ResponseStream:
    """The Responses events of a streamed chat answer, encoded for SSE. ``aclose`` closes the
    chunks' ``source`` (a relay, or the engine's stream, whose closing aborts the generation)
    whether or not iteration began: a client may leave before the first event."""

    def __init__(self, request: ResponsesRequest, chunks: AsyncIterator[dict], source: Any = None) -> None:
        self._chunks, self._source = chunks, source
        self._body = self._encoded(ResponseEvents(request))

    def __aiter__(self) -> ResponseStream:
        return self

    async def __anext__(self) -> str:
        return await self._body.__anext__()

    async def aclose(self) -> None:
        await self._body.aclose()
        await _close(self._chunks)
        await _close(self._source)

    async def _encoded(self, events: ResponseEvents) -> AsyncIterator[str]:
        try:
            async for chunk in self._chunks:
                for event in events.feed(chunk):
                    yield encode_response_event(event)
                if events.ended:
                    return
            ending = events.finished()
        except Exception as exc:  # after the headers went out, a failure must end the stream visibly
            log.exception("responses stream failed")
            ending = events.failed({"message": f"stream failed: {exc}"})
        for event in ending:
            yield encode_response_event(event)


async def whole_response(request: ResponsesRequest, chunks: AsyncIterator[dict], source: Any = None) -> dict:
    """The Response a streamed chat answer ends with (what a request without ``stream`` gets); an
    answer that broke off is an error, with the status its stream's error gave (else 500)."""
    events = ResponseEvents(request)
    last: list[dict[str, Any]] = []
    try:
        async for chunk in chunks:
            last = events.feed(chunk)
            if events.ended:
                break
        if not events.ended:
            last = events.finished()
    finally:
        await _close(chunks)
        await _close(source)
    final = last[-1]["response"]
    if final["status"] == "failed":
        error = events.error or {}
        code = error.get("code")
        status = code if isinstance(code, int) and 400 <= code < 600 else 500  # a request's own failure: its 400
        raise APIError(status, final["error"]["message"], str(error.get("type") or "internal_error"))
    return final


async def _close(iterator: Any) -> None:
    if iterator is not None and hasattr(iterator, "aclose"):
        await iterator.aclose()


def encode_response_event(event: dict[str, Any]) -> str:
    """As OpenAI streams them: the event's type on an ``event:`` line before its ``data:``."""
    return f"event: {event['type']}\n" + encode_event(event)


async def chat_chunks(relayed: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
    """A relayed chat completions event stream's chunks, up to ``[DONE]``."""
    events = WholeEvents()
    async for raw in relayed:
        for data in event_data(events.feed(raw)):
            if data == b"[DONE]":
                return
            yield json.loads(data)
