"""Structured output holds or refuses: a constraint llguidance cannot follow is a 400 naming the
field and why, on the server and through the router, never a 200 "stop" with text that breaks it."""

from __future__ import annotations

import pytest

from tests.robustness.conftest import AUTH, MODEL, post

CASES = {
    "regex-too-large": ({"regex": "(a{1000}){1000}"}, "too many expressions"),
    "schema-only-itself": ({"json": {"$ref": "#"}}, "cannot be followed"),
}


@pytest.mark.parametrize("where", ["colocated", "router"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_constraint_that_cannot_be_followed_is_a_400(fleet, where, case):
    server = getattr(fleet, where)
    constraint, words = CASES[case]
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 8, "temperature": 0, "structured_outputs": constraint}
    answer = post(server.url, "/v1/completions", body, AUTH if where == "colocated" else {})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"].startswith("structured_outputs") and words in error["message"]


def test_a_constraint_that_can_be_followed_still_holds(fleet):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 8, "temperature": 0, "structured_outputs": {"regex": "a{3}"}}
    (choice,) = post(fleet.router.url, "/v1/completions", body).json()["choices"]
    assert choice["text"] == "aaa" and choice["finish_reason"] == "stop"
