"""Deeply nested JSON, at any depth and in any field, on the server (/tokenize too, which needs no
API key) and the router: a 400 with an OpenAI-style body and one log line, never a 500."""

from __future__ import annotations

import pytest

from tests.robustness.conftest import AUTH, post

DEPTHS = [65, 330, 1000, 50_000]
PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"]


@pytest.mark.parametrize("where", ["colocated", "router"])
def test_nested_json_is_a_400_at_any_depth(fleet, where):
    server = getattr(fleet, where)
    headers = AUTH if where == "colocated" else {}
    before = server.log_path.read_text().count("nested too deep")
    answers = []
    for path in PATHS:
        for depth in DEPTHS:
            body = ('{"model": "tiny", "x-unknown": ' + "[" * depth + "]" * depth + ', "prompt": "hi"}').encode()
            answers.append((path, depth, post(server.url, path, body, headers)))
    bad = [(p, d, a.status_code, a.text[:120]) for p, d, a in answers if a.status_code != 400]
    assert not bad
    assert all("nested deeper than 64" in a.json()["error"]["message"] for *_, a in answers)
    assert server.log_path.read_text().count("nested too deep") - before == len(answers)  # one line each
    # /tokenize needs no API key: the guard stands before any endpoint
    unkeyed = post(server.url, "/tokenize", ("[" * 5000 + "]" * 5000).encode())
    assert unkeyed.status_code == 400
