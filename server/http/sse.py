"""Server-sent events: ``data: {json}\\n\\n`` per chunk, ending with ``data: [DONE]``.

The response listens for the client's disconnect while it streams and always closes the chunk
generator when it ends, so the generator's cleanup (aborting the engine requests, which frees
their KV blocks) runs at once, even for a request still waiting in the queue with no token to
send, and never waits for garbage collection.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from llmfleet.server.wire.errors import error_body
from llmfleet.server.wire.sse import encode_event

log = logging.getLogger(__name__)


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
