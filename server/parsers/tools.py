"""Tool calls read back out of a model's own text, for ``tool_choice: "auto"`` (vLLM's
``--enable-auto-tool-choice --tool-call-parser NAME``).

A parser is fed the generated text as it comes and hands back the content that is the model's
words and the calls it has read whole; a non-streamed reply is the same parser fed once, so a
streamed reply joins up to exactly the same message. Four formats, vLLM's names:

- ``hermes`` (Hermes 2 Pro, Qwen 2.5 and 3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call, words allowed before them; a block left open when generation ends is read too.
- ``llama3_json`` (Llama 3.1-3.3 with their JSON tool template): the whole reply is one or more
  ``{"name": ..., "parameters": {...}}`` objects separated by ``;``, optionally after ``<|python_tag|>``.
- ``pythonic`` (Llama 3.2 and 4 with their pythonic template): the whole reply is a Python list
  of calls with literal keyword arguments, ``[get_weather(city="Oslo", days=3), now()]``.
- ``mistral`` (Mistral 7B v0.3, Nemo, Small): words, then ``[TOOL_CALLS]`` and the calls to the
  reply's end, a JSON list of ``{"name": ..., "arguments": {...}}`` (v3 tokenizers) or one
  ``name[ARGS]{...}`` after each ``[TOOL_CALLS]`` (v11: Small 3.2, Magistral). ``[TOOL_CALLS]``
  is a special token, so its replies keep special tokens in their text (``keeps_special_tokens``).

A block that does not read as a call (not JSON, no name) is returned as content, as written:
nothing the model generated is dropped but the whitespace between calls.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON text, as the OpenAI API carries it


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """Mistral's chat templates take a call back on the next turn only with an id of 9 letters
    and digits (vLLM's MistralToolCall ids)."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


class ToolCallParser(Protocol):
    keeps_special_tokens: ClassVar[bool]  # its tags are special tokens, which the reply's text must keep
    call_id: ClassVar[Callable[[], str]]  # a new call's id, in the form the model's chat template takes back

    def feed(self, text: str, final: bool) -> list[str | ParsedCall]:
        """Take newly generated ``text`` (``final``: generation has ended) and return the content
        and the calls that can be told apart now, in the order the model wrote them; text that may
        still become a call is held."""
        ...


class HermesParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    keeps_special_tokens = False
    call_id = staticmethod(openai_call_id)

    def __init__(self) -> None:
        self._held = ""  # text not yet told apart: a possible tag's start, or an open block's body
        self._in_block = False
        self._between = ""  # whitespace after a call: content only if words follow it
        self._called = False

    def feed(self, text: str, final: bool) -> list[str | ParsedCall]:
        self._held += text
        parts: list[str | ParsedCall] = []
        while True:
            if self._in_block:
                end = self._held.find(self.CLOSE)
                if end < 0 and not final:
                    break
                body, closed = (self._held[:end], True) if end >= 0 else (self._held, False)
                self._held = self._held[end + len(self.CLOSE) :] if closed else ""
                self._in_block = False
                call = _hermes_call(body)
                if call is None:
                    parts.append(self.OPEN + body + (self.CLOSE if closed else ""))
                else:
                    parts.append(call)
                    self._called = True
                continue
            start = self._held.find(self.OPEN)
            if start >= 0:
                parts.append(self._outside(self._held[:start], boundary=True))
                self._held = self._held[start + len(self.OPEN) :]
                self._in_block = True
                continue
            keep = 0 if final else partial_suffix(self._held, self.OPEN)
            cut = len(self._held) - keep
            parts.append(self._outside(self._held[:cut], boundary=final))
            self._held = self._held[cut:]
            break
        return [part for part in parts if part != ""]

    def _outside(self, text: str, boundary: bool) -> str:
        """Text outside the blocks. Before the first call it is content as it comes; after one,
        whitespace waits to see whether words follow it (then it is content) or a block or the
        end does (then it was only the gap between calls)."""
        if not self._called:
            return text
        self._between += text
        if self._between.strip():
            out, self._between = self._between, ""
            return out
        if boundary:
            self._between = ""
        return ""


class _WholeReplyParser:
    """A format whose calls are the whole reply: its first words say whether it is one (then it
    is held and read once generation ends), or plain content (streamed as it comes)."""

    keeps_special_tokens = False
    call_id = staticmethod(openai_call_id)

    def __init__(self) -> None:
        self._text = ""
        self._calls: bool | None = None  # unknown until the first word

    def feed(self, text: str, final: bool) -> list[str | ParsedCall]:
        self._text += text
        if self._calls is None:
            head = self._text.lstrip()
            opens = self.opens(head)
            if opens is None and not final:  # nothing yet, or maybe an opening's start
                return []
            self._calls = bool(opens)
        if not self._calls or final:
            whole, self._text = self._text, ""
            calls = self.parse(whole) if self._calls else None
            return list(calls) if calls else [whole] if whole else []
        return []  # the calls are read once the reply is whole

    def opens(self, head: str) -> bool | None:
        """Whether a reply starting with ``head`` is calls (None: cannot tell yet)."""
        raise NotImplementedError

    def parse(self, text: str) -> list[ParsedCall] | None:
        """The calls of a whole reply, or None if any part of it is not one."""
        raise NotImplementedError


class Llama3JsonParser(_WholeReplyParser):
    TAG = "<|python_tag|>"

    def opens(self, head: str) -> bool | None:
        if self.TAG.startswith(head):
            return None
        return head.startswith(("{", self.TAG))

    def parse(self, text: str) -> list[ParsedCall] | None:
        return _llama3_calls(text)


class PythonicParser(_WholeReplyParser):
    """Llama 3.2 and 4's pythonic format: ``[get_weather(city="Oslo", days=3), now()]``."""

    def opens(self, head: str) -> bool | None:
        return None if not head else head.startswith("[")

    def parse(self, text: str) -> list[ParsedCall] | None:
        return _pythonic_calls(text)


class MistralParser:
    """Words as they come until ``[TOOL_CALLS]``; from it to the end, the calls, read once the
    reply is whole (as written, as content, where they do not read as calls)."""

    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
    keeps_special_tokens = True
    call_id = staticmethod(mistral_call_id)

    def __init__(self) -> None:
        self._held = ""
        self._in_calls = False

    def feed(self, text: str, final: bool) -> list[str | ParsedCall]:
        self._held += text
        content = ""
        if not self._in_calls:
            start = self._held.find(self.TAG)
            if start < 0:
                cut = len(self._held) - (0 if final else partial_suffix(self._held, self.TAG))
                content, self._held = self._held[:cut], self._held[cut:]
                return [content] if content else []
            content, self._held, self._in_calls = self._held[:start], self._held[start:], True
        if not final:
            return [content] if content else []
        calls = _mistral_calls(self._held)
        if calls is None:
            content += self._held
        self._held = ""
        return ([content] if content else []) + list(calls or [])


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "pythonic": PythonicParser,
    "mistral": MistralParser,
}


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that could be the start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _hermes_call(body: str) -> ParsedCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    return _call_of(obj, "arguments")


