"""Reading the in-process app's answers: SSE chunks and OpenAI error bodies."""

from __future__ import annotations

import json


def sse_chunks(response) -> list:
    """Parse an SSE body: the JSON chunks, and the literal [DONE] last."""
    events = [line[len("data: ") :] for line in response.text.split("\n\n") if line]
    assert all(not e.startswith("data:") for e in events)
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def assert_openai_error(response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error
