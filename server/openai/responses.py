"""OpenAI's Responses API (``POST /v1/responses``) as a translation over chat completions, as
vLLM serves it for models without a harmony format: the request becomes a streamed chat request
(``instructions`` and the input items become messages, ``text.format`` the ``response_format``,
function tools chat tools), and response_events.py makes the chat's chunks the Responses stream's
typed events, or, not streamed, the Response they end with, so that both always agree. The
colocated server and the router share both.

Nothing is stored, as in vLLM without its response store: ``store`` comes back false, and what
needs a stored response or a hosted service (``previous_response_id``, ``background``,
``conversation``, stored prompts, hosted tools, image or file input) is a 400 that says so.
vLLM's extras to a chat request (``seed``, ``top_k``, ``structured_outputs``, ``priority``...) pass
through.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeGuard

from pydantic import ConfigDict, Field, ValidationError, model_validator

from llmfleet.server.http.errors import APIError, invalid_request
from llmfleet.server.openai.protocol import ChatCompletionRequest, ErrorResponse, TextRequest

# The chat fields a Responses request sets in its own terms, or that have no place in one
# response; the other chat fields (vLLM's sampling and structured-output extras, chat template
# settings) pass through as given.
OWNED = {
    "messages",
    "model",
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "user",
    "n",
    "best_of",
    "echo",
    "prompt_logprobs",
    "return_token_ids",
    "kv_transfer_params",
}
PASSED_THROUGH = frozenset(ChatCompletionRequest.model_fields) - OWNED
TEXT_PARTS = ("input_text", "output_text", "text")
TOOL_CHOICES = ("none", "auto", "required")
NULL_IS_DEFAULT = {"stream", "tools", "tool_choice", "parallel_tool_calls", "truncation", "store", "background"}
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# OpenAI's include values; those that need a hosted tool or an encrypted reasoning item ask for
# what this server never makes, so they change nothing
INCLUDABLE = {
    LOGPROBS_INCLUDE,
    "reasoning.encrypted_content",
    "code_interpreter_call.outputs",
    "file_search_call.results",
    "computer_call_output.output.image_url",
    "message.input_image.image_url",
    "web_search_call.action.sources",
    "web_search_call.results",
}
# A chat error's field, named as the Responses request names it
CHAT_PARAMS = {
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "prompt": "input",
    "messages": "input",
    "response_format": "text",
}


class ResponsesRequest(TextRequest):
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
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)  # OpenAI's bounds
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """An explicit null (what the SDK sends for None) means the field's default, as OpenAI reads it."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None or key not in NULL_IS_DEFAULT}
        return data

    @classmethod
    def parsed(cls, body: dict) -> ResponsesRequest:
        """A body the router read itself: a 400 naming the field, as FastAPI's validation gives."""
        try:
            return cls.model_validate(body)
        except ValidationError as exc:
            raise invalid_request(exc) from exc

    def chat_request(self) -> dict[str, Any]:
        """The streamed chat completions body whose chunks answer this request."""
        self._refuse_what_is_not_served()
        chat: dict[str, Any] = {key: value for key, value in (self.model_extra or {}).items() if key in PASSED_THROUGH}
        messages = self._messages()
        chat |= {"messages": messages, "stream": True, "stream_options": {"include_usage": True}}
        optional = {
            "model": self.model,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_completion_tokens": self.max_output_tokens,
            "user": self.user,
        }
        chat |= {key: value for key, value in optional.items() if value is not None}
        if self._continues(messages):  # vLLM's: an unfinished last answer goes on
            chat |= {"add_generation_prompt": False, "continue_final_message": True}
        if self.top_logprobs is not None or LOGPROBS_INCLUDE in (self.include or []):
            chat |= {"logprobs": True, "top_logprobs": self.top_logprobs or 0}
        if (response_format := self._response_format()) is not None:
            chat["response_format"] = response_format
        if (effort := (self.reasoning or {}).get("effort")) is not None:
            if effort not in EFFORTS:
                raise APIError(400, f"reasoning.effort must be one of {', '.join(EFFORTS)}", param="reasoning")
            kwargs = chat.get("chat_template_kwargs")
            if kwargs is None or isinstance(kwargs, dict):  # else the chat request's 400 names it
                chat["chat_template_kwargs"] = {"reasoning_effort": effort} | (kwargs or {})
        chat |= self._tool_fields()
        return chat

    def _refuse_what_is_not_served(self) -> None:
        stored = (
            ("previous_response_id", self.previous_response_id),
            ("conversation", self.conversation),
            ("prompt", self.prompt),
        )
        for field, value in stored:
            if value is not None:
                raise APIError(
                    400,
                    f"{field} needs stored state, which this server does not keep: send the "
                    "whole conversation as input",
                    param=field,
                )
        if self.background:
            raise APIError(
                400, "background responses need the response store, which this server does not keep", param="background"
            )
        if self.truncation == "auto":
            raise APIError(
                400,
                "truncation 'auto' is not supported: an input past the context is refused ('disabled')",
                param="truncation",
            )
        unknown = sorted(set(self.include or []) - INCLUDABLE)
        if unknown:
            raise APIError(400, f"include: unknown value(s) {', '.join(map(repr, unknown))}", param="include")
        for key, value in (self.metadata or {}).items():
            if len(key) > 64 or len(value) > 512:
                raise APIError(400, "metadata keys are at most 64 characters and values at most 512", param="metadata")

    def _messages(self) -> list[dict[str, Any]]:
        """Chat messages, as vLLM builds them: an answer's reasoning, text and calls, given back as
        items, are one assistant message, as the chat that made them had it."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        answer: dict[str, Any] | None = None  # the assistant message output items go on filling
        for i, item in enumerate(self.input):
            where = f"input[{i}]"
            kind = item.get("type", "message")
            if kind == "message" and item.get("role") == "assistant":
                text = _text(item.get("content"), where)
                if _unwritten(answer):
                    answer["content"] = text
                else:
                    answer = {"role": "assistant", "content": text}
                    messages.append(answer)
            elif kind == "message":
                role = item.get("role")
                if role not in ("user", "system", "developer"):
                    raise APIError(
                        400, f"{where}: role must be user, system, developer or assistant, not {role!r}", param="input"
                    )
                messages.append({"role": role, "content": _text(item.get("content"), where)})
                answer = None
            elif kind == "function_call":
                call = {
                    "id": _field(item, "call_id", where),
                    "type": "function",
                    "function": {"name": _field(item, "name", where), "arguments": _field(item, "arguments", where)},
                }
                if answer is None:
                    answer = {"role": "assistant", "content": None}
                    messages.append(answer)
                answer.setdefault("tool_calls", []).append(call)
            elif kind == "function_call_output":
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": _field(item, "call_id", where),
                        "content": _text(item.get("output"), where, "output"),
                    }
                )
                answer = None
            elif kind == "reasoning":
                thinking = _reasoning_text(item, where)
                if _unwritten(answer):
                    answer["reasoning"] = answer.get("reasoning", "") + thinking
                else:
                    answer = {"role": "assistant", "content": None, "reasoning": thinking}
                    messages.append(answer)
            else:
                supported = "message, function_call, function_call_output and reasoning are"
                raise APIError(
                    400, f"{where}: input items of type {kind!r} are not supported ({supported})", param="input"
                )
        if not messages:
            raise APIError(400, "input holds no message", param="input")
        return messages

    def _continues(self, messages: list[dict[str, Any]]) -> bool:
        """Whether the input ends with an assistant message the model had not finished."""
        last = self.input[-1] if isinstance(self.input, list) else {}
        unfinished = last.get("type", "message") == "message" and last.get("status") in ("in_progress", "incomplete")
        return unfinished and last.get("role") == "assistant" and messages[-1].get("content") is not None

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
            if not isinstance(fmt.get("schema"), dict) or not isinstance(fmt.get("name"), str):
                raise APIError(
                    400, "text.format json_schema needs a name and its schema (a JSON Schema object)", param="text"
                )
            schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
            return {"type": "json_schema", "json_schema": schema}
        raise APIError(
            400, f"text.format type {kind!r} is not supported (text, json_object and json_schema are)", param="text"
        )

    def _tool_fields(self) -> dict[str, Any]:
        choice = self.tool_choice
        named = isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str)
        if not (named or choice in TOOL_CHOICES):
            raise APIError(
                400,
                "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                param="tool_choice",
            )
        if not self.tools:
            if choice not in ("none", "auto"):
                raise APIError(400, "tool_choice asks for a call, but no tools are given", param="tool_choice")
            return {}
        tools = []
        for i, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                raise APIError(
                    400,
                    f"tools[{i}]: only function tools are supported, not {tool.get('type')!r} (a hosted tool)",
                    param="tools",
                )
            wrong = ("name", str, "a string"), ("description", str, "a string"), ("parameters", dict, "an object")
            for key, kind, what in wrong:
                if (key == "name" or tool.get(key) is not None) and not isinstance(tool.get(key), kind):
                    raise APIError(400, f"tools[{i}]: a function tool's {key} must be {what}", param="tools")
            function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
            tools.append({"type": "function", "function": function})
        chat_choice = {"type": "function", "function": {"name": choice["name"]}} if named else choice
        return {"tools": tools, "tool_choice": chat_choice, "parallel_tool_calls": self.parallel_tool_calls}

    def echoed(self) -> dict[str, Any]:
        """The request's settings, as a Response object repeats them."""
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": self.reasoning,
            "store": False,
            "background": False,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_logprobs": self.top_logprobs,
            "text": self.text or {"format": {"type": "text"}},
            "tool_choice": self.tool_choice,
            "tools": self.tools,
            "truncation": self.truncation,
            "user": self.user,
        }


