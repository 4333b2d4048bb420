"""Server-sent events on the wire: ``data: {json}\\n\\n`` per chunk, ending with ``data: [DONE]``.
Encoding our events, and cutting a relayed stream into whole events to read or pass on."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

from llmfleet.server.wire.errors import error_body

# Characters JSON leaves raw that Python's str.splitlines (and so httpx's and requests'
# iter_lines) takes for line ends: raw, a sampled "\x85" cuts a data line in two for those clients.
_LINE_ENDS_TO_PYTHON = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def encode_event(chunk: dict | str) -> str:
    data = chunk if isinstance(chunk, str) else _json(chunk)
    return f"data: {data}\n\n"


def _json(chunk: dict) -> str:
    """Compact JSON, UTF-8 as is, but for the line ends above, which are escaped (same JSON)."""
    data = json.dumps(chunk, separators=(",", ":"), ensure_ascii=False)
    for char, escaped in _LINE_ENDS_TO_PYTHON.items():
        if char in data:
            data = data.replace(char, escaped)
    return data


class WholeEvents:
    """Cuts a relayed event stream at event boundaries: a server that breaks off mid-event
    leaves no half event in the client's stream for the error event to be glued onto."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, raw: bytes) -> bytes:
        """Read ``raw``; returns the whole events it completes."""
        self._buffer += raw
        end = self._buffer.rfind(b"\n\n") + 2
        if end < 2:
            return b""
        whole, self._buffer = self._buffer[:end], self._buffer[end:]
        return whole

    def rest(self) -> bytes:
        """What the stream left after its last whole event."""
        rest, self._buffer = self._buffer, b""
        return rest


def event_data(whole: bytes) -> Iterator[bytes]:
    """The ``data:`` payloads of whole events (what ``WholeEvents.feed`` returns), in order."""
    for event in whole[:-2].split(b"\n\n"):
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                yield line[5:].strip()


async def event_lines(texts: AsyncIterator[str]) -> AsyncIterator[str]:
    """The lines of a streamed answer's text as SSE ends them (LF or CRLF), not as
    str.splitlines (httpx's ``aiter_lines``) does: another server's JSON may carry U+2028 raw."""
    pending = ""
    async for text in texts:
        *lines, pending = (pending + text).split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if pending:
        yield pending.removesuffix("\r")


def broken_stream_end(message: str) -> bytes:
    """How a relayed stream ends when its server fails mid-way: an OpenAI-style error event, then [DONE]."""
    return (encode_event(error_body(message, "bad_gateway", 502)) + encode_event("[DONE]")).encode()
