"""/v1/completions and /v1/chat/completions in-process on the fake runner: bodies, usage, echo,
request ids, SSE framing, stop strings and reasons; /v1/models, /tokenize and /detokenize."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

import llmfleet
from llmfleet.server.config import EngineConfig
from llmfleet.server.openai.app import create_app
from tests.server.openai.helpers import assert_openai_error, sse_chunks


def test_models_card(client):
    (card,) = client.get("/v1/models").json()["data"]
    assert card["id"] == "fake" and card["root"] == "fake" and card["object"] == "model"
    assert card["max_model_len"] == 256 and card["owned_by"] and isinstance(card["created"], int)


def test_every_served_model_name_is_listed_and_taken_and_answers_carry_the_first(state, client):
    state.model_aliases = ("fake-alias",)  # serve --served-model-name fake fake-alias
    assert [card["id"] for card in client.get("/v1/models").json()["data"]] == ["fake", "fake-alias"]
    out = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "model": "fake-alias"})
    assert out.status_code == 200 and out.json()["model"] == "fake"
    error = assert_openai_error(client.post("/v1/completions", json={"prompt": "hi", "model": "x"}), 404, "model")
    assert "`fake`, `fake-alias`" in error["message"]


def test_each_served_name_is_retrieved_by_name_and_another_is_a_404(state, client):
    """OpenAI's ``client.models.retrieve(name)``; a Hugging Face name holds a slash."""
    state.model_aliases = ("org/fake-alias",)
    listed = client.get("/v1/models").json()["data"]
    assert [client.get(f"/v1/models/{card['id']}").json() for card in listed] == listed
    error = assert_openai_error(client.get("/v1/models/org"), 404, "model")
    assert "`fake`, `org/fake-alias`" in error["message"]


def test_completion_max_tokens_null_means_the_default_16(client):
    """Current vLLM's: an explicit null is the field's default, not the rest of the context."""
    out = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": None, "ignore_eos": True}).json()
    assert out["usage"]["completion_tokens"] == 16


def test_completion_body_and_usage(client):
    out = client.post("/v1/completions", json={"prompt": ["ab", "cde"], "max_tokens": 5, "n": 2}).json()
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert all(len(c["text"]) == 5 and c["finish_reason"] == "length" for c in out["choices"])
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 20, "total_tokens": 25}


def test_echo_prepends_the_prompt(client):
    plain = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 0}).json()
    echoed = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 0, "echo": True})
    assert echoed.json()["choices"][0]["text"] == "hello" + plain["choices"][0]["text"]
    stream = client.post("/v1/completions", json={"prompt": [72, 73], "max_tokens": 4, "echo": True, "stream": True})
    text = "".join(c["choices"][0]["text"] for c in sse_chunks(stream) if c["choices"])
    assert text.startswith("hi") and len(text) == 6


def test_streamed_text_reads_whole_with_splitlines_clients(client):
    """U+0085, U+2028 and U+2029 are line ends to Python's splitlines, and so to httpx's and
    requests' iter_lines: a data line carrying one raw would reach those clients in two pieces."""
    prompt = "one\x85two\u2028three\u2029four"
    body = {"prompt": prompt, "max_tokens": 2, "echo": True, "stream": True}
    response = client.post("/v1/completions", json=body)
    events = [line[len("data: ") :] for line in response.iter_lines() if line]
    assert all(e == "[DONE]" or json.loads(e) for e in events), events
    text = "".join(c["choices"][0]["text"] for c in sse_chunks(response) if c["choices"])
    assert text.startswith(prompt)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_request_id_becomes_the_answer_id_as_vllm(client, stream):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": stream}
    for path, body, prefix in (
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": stream}, "cmpl"),
        ("/v1/chat/completions", chat, "chatcmpl"),
    ):

        def ids(response) -> set[str]:
            assert response.status_code == 200, response.text
            return {c["id"] for c in sse_chunks(response)} if stream else {response.json()["id"]}

        assert ids(client.post(path, json=body, headers={"X-Request-Id": "trace-abc"})) == {f"{prefix}-trace-abc"}
        assert ids(client.post(path, json=body | {"request_id": "mine-42"})) == {f"{prefix}-mine-42"}
        both = client.post(path, json=body | {"request_id": "mine-42"}, headers={"X-Request-Id": "trace-abc"})
        assert ids(both) == {f"{prefix}-trace-abc"}  # the header first, as vLLM
        # the same id twice at once: the engine's own ids stay unique
        assert ids(client.post(path, json=body | {"n": 2}, headers={"X-Request-Id": "again"})) == {f"{prefix}-again"}
        (random,) = ids(client.post(path, json=body))
        assert random.startswith(f"{prefix}-") and len(random) > len(prefix) + 16


