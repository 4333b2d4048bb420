"""Reading the SSE stream the router relays, as it passes: first token, inter-token gaps, the
finish reason, and whether a retry is still possible."""

from __future__ import annotations

import json
import time
from typing import Protocol

from pydantic import TypeAdapter, ValidationError

from llmfleet.server.wire.sse import WholeEvents, event_data


class LatencyObserver(Protocol):
    """Where a meter reports the latencies it reads (the router's metrics)."""

    def first_token(self, seconds: float) -> None: ...

    def token_gap(self, seconds: float) -> None: ...


class StreamMeter:
    """Reads the SSE bytes the router relays: when generated content arrives (TTFT, ITL, observed
    as they happen, where ``metrics`` are given), the finish reason, and whether the stream has
    started (a generated token or a final event went out: from then on a failure can no longer be
    retried). Text the server echoes back (a chat's opening chunk, a completion's echoed prompt) is
    no token: it counts for neither."""

    def __init__(self, metrics: LatencyObserver | None, started: float, echo: bool = False) -> None:
        self.metrics = metrics
        self.started = started
        self.echo = echo
        self._echoed: set[int] = set()  # completion choices whose echoed prompt went by
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.finish_reason: str | None = None
        self.done = False
        self._events = WholeEvents()

    @property
    def started_content(self) -> bool:
        return self.first_at is not None or self.finish_reason is not None or self.done

    def feed(self, raw: bytes) -> bytes:
        """Read ``raw``; returns the whole events it completes, the bytes to relay: a server that
        breaks off mid-event leaves no half event in the client's stream."""
        whole = self._events.feed(raw)
        self.read(whole)
        return whole

    def read(self, whole: bytes) -> None:
        """Read whole events (cut by the caller's own ``WholeEvents``)."""
        for data in event_data(whole):
            self._on_data(data)

    def _on_data(self, data: bytes) -> None:
        if data == b"[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            return
        choices = chunk.get("choices") or []
        generated = [c for c in choices if not self._echoes(c) and _has_content(c)]  # every choice is looked at
        if generated:
            now = time.monotonic()
            if self.metrics is not None:
                if self.first_at is None:
                    self.metrics.first_token(now - self.started)
                else:
                    self.metrics.token_gap(now - self.last_at)
            if self.first_at is None:
                self.first_at = now
            self.last_at = now
        for choice in choices:
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def _echoes(self, choice: dict) -> bool:
        if "delta" in choice:
            return "role" in choice["delta"]  # a chat's opening chunk (with echo, the echoed message)
        index = choice.get("index", 0)
        if not self.echo or index in self._echoed:
            return False
        self._echoed.add(index)  # a completion's first chunk per choice is its echoed prompt
        return True


def _has_content(choice: dict) -> bool:
    if choice.get("text"):
        return True
    delta = choice.get("delta") or {}
    # a reasoning model's thinking is output too (vLLM counts it for TTFT): no buffering through it
    return bool(
        delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content") or delta.get("reasoning")
    )


_BOOL = TypeAdapter(bool)


def flag(value) -> bool:
    """A boolean field as the servers' models read it ("false", "0", "no" are False); a value they
    refuse is False here, and the server's 400 reaches the client."""
    try:
        return value is not None and _BOOL.validate_python(value)
    except ValidationError:
        return False
