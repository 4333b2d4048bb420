"""OpenAI's Responses API (``POST /v1/responses``) as a translation over chat completions, as
vLLM serves it for models without a harmony format: the request becomes a chat request
(``instructions`` and the input items become messages, ``text.format`` the ``response_format``,
function tools chat tools), and the chat answer, whole or streamed, becomes a Response object or
the Responses stream's typed events. The colocated server and the router share it.

Nothing is stored, as in vLLM without its response store: ``store`` comes back false, and what
needs a stored response or a hosted service (``previous_response_id``, ``background``,
``conversation``, stored prompts, hosted tools, image or file input) is a 400 that says so.
vLLM's extras to a chat request (``seed``, ``top_k``, ``structured_outputs``, ``priority``...) pass
through.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import APIError, invalid_request
from .protocol import ChatCompletionRequest

log = logging.getLogger(__name__)

# The chat fields a Responses request sets in its own terms, or that have no place in one
# response; the other chat fields (vLLM's sampling and structured-output extras, chat template
# settings) pass through as given.
OWNED = {
    "messages", "model", "temperature", "top_p", "max_tokens", "max_completion_tokens", "stream", "stream_options",
    "logprobs", "top_logprobs", "response_format", "tools", "tool_choice", "parallel_tool_calls", "user", "n",
    "best_of", "echo", "prompt_logprobs", "return_token_ids", "kv_transfer_params",
}  # fmt: skip
PASSED_THROUGH = frozenset(ChatCompletionRequest.model_fields) - OWNED
TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponsesRequest(BaseModel):
    """The OpenAI fields a text model can serve; other OpenAI fields are ignored, as vLLM does."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None

    @classmethod
    def parsed(cls, body: dict) -> ResponsesRequest:
        """A body the router read itself: a 400 naming the field, as FastAPI's validation gives."""
        try:
            return cls.model_validate(body)
        except ValidationError as exc:
            raise invalid_request(exc) from exc

    def chat_request(self) -> dict[str, Any]:
        """The chat completions body that answers this request (streamed with usage, if streamed)."""
        self._refuse_stored_state()
        chat: dict[str, Any] = {key: value for key, value in (self.model_extra or {}).items() if key in PASSED_THROUGH}
        chat |= {"messages": self._messages(), "stream": self.stream}
        optional = {"model": self.model, "temperature": self.temperature, "top_p": self.top_p,
                    "max_completion_tokens": self.max_output_tokens, "user": self.user}  # fmt: skip
        chat |= {key: value for key, value in optional.items() if value is not None}
        if self.stream:
            chat["stream_options"] = {"include_usage": True}
        if self.top_logprobs is not None or LOGPROBS_INCLUDE in (self.include or []):
            chat |= {"logprobs": True, "top_logprobs": self.top_logprobs or 0}
        if (response_format := self._response_format()) is not None:
            chat["response_format"] = response_format
        if self.tools:
            chat |= {"tools": self._tools(), "tool_choice": self._tool_choice(),
                     "parallel_tool_calls": self.parallel_tool_calls}  # fmt: skip
        return chat

    def _refuse_stored_state(self) -> None:
        stored = (("previous_response_id", self.previous_response_id), ("conversation", self.conversation),
                  ("prompt", self.prompt))  # fmt: skip
        for field, value in stored:
            if value is not None:
                raise APIError(400, f"{field} needs stored state, which this server does not keep: send the "
                                    "whole conversation as input", param=field)  # fmt: skip
        if self.background:
            raise APIError(400, "background responses need the response store, which this server does not keep",
                           param="background")  # fmt: skip
        if self.truncation == "auto":
            raise APIError(400, "truncation 'auto' is not supported: an input past the context is refused "
                                "('disabled')", param="truncation")  # fmt: skip

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            where = f"input[{i}]"
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "system", "developer", "assistant"):
                    raise APIError(400, f"{where}: role must be user, system, developer or assistant, not {role!r}",
                                   param="input")  # fmt: skip
                messages.append({"role": role, "content": _text(item.get("content"), where)})
            elif kind == "function_call":
                call = {"id": _field(item, "call_id", where), "type": "function",
                        "function": {"name": _field(item, "name", where),
                                     "arguments": _field(item, "arguments", where)}}  # fmt: skip
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                    last["tool_calls"].append(call)  # calls made together: one assistant turn
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                                 "content": _text(output, where)})  # fmt: skip
            elif kind == "reasoning":
                continue  # earlier thinking: chat templates leave it out of the prompt
            else:
                supported = "message, function_call, function_call_output and reasoning are"
                raise APIError(400, f"{where}: input items of type {kind!r} are not supported ({supported})",
                               param="input")  # fmt: skip
        if not messages:
            raise APIError(400, "input holds no message", param="input")
        return messages

    def _response_format(self) -> dict[str, Any] | None:
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise APIError(400, "text.format json_schema needs its schema (a JSON Schema object)", param="text")
            schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
            return {"type": "json_schema", "json_schema": schema}
        raise APIError(400, f"text.format type {kind!r} is not supported (text, json_object and "
                            "json_schema are)", param="text")  # fmt: skip

    def _tools(self) -> list[dict[str, Any]]:
        tools = []
        for i, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                raise APIError(400, f"tools[{i}]: only function tools are supported, not {tool.get('type')!r} "
                                    "(a hosted tool)", param="tools")  # fmt: skip
            if not isinstance(tool.get("name"), str):
                raise APIError(400, f"tools[{i}]: a function tool needs a name", param="tools")
            function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
            tools.append({"type": "function", "function": function})
        return tools

    def _tool_choice(self) -> str | dict[str, Any]:
        choice = self.tool_choice
        if isinstance(choice, str):
            return choice
        if choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                       param="tool_choice")  # fmt: skip

    def echoed(self) -> dict[str, Any]:
        """The request's settings, as a Response object repeats them."""
        return {
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {}, "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": None, "reasoning": self.reasoning, "store": False, "background": False,
            "temperature": self.temperature, "top_p": self.top_p, "top_logprobs": self.top_logprobs,
            "text": self.text or {"format": {"type": "text"}}, "tool_choice": self.tool_choice, "tools": self.tools,
            "truncation": self.truncation, "user": self.user,
        }  # fmt: skip


