"""Server-sent events: ``data: {json}\\n\\n`` per chunk, ending with ``data: [DONE]``.

The response listens for the client's disconnect while it streams and always closes the chunk
generator when it ends, so the generator's cleanup (aborting the engine requests, which frees
their KV blocks) runs at once, even for a request still waiting in the queue with no token to
send, and never waits for garbage collection.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterator

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from llmfleet.server.http.errors import error_body

log = logging.getLogger(__name__)


def encode_event(chunk: dict | str) -> str:
    data = chunk if isinstance(chunk, str) else json.dumps(chunk, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n"


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


def broken_stream_end(message: str) -> bytes:
    """How a relayed stream ends when its server fails mid-way: an OpenAI-style error event, then [DONE]."""
    return (encode_event(error_body(message, "bad_gateway", 502)) + encode_event("[DONE]")).encode()


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that stops at the client's disconnect and always closes its body
    iterator, so the iterator's cleanup runs at once (not at garbage collection)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client went away mid-send
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStreamResponse(ClosingStreamingResponse):
    def __init__(self, chunks: AsyncIterator[dict]) -> None:
        self._chunks = chunks
        super().__init__(self._body(), media_type="text/event-stream", headers=SSE_HEADERS)

    async def _body(self) -> AsyncIterator[str]:
        try:
            async for chunk in self._chunks:
                yield encode_event(chunk)
        except Exception as exc:  # after the headers went out, an error must end the stream visibly
            log.exception("stream failed")
            yield encode_event(error_body(f"stream failed: {exc}", "internal_error", 500))
        finally:
            await self._chunks.aclose()
        yield encode_event("[DONE]")