def _unwritten(answer: dict[str, Any] | None) -> TypeGuard[dict[str, Any]]:
    """An assistant message begun with thinking alone: the answer's text or thinking may join it."""
    return answer is not None and answer["content"] is None and not answer.get("tool_calls")


def _field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{where}: {key} must be a string", param="input")
    return value


def _text(content: Any, where: str, name: str = "content") -> str | list[dict[str, str]]:
    """A message's content (or a call's output) as chat takes it: a string, or its text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: {name} must be a string or a list of parts", param="input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind in TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise APIError(
                400,
                f"{where}.{name}[{j}]: only text parts are supported (input_text, output_text), "
                f"not {kind!r}: the model reads text alone",
                param="input",
            )
    return parts


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's thinking: its reasoning_text parts, else its summary's text."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise APIError(400, f"{where}: a reasoning item's content and summary are lists of text parts", param="input")
    return "".join(p["text"] for p in parts)


def in_responses_terms(error: APIError) -> APIError:
    """A chat request's error, naming the Responses request's field."""
    if error.param in CHAT_PARAMS:
        error.param = CHAT_PARAMS[error.param]
    return error


def error_body_in_responses_terms(content: bytes) -> bytes | None:
    """A relayed chat error body naming the Responses request's field; None when it is as it was."""
    try:
        body = json.loads(content)
        param = body["error"]["param"]
    except (ValueError, KeyError, TypeError):
        return None
    if param not in CHAT_PARAMS:
        return None
    body["error"]["param"] = CHAT_PARAMS[param]
    return json.dumps(body).encode()


def install_stored_routes(app: Any) -> None:
    """OpenAI's routes for stored responses (retrieve, delete, cancel, list input items): a 404
    that says why, where a bare one would leave a client guessing at a wrong id."""

    async def not_stored(response_id: str) -> None:
        raise APIError(
            404,
            f"response {response_id!r} is not stored: this server keeps no responses (store is not supported)",
            "not_found_error",
        )

    routes = (
        ("retrieve", "GET", ""),
        ("delete", "DELETE", ""),
        ("cancel", "POST", "/cancel"),
        ("input_items", "GET", "/input_items"),
    )
    for name, method, tail in routes:
        app.add_api_route(
            f"/v1/responses/{{response_id}}{tail}",
            not_stored,
            methods=[method],
            name=f"{name}_response",
            responses={404: {"model": ErrorResponse, "description": "No response is stored here"}},
        )