def _field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{where}: {key} must be a string", param="input")
    return value


def _text(content: Any, where: str) -> str | list[dict[str, str]]:
    """A message's content as chat takes it: a string, or its text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be a string or a list of parts", param="input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind in TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise APIError(400, f"{where}.content[{j}]: only text parts are supported (input_text, output_text), "
                                f"not {kind!r}: the model reads text alone", param="input")  # fmt: skip
    return parts


def response_id(chat_id: str) -> str:
    """The chat answer's id as a Response id: the same X-Request-Id or request_id after the prefix."""
    return "resp_" + chat_id.removeprefix("chatcmpl-")


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not usage:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}  # fmt: skip


def _status(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """A Response's status and incomplete_details from the chat's finish reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def _logprobs(chat_logprobs: dict[str, Any] | None) -> list[dict[str, Any]]:
    return list((chat_logprobs or {}).get("content") or [])


def response_object(
    request: ResponsesRequest, rid: str, created: float, model: str, status: str, output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None, incomplete: dict[str, str] | None = None, error: dict[str, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    return {"id": rid, "object": "response", "created_at": created, "model": model, "status": status,
            "completed_at": time.time() if status == "completed" else None, "output": output, "usage": usage,
            "incomplete_details": incomplete, "error": error, **request.echoed()}  # fmt: skip


def response_of(request: ResponsesRequest, chat: dict[str, Any]) -> dict[str, Any]:
    """A whole chat answer as a Response: reasoning, message and function-call items, in that order."""
    (choice,) = chat["choices"]
    message = choice["message"]
    status, incomplete = _status(choice.get("finish_reason"))
    output: list[dict[str, Any]] = []
    thinking = message.get("reasoning_content") or message.get("reasoning")
    if thinking:
        output.append({"type": "reasoning", "id": _item_id("rs"), "summary": [], "status": "completed",
                       "content": [{"type": "reasoning_text", "text": thinking}]})  # fmt: skip
    if message.get("content"):
        text = {"type": "output_text", "text": message["content"], "annotations": [],
                "logprobs": _logprobs(choice.get("logprobs"))}  # fmt: skip
        output.append({"type": "message", "id": _item_id("msg"), "role": "assistant", "status": status,
                       "content": [text]})  # fmt: skip
    for call in message.get("tool_calls") or []:
        output.append({"type": "function_call", "id": _item_id("fc"), "call_id": call["id"], "status": "completed",
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"]})  # fmt: skip
    return response_object(request, response_id(chat["id"]), chat["created"], chat["model"], status, output,
                           _usage(chat.get("usage")), incomplete)  # fmt: skip


class ResponseEvents:
    """A streamed chat answer (its chunks, in order) as the Responses stream's events: each output
    item is added, its text or arguments stream as deltas, and it is done before the next one
    starts; the last event holds the whole Response."""

    def __init__(self, request: ResponsesRequest) -> None:
        self.request = request
        self.sequence = 0
        self.rid, self.created, self.model = "resp_" + uuid.uuid4().hex, time.time(), request.model or ""
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.calls: dict[int, dict[str, Any]] = {}  # the chat's tool-call index -> its item
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.started = False
        self.ended = False  # failed: nothing follows

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
        """The stream's end: the open item is done, then response.completed (or .incomplete)."""
        status, incomplete = _status(self.finish_reason)
        events = self._close(status)
        final = self._response(status, _usage(self.usage), incomplete)
        return [*events, self._event(f"response.{status}", response=final)]

    def failed(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """A chat stream that broke off: an error event, then response.failed with what came."""
        events = [] if self.started else self._start({})
        message = str(error.get("message", "the stream failed"))
        events += self._close("incomplete")
        events.append(self._event("error", code=str(error.get("type") or "server_error"), message=message,
                                  param=error.get("param")))  # fmt: skip
        failed = self._response("failed", _usage(self.usage), error={"code": "server_error", "message": message})
        self.ended = True
        return [*events, self._event("response.failed", response=failed)]

    def _start(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        self.started = True
        if chunk.get("id"):
            self.rid = response_id(chunk["id"])
        self.created = chunk.get("created", self.created)
        self.model = chunk.get("model", self.model)
        return [self._event(f"response.{kind}", response=self._response("in_progress"))
                for kind in ("created", "in_progress")]  # fmt: skip

    def _response(self, status: str, usage=None, incomplete=None, error=None) -> dict[str, Any]:
        return response_object(self.request, self.rid, self.created, self.model, status, list(self.output), usage,
                               incomplete, error)  # fmt: skip

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
                item = {"type": "message", "id": _item_id("msg"), "role": "assistant", "status": "in_progress",
                        "content": []}  # fmt: skip
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            else:
                item = {"type": "reasoning", "id": _item_id("rs"), "summary": [], "status": "in_progress",
                        "content": []}  # fmt: skip
                part = {"type": "reasoning_text", "text": ""}
            events += self._open(item)
            assert self.open is not None
            self.open["part"] = part
            events.append(self._event("response.content_part.added", **self._where(), content_index=0, part=part))
        assert self.open is not None
        self.open["part"]["text"] += text
        if kind == "message":
            self.open["part"]["logprobs"].extend(logprobs)
            events.append(self._event("response.output_text.delta", **self._where(), content_index=0, delta=text,
                                      logprobs=list(logprobs)))  # fmt: skip
        else:
            events.append(self._event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text))
        return events

    def _call_delta(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        index = call.get("index", len(self.calls))
        function = call.get("function") or {}
        if index not in self.calls:
            events += self._close("completed")
            item = {"type": "function_call", "id": _item_id("fc"), "call_id": call.get("id") or _item_id("call"),
                    "name": function.get("name") or "", "arguments": "", "status": "in_progress"}  # fmt: skip
            events += self._open(item)
            self.calls[index] = item
        item = self.calls[index]
        if arguments := function.get("arguments"):
            item["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta", **self._where(), delta=arguments))
        return events

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.open = {"item": item, "index": len(self.output)}
        return [self._event("response.output_item.added", output_index=len(self.output), item=dict(item))]

    def _close(self, status: str) -> list[dict[str, Any]]:
        """The open item's done events; it joins the output."""
        if self.open is None:
            return []
        item, where = self.open["item"], self._where()
        events = []
        if item["type"] == "function_call":
            item["status"] = "completed"
            events.append(self._event("response.function_call_arguments.done", **where, arguments=item["arguments"]))
        else:
            part = self.open["part"]
            item["status"] = status if item["type"] == "message" else "completed"
            item["content"] = [part]
            if item["type"] == "message":
                events.append(self._event("response.output_text.done", **where, content_index=0, text=part["text"],
                                          logprobs=part["logprobs"]))  # fmt: skip
            else:
                events.append(self._event("response.reasoning_text.done", **where, content_index=0, text=part["text"]))
            events.append(self._event("response.content_part.done", **where, content_index=0, part=part))
        events.append(self._event("response.output_item.done", output_index=self.open["index"], item=item))
        self.output.append(item)
        self.open = None
        return events


async def response_stream(request: ResponsesRequest, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """The Responses events of a streamed chat answer, encoded; the chunks' iterator is always
    closed (a client gone mid-stream aborts the generation)."""
    events = ResponseEvents(request)
    try:
        async for chunk in chunks:
            for event in events.feed(chunk):
                yield encode_response_event(event)
            if events.ended:
                return
        ending = events.finished()
    except Exception as exc:  # after the headers went out, a failure must end the stream visibly
        log.exception("responses stream failed")
        ending = events.failed({"message": f"stream failed: {exc}"})
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
    for event in ending:
        yield encode_response_event(event)


def encode_response_event(event: dict[str, Any]) -> str:
    """As OpenAI streams them: the event's type on an ``event:`` line, its JSON on ``data:``."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def chat_chunks(relayed: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
    """A relayed chat completions event stream's chunks, up to ``[DONE]``; the relay is always closed."""
    buffer = b""
    try:
        async for raw in relayed:
            buffer += raw
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                data = b"\n".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
                if not data:
                    continue
                if data == b"[DONE]":
                    return
                yield json.loads(data)
    finally:
        await relayed.aclose()  # type: ignore[attr-defined]
