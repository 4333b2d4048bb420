"""Tool calls as vLLM serves them: forced by ``tool_choice``, or, with ``"auto"``, read back out
of the model's own text by the server's tool-call parser (parsers/tools.py).

A named function holds the reply to that function's parameter schema; ``"required"`` holds it to
a JSON array of one or more ``{"name", "parameters"}`` objects, one of the tools each (at most one
with ``parallel_tool_calls: false``). Both go through structured output (structured.py), and the
text becomes the message's ``tool_calls``: as vLLM does, a named call finishes with ``stop`` and
``"required"`` with ``tool_calls``. ``"auto"`` constrains nothing: the model writes words, calls in
its own format, or both, and a reply with calls finishes with ``tool_calls``. Without a parser
(``--enable-auto-tool-choice --tool-call-parser``) it is refused, as vLLM refuses it.

Streamed, a named call's arguments go out as they are generated; the calls of ``"required"`` go
out once their array is complete, and those of ``"auto"`` as each is read whole (each call in
one chunk).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmfleet.server.openai.structured import StructuredOutputError as ToolChoiceError
from llmfleet.server.parsers.tools import TOOL_CALL_PARSERS, ToolCallParser, openai_call_id


@dataclass(frozen=True)
class ForcedToolCalls:
    """What ``tool_choice`` forces: one named function, or (``name`` None) any of the tools."""

    name: str | None
    schema: dict[str, Any]
    call_id: Callable[[], str] = openai_call_id

    @classmethod
    def of(
        cls,
        tools: list[dict[str, Any]] | None,
        tool_choice: str | dict[str, Any] | None,
        parallel: bool | None,
        call_id: Callable[[], str] = openai_call_id,
    ) -> ForcedToolCalls | None:
        """None where nothing is forced (no tools, ``"none"`` or ``"auto"``). Raises ToolChoiceError."""
        choice = _choice(tools, tool_choice)
        if choice in ("none", "auto"):
            return None
        functions = _functions(tools)
        if choice == "required":
            array: dict[str, Any] = {"type": "array", "minItems": 1}
            calls = [
                {
                    "type": "object",
                    "properties": {"name": {"enum": [name]}, "parameters": _definitions_to(array, name, parameters)},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for name, parameters in functions.items()
            ]
            array["items"] = {"anyOf": calls}
            return cls(None, array | ({"maxItems": 1} if parallel is False else {}), call_id)
        name = _named(choice)
        if name not in functions:
            raise ToolChoiceError(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
        return cls(name, functions[name], call_id)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message for the generated ``text``, and the choice's finish reason. A
        text cut short (``length``) that does not parse is returned as content; none at all (a
        reasoning model cut short in its thinking) makes no call."""
        if not text:
            return {"role": "assistant", "content": None}, finish_reason
        if self.name is not None:
            return _with_calls([_call(self.name, text, self.call_id())]), finish_reason
        calls = self._parsed(text)
        if calls is None:
            return {"role": "assistant", "content": text}, finish_reason
        return _with_calls(calls), "tool_calls" if finish_reason == "stop" else finish_reason

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)

    def _parsed(self, text: str) -> list[dict[str, Any]] | None:
        try:
            return [
                _call(c["name"], json.dumps(c["parameters"], ensure_ascii=False), self.call_id())
                for c in json.loads(text)
            ]
        except (ValueError, KeyError, TypeError):  # cut short: not a whole array
            return None


@dataclass(frozen=True)
class AutoToolCalls:
    """``"auto"``: the calls the model writes in its own format, read by a parser."""

    parser: type[ToolCallParser]
    parallel: bool = True  # False: the first call only

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        deltas, finish = self.stream().deltas(text, finish_reason or "stop")
        content = "".join(d.get("content", "") for d in deltas)
        calls = [{k: v for k, v in c.items() if k != "index"} for d in deltas for c in d.get("tool_calls", [])]
        message = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = calls
        return message, finish

    def stream(self) -> AutoToolCallStream:
        return AutoToolCallStream(self)


