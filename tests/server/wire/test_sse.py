"""Reading and writing event streams: lines end where SSE ends them, whatever the JSON carries."""

from __future__ import annotations

import asyncio
import json

from llmfleet.server.wire.sse import encode_event, event_lines

LINE_ENDS_TO_PYTHON = "\x85\u2028\u2029"


async def _pieces(text: str, size: int):
    for start in range(0, len(text), size):
        yield text[start : start + size]


def _lines(text: str, size: int) -> list[str]:
    async def read() -> list[str]:
        return [line async for line in event_lines(_pieces(text, size))]

    return asyncio.run(read())


def test_encoded_events_carry_no_line_end_of_python_raw():
    data = encode_event({"text": f"a{LINE_ENDS_TO_PYTHON}b"})
    assert not any(c in data for c in LINE_ENDS_TO_PYTHON)
    assert data.splitlines() == [data.removesuffix("\n\n"), ""]
    assert json.loads(data.removeprefix("data: "))["text"] == f"a{LINE_ENDS_TO_PYTHON}b"


def test_event_lines_split_where_sse_does_in_any_pieces():
    raw = 'data: {"text":"a\u2028b\x85c"}\r\n\r\ndata: {"text":"d"}\n\ndata: [DONE]\n\n'
    expected = ['data: {"text":"a\u2028b\x85c"}', "", 'data: {"text":"d"}', "", "data: [DONE]", ""]
    for size in (1, 2, 3, 7, len(raw)):
        assert _lines(raw, size) == expected
    assert _lines("data: [DONE]", 4) == ["data: [DONE]"]  # a last line with no end