def test_completion_stream_framing(client):
    body = {"prompt": "abc", "max_tokens": 6, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    response = client.post("/v1/completions", json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = sse_chunks(response)
    *token_chunks, usage = chunks
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15}
    for index in (0, 1):
        mine = [c["choices"][0] for c in token_chunks if c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) and len("".join(c["text"] for c in mine)) == 6
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + ["length"]
    assert len({c["id"] for c in chunks}) == 1


def test_chat_stream_framing(client):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5, "stream": True}
    chunks = sse_chunks(client.post("/v1/chat/completions", json=body))
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len("".join(c["choices"][0]["delta"].get("content", "") for c in chunks)) == 5
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert all("usage" not in c for c in chunks)  # include_usage not asked


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_count_each_choice_so_far(client, path):
    ask = {"prompt": "abc"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "abc"}]}
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = ask | {"max_tokens": 5, "n": 2, "stream": True, "stream_options": options}
    chunks = sse_chunks(client.post(path, json=body))
    *per_choice, total = chunks
    prompt = total["usage"]["prompt_tokens"]
    so_far = {0: [], 1: []}
    for chunk in per_choice:
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == prompt and usage["total_tokens"] == prompt + usage["completion_tokens"]
        so_far[chunk["choices"][0]["index"]].append(usage["completion_tokens"])
    for counts in so_far.values():
        assert counts == sorted(counts) and counts[-1] == 5
    assert total["choices"] == [] and total["usage"]["completion_tokens"] == 10


def test_chat_without_max_tokens_fits_the_kv_cache(make_state):
    # 16 blocks of 4 tokens: a request can hold 64 tokens, fewer than the 256-token context
    state = make_state(EngineConfig(), num_kv_blocks=16, kv_block_size=4)
    with TestClient(create_app(state)) as client:
        out = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    prompt = out["usage"]["prompt_tokens"]
    assert out["usage"]["completion_tokens"] == 64 - prompt
    assert out["choices"][0]["finish_reason"] == "length"


def test_stop_strings_and_stop_token_ids(client):
    base = client.post("/v1/completions", json={"prompt": "q", "max_tokens": 12, "temperature": 0}).json()
    text = base["choices"][0]["text"]
    cut = client.post("/v1/completions", json={"prompt": "q", "max_tokens": 12, "stop": text[4:6]}).json()
    assert cut["choices"][0]["text"] == text[: text.index(text[4:6])]
    assert cut["choices"][0]["finish_reason"] == "stop"
    stop_id = ord(text[3]) - 32  # CharTokenizer: token t is chr(32 + t)
    by_id = client.post("/v1/completions", json={"prompt": "q", "max_tokens": 12, "stop_token_ids": [stop_id]})
    assert by_id.json()["choices"][0]["finish_reason"] == "stop"
    kept = {"prompt": "q", "max_tokens": 12, "stop": text[4:6], "include_stop_str_in_output": True}
    assert client.post("/v1/completions", json=kept).json()["choices"][0]["text"] == text[: text.index(text[4:6]) + 2]
    # the first min_tokens tokens never stop a request: neither stop strings nor stop tokens in them
    late = {"prompt": "q", "max_tokens": 12, "min_tokens": 7, "stop": text[4:6], "stop_token_ids": [stop_id]}
    out = client.post("/v1/completions", json=late).json()
    assert out["usage"]["completion_tokens"] >= 8 and out["choices"][0]["text"].startswith(text[:7])


def test_stop_reason_names_the_stop_string_or_token_as_vllm(client):
    base = client.post("/v1/completions", json={"prompt": "q", "max_tokens": 12, "temperature": 0}).json()
    text = base["choices"][0]["text"]
    assert base["choices"][0]["stop_reason"] is None  # ran to its length
    stop_id = ord(text[3]) - 32  # CharTokenizer: token t is chr(32 + t)
    # of two stop strings the token completes, the first in the text (the detokenizer cuts there)
    stop = [text[6:8], text[5:7], text[4:5] + "\u00ff", text[4:7]]
    asks = [
        ({"stop": stop}, text[4:7]),
        ({"stop_token_ids": [stop_id]}, stop_id),
        # a stop string in the first min_tokens tokens does not count: the later one ended it
        ({"stop": [text[1], text[8]], "min_tokens": 5, "include_stop_str_in_output": True}, text[8]),
    ]
    assert text[1] not in text[2:9] and text[8] not in text[:8]  # (the hash runner's text is fixed)
    for extra, expected in asks:
        ask = {"prompt": "q", "max_tokens": 12, "temperature": 0} | extra
        out = client.post("/v1/completions", json=ask).json()["choices"][0]
        assert (out["finish_reason"], out["stop_reason"]) == ("stop", expected), (extra, text)
        chunks = sse_chunks(client.post("/v1/completions", json=ask | {"stream": True}))
        assert [c["choices"][0]["stop_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [expected]
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0}
        reply = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
        chat |= {"stop_token_ids": [ord(reply[2]) - 32]}
        assert client.post("/v1/chat/completions", json=chat).json()["choices"][0]["stop_reason"] == ord(reply[2]) - 32
        chunks = sse_chunks(client.post("/v1/chat/completions", json=chat | {"stream": True}))
        assert (
            "stop_reason" not in chunks[0]["choices"][0]
            and chunks[-1]["choices"][0]["stop_reason"] == ord(reply[2]) - 32
        )


def test_detokenize_inverts_tokenize_and_version_answers(client):
    tokens = client.post("/tokenize", json={"prompt": "round trip"}).json()["tokens"]
    assert client.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": "round trip"}
    assert_openai_error(client.post("/detokenize", json={"tokens": [10**6]}), 400, "tokens")
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        assert_openai_error(client.post(path, json=body | {"model": "gpt-9"}), 404, "model")
    assert client.get("/version").json() == {"version": llmfleet.__version__}