def tool_call_replies(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel: bool | None,
    parser: str | None,
) -> ForcedToolCalls | AutoToolCalls | None:
    """How a chat reply's text becomes tool calls: forced, parsed (``"auto"``, with the server's
    ``parser``) or not at all (None). Raises ToolChoiceError."""
    call_id = TOOL_CALL_PARSERS[parser].call_id if parser is not None else openai_call_id
    if _choice(tools, tool_choice) != "auto":
        return ForcedToolCalls.of(tools, tool_choice, parallel, call_id)
    if not tools:
        raise ToolChoiceError("tool_choice 'auto' needs tools", "tools")
    if parser is None:
        raise ToolChoiceError(
            "tool_choice 'auto' needs a tool-call parser for the model: start the server with "
            "--enable-auto-tool-choice and --tool-call-parser (spec.model.toolCallParser in an InferenceService), "
            "or send 'required', a named function or 'none'",
            "tool_choice",
        )
    return AutoToolCalls(TOOL_CALL_PARSERS[parser], parallel is not False)


class AutoToolCallStream:
    """One streamed choice's deltas under ``"auto"``: words as content, each call once read whole."""

    def __init__(self, auto: AutoToolCalls) -> None:
        self._parser = auto.parser()
        self._call_id = auto.parser.call_id
        self._limit = None if auto.parallel else 1
        self._calls = 0

    def deltas(self, text: str, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The deltas newly generated ``text`` makes, in the order it was written (words and calls
        apart: a chunk that held both would lose which came first), and the finish reason."""
        deltas: list[dict[str, Any]] = []
        for part in self._parser.feed(text, final=finish_reason is not None):
            if isinstance(part, str):
                if deltas and "content" in deltas[-1]:
                    deltas[-1]["content"] += part
                else:
                    deltas.append({"content": part})
            elif self._limit is None or self._calls < self._limit:
                call = {"index": self._calls, **_call(part.name, part.arguments, self._call_id())}
                self._calls += 1
                if deltas and "tool_calls" in deltas[-1]:
                    deltas[-1]["tool_calls"].append(call)
                else:
                    deltas.append({"tool_calls": [call]})
        return deltas, "tool_calls" if finish_reason == "stop" and self._calls else finish_reason


class ToolCallStream:
    """One streamed choice's deltas: its text becomes tool-call deltas."""

    def __init__(self, forced: ForcedToolCalls) -> None:
        self.forced = forced
        self._text = ""  # "required": the array so far
        self._opened = False

    def deltas(self, text: str, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The deltas for newly generated ``text`` (none, or one), with the choice's finish reason
        once it ends: the same shape as AutoToolCallStream's."""
        delta, finish = self.delta(text, finish_reason)
        return ([delta] if delta else []), finish

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The delta for newly generated ``text`` (with the choice's finish reason once it ends)."""
        if self.forced.name is not None:
            if not text:
                return {}, finish_reason
            if self._opened:
                return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}, finish_reason
            self._opened = True
            call = _call(self.forced.name, text, self.forced.call_id())
            return {"tool_calls": [{"index": 0, **call}]}, finish_reason
        self._text += text
        if finish_reason is None:
            return {}, None
        message, finish = self.forced.message(self._text, finish_reason)
        if "tool_calls" not in message:
            return ({"content": message["content"]} if message["content"] else {}), finish
        return {"tool_calls": [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]}, finish


def _choice(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> str | dict[str, Any]:
    """The request's tool_choice, or OpenAI's default: 'auto' where tools are given."""
    return tool_choice if tool_choice is not None else ("auto" if tools else "none")


def _functions(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Each tool's function name and parameter schema (no parameters: an empty object). The
    request model has checked their shape."""
    if not tools:
        raise ToolChoiceError("tool_choice forces a tool call but the request has no tools", "tools")
    empty = {"type": "object", "properties": {}, "additionalProperties": False}
    return {tool["function"]["name"]: tool["function"].get("parameters") or empty for tool in tools}


def _named(choice: str | dict[str, Any]) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ToolChoiceError(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    return function["name"]


def _definitions_to(root: dict[str, Any], function: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """``parameters`` with its ``$defs`` (or ``definitions``) moved up into ``root``, the schema it
    becomes part of: its ``#/$defs/...`` references point at the root of the schema they are in,
    as pydantic writes them. Tools may share a definition, not give one name two."""
    kept = dict(parameters)
    for key in ("$defs", "definitions"):
        definitions = kept.get(key)
        if not isinstance(definitions, dict):
            continue
        del kept[key]
        for name, schema in definitions.items():
            if root.setdefault(key, {}).setdefault(name, schema) != schema:
                raise ToolChoiceError(
                    f"tools define {key} {name!r} differently (function {function!r}): tool_choice 'required' "
                    "holds every tool to one schema",
                    "tools",
                )
    return kept


def _call(name: str, arguments: str, call_id: str) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _with_calls(calls: list[dict[str, Any]]) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": calls}
