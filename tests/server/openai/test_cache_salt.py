"""vLLM's ``cache_salt``: a request shares cached prompt prefixes only with requests of the same
salt, so that one tenant cannot learn another's prompts from how fast its own are answered."""

from __future__ import annotations

import pytest

from tests.server.openai.test_request_validation import assert_openai_error

PROMPT = "The same long system prompt, shared by every tenant of this server. " * 2


def hits(client) -> float:
    line = next(x for x in client.get("/metrics").text.splitlines() if x.startswith("vllm:prefix_cache_hits_total"))
    return float(line.rsplit(" ", 1)[1])


def test_a_prefix_is_shared_only_under_the_same_salt(client):
    completion = {"prompt": PROMPT, "max_tokens": 1}
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1}
    for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        assert client.post(path, json=body | {"cache_salt": "tenant-a"}).status_code == 200
        before = hits(client)
        assert client.post(path, json=body | {"cache_salt": "tenant-a"}).status_code == 200
        shared = hits(client)
        assert shared > before
        assert client.post(path, json=body | {"cache_salt": "tenant-b"}).status_code == 200
        assert client.post(path, json=body).status_code == 200  # unsalted: a chain of its own too
        assert hits(client) == shared


@pytest.mark.parametrize(
    ("salt", "words"),
    [
        ("", "at least 1 character"),
        ("x" * 129, "at most 128 characters"),
        ("a/b", "must not contain"),
        ("a@b", "must not contain"),
        ("a\x00b", "must not contain"),
        (7, "valid string"),
    ],
)
def test_a_salt_vllm_refuses_is_a_400(client, salt, words):
    answer = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "cache_salt": salt})
    assert words in assert_openai_error(answer, 400, "cache_salt")["message"]