def _llama3_calls(text: str) -> list[ParsedCall] | None:
    """The calls of a whole reply, or None if any part of it is not one."""
    rest = text.strip().removeprefix(Llama3JsonParser.TAG)
    decoder = json.JSONDecoder()
    calls: list[ParsedCall] = []
    while True:
        rest = rest.lstrip()
        try:
            obj, end = decoder.raw_decode(rest)
        except ValueError:
            return None
        # a bare JSON answer may hold a "name" too: only one with arguments is a call (as vLLM reads it)
        call = _call_of(obj, "parameters", "arguments", needs_arguments=True)
        if call is None:
            return None
        calls.append(call)
        rest = rest[end:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            return None
        rest = rest[1:]


def _pythonic_calls(text: str) -> list[ParsedCall] | None:
    """The calls of a reply that is a Python list of calls with literal keyword arguments."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
            return None
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
            if len(arguments) != len(node.keywords):
                return None  # **kwargs
            calls.append(ParsedCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
        except (ValueError, TypeError, SyntaxError):  # not a literal, or not JSON (a set, bytes)
            return None
    return calls


def _mistral_calls(text: str) -> list[ParsedCall] | None:
    """The calls after the first ``[TOOL_CALLS]``: one JSON list of them, or ``name[ARGS]{...}``
    after each tag; None if any part is not a call."""
    segments = text.split(MistralParser.TAG)[1:]
    if len(segments) == 1 and segments[0].lstrip().startswith("["):
        try:
            listed = json.loads(segments[0])
        except ValueError:
            return None
        read = [_call_of(obj, "arguments") for obj in listed] if isinstance(listed, list) else []
        return [c for c in read if c is not None] if read and None not in read else None
    calls = []
    for segment in segments:
        name, tag, arguments = segment.partition(MistralParser.ARGS)
        if not tag or not re.fullmatch(r"[\w.-]+", name.strip()):
            return None
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return None
        if not isinstance(parsed, dict):
            return None
        calls.append(ParsedCall(name.strip(), json.dumps(parsed, ensure_ascii=False)))
    return calls or None


def _call_of(obj: Any, *argument_keys: str, needs_arguments: bool = False) -> ParsedCall | None:
    """A call from a decoded object: a string name, and arguments as an object or a JSON text (a
    text that is not JSON goes out as a JSON string: clients parse ``arguments``)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in argument_keys if k in obj), None)
    if key is None and needs_arguments:
        return None
    arguments = {} if key is None else obj[key]
    if isinstance(arguments, str):
        return ParsedCall(obj["name"], arguments if _is_json(arguments) else json.dumps(arguments, ensure_ascii=False))
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
