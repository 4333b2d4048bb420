"""A reasoning model's thinking, split from its answer (vLLM's ``--reasoning-parser NAME``).

Reasoning models (DeepSeek R1 and its distills, QwQ, Qwen3) think inside ``<think>...</think>``
before they answer. With a reasoning parser the chat reply carries the thinking in its own field,
``reasoning_content`` (and ``reasoning``, vLLM's newer name for it), and only the answer in
``content``; tool calls are read from the answer alone. ``include_reasoning: false`` drops it.

A splitter is fed the generated text as it comes, so a streamed reply joins up to exactly the
same message. Where thinking starts:

- inside a think block the prompt left open (the chat template's generation prompt ends with
  ``<think>``, as those of R1-0528 and Qwen3-Thinking-2507 do);
- ``deepseek_r1``: at the reply's first token in any case, as vLLM's parser assumes (R1 starts
  thinking without writing the tag);
- otherwise where the reply opens with ``<think>`` (``qwen3``, whose thinking can be turned off
  with ``chat_template_kwargs: {"enable_thinking": false}``).

Thinking ends at ``</think>``; a reply cut short before it is all thinking.

A structured-output grammar (or a forced tool call's) holds the answer alone, as vLLM's does by
default: the thinking runs free up to its ``</think>`` (``thinking_mode``, core/grammar.py).
``--structured-outputs-config.enable_in_reasoning`` (vLLM's flag) makes it hold the whole reply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmfleet.server.parsers.tools import partial_suffix

START, END = "<think>", "</think>"

# parser name -> whether thinking starts with the reply even without a tag
REASONING_PARSERS = {"deepseek_r1": True, "qwen3": False}


@dataclass(frozen=True)
class Reasoning:
    """How one request's replies are split: where they start, and whether thinking is returned."""

    starts_inside: bool
    include: bool = True

    @classmethod
    def of(cls, parser: str | None, prompt_text: str, include: bool) -> Reasoning | None:
        """None without a parser: the reply is all content."""
        if parser is None:
            return None
        opened = prompt_text.rstrip().endswith(START)  # the template's generation prompt began the thinking
        return cls(opened or REASONING_PARSERS[parser], include)

    @property
    def thinking_mode(self) -> str:
        """Where a grammar that holds the answer alone lets the thinking run (core/request.py's
        THINKING_MODES): the reply starts inside it, or may open with it."""
        return "open" if self.starts_inside else "leading"

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole reply's thinking and answer (None where there is none)."""
        thinking, answer = self.splitter().feed(text, final=True)
        return thinking or None, answer or None

    def splitter(self) -> ThinkSplitter:
        return ThinkSplitter(self.starts_inside)

    def fields(self, thinking: str | None) -> dict[str, Any]:
        """The message or delta fields that carry ``thinking``."""
        if not self.include:
            return {}
        return {"reasoning_content": thinking, "reasoning": thinking}


class ThinkSplitter:
    """Streamed text in, (thinking, answer) out; a possible tag's start is held until told apart."""

    def __init__(self, starts_inside: bool) -> None:
        self._state = "opening" if starts_inside else "head"
        self._held = ""

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        self._held += text
        thinking, answer = "", ""
        if self._state in ("head", "opening"):  # a START may still come (in "opening": a redundant one)
            head = self._held.lstrip()
            if not final and START.startswith(head):
                return "", ""
            if head.startswith(START):
                self._held, self._state = head[len(START) :], "inside"
            else:
                self._state = "inside" if self._state == "opening" else "answer"
        if self._state == "inside":
            end = self._held.find(END)
            if end >= 0:
                thinking, self._held = self._held[:end], self._held[end + len(END) :]
                self._state = "answer"
            else:
                keep = 0 if final else partial_suffix(self._held, END)
                cut = len(self._held) - keep
                thinking, self._held = self._held[:cut], self._held[cut:]
        if self._state == "answer":
            answer, self._held = self._held, ""
        return thinking, answer
