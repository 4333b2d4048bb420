"""Reading the in-process app's answers (SSE chunks, OpenAI error bodies), and the ASGI scope of a
request sent to it by hand."""

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


def post_scope(path: str, headers: list[tuple[bytes, bytes]]) -> dict:
    """The ASGI scope of a JSON POST to ``path``, for a test that plays the client by hand (one that
    leaves, or writes slowly)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
