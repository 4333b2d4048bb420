"""Reasoning parsers: a reply's thinking split from its answer, and a streamed reply, however its
text is cut, joining up to the split of the whole text."""

from __future__ import annotations

import argparse
import json
import re

import pytest
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st

from llmfleet.server import cli as server_cli
from llmfleet.server.config import EngineConfig
from llmfleet.server.openai.app import create_app
from llmfleet.server.parsers.reasoning import REASONING_PARSERS, Reasoning
from tests.server.fakes import real_tiny_state

SPLITS = [  # (text, split starting outside a think block, split starting inside one)
    ("<think>Hm, 2+2.</think>It is 4.", ("Hm, 2+2.", "It is 4."), ("Hm, 2+2.", "It is 4.")),
    ("\n<think>\nHm.\n</think>\n\n4", ("\nHm.\n", "\n\n4"), ("\nHm.\n", "\n\n4")),
    ("Hm, 2+2.</think>It is 4.", (None, "Hm, 2+2.</think>It is 4."), ("Hm, 2+2.", "It is 4.")),
    ("It is 4.", (None, "It is 4."), ("It is 4.", None)),  # inside: cut short before it answered
    ("<think>Still thinking", ("Still thinking", None), ("Still thinking", None)),
    ("<think></think>4", (None, "4"), (None, "4")),
    (
        "4 <think>not at the start</think>",
        (None, "4 <think>not at the start</think>"),
        ("4 <think>not at the start", None),
    ),
    ("<thin", (None, "<thin"), ("<thin", None)),  # a tag's start that never became one
    ("a </think", (None, "a </think"), ("a </think", None)),
    ("", (None, None), (None, None)),
]


@pytest.mark.parametrize(("text", "outside", "inside"), SPLITS)
def test_a_whole_reply_splits_at_the_think_tags(text, outside, inside):
    assert Reasoning(starts_inside=False).split(text) == outside
    assert Reasoning(starts_inside=True).split(text) == inside


PIECES = ["<think>", "</think>", "<th", "ink>", "</", "think", ">", "a", " ", "\n", "☀", "<", "/"]


@given(st.lists(st.sampled_from(PIECES), max_size=12), st.data(), st.booleans())
def test_a_stream_joins_up_to_the_whole_replys_split(pieces, data, starts_inside):
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    splitter = Reasoning(starts_inside).splitter()
    fed = [splitter.feed(chunk, final=i == len(chunks) - 1) for i, chunk in enumerate(chunks)]
    thinking, answer = "".join(t for t, _ in fed), "".join(a for _, a in fed)
    assert (thinking or None, answer or None) == Reasoning(starts_inside).split(text)


def test_where_thinking_starts():
    plain = "<user>hi<assistant>"
    assert Reasoning.of(None, plain, True) is None  # no parser: all content
    assert Reasoning.of("qwen3", plain, True).starts_inside is False  # the reply opens it, or not
    assert Reasoning.of("deepseek_r1", plain, True).starts_inside is True  # R1 may skip the tag
    opened = plain + "<think>\n"  # the template began the thinking (R1-0528, Qwen3-Thinking-2507)
    assert Reasoning.of("qwen3", opened, True).starts_inside is True
    closed = plain + "<think>\n\n</think>\n\n"  # Qwen3 with enable_thinking false
    assert Reasoning.of("qwen3", closed, True).starts_inside is False
    quoted = "<user>what does <think> mean?<assistant>"  # a tag in a message opens nothing
    assert Reasoning.of("qwen3", quoted, True).starts_inside is False
    assert Reasoning.of("qwen3", plain, False).fields("Hm.") == {}  # include_reasoning false
    assert Reasoning.of("qwen3", plain, True).fields("Hm.") == {"reasoning_content": "Hm.", "reasoning": "Hm."}
    # where a grammar that holds the answer alone lets the thinking run (core/grammar.py)
    assert Reasoning.of("deepseek_r1", plain, True).thinking_mode == "open"
    assert Reasoning.of("qwen3", plain, True).thinking_mode == "leading"


def test_the_flag_takes_vllms_parser_names():
    parser = argparse.ArgumentParser()
    server_cli.add_arguments(parser)
    for name in REASONING_PARSERS:
        assert parser.parse_args(["--reasoning-parser", name]).reasoning_parser == name
    with pytest.raises(SystemExit):
        parser.parse_args(["--reasoning-parser", "granite"])
    args = parser.parse_args([])
    assert args.structured_outputs_in_reasoning is False  # vLLM's default: a grammar holds the answer alone
    for suffix, value in (("", True), ("=True", True), ("=false", False)):
        flag = "--structured-outputs-config.enable_in_reasoning" + suffix
        assert parser.parse_args([flag]).structured_outputs_in_reasoning is value
    with pytest.raises(SystemExit):
        parser.parse_args(["--structured-outputs-config.enable_in_reasoning=maybe"])


@pytest.fixture(scope="module")
def r1_client():
    """deepseek_r1 on the real tiny model, in-process: R1 thinks from the reply's first token."""
    state = real_tiny_state(EngineConfig(dtype="float32", kv_cache_memory_mb=8))
    state.reasoning_parser = "deepseek_r1"
    with TestClient(create_app(state)) as client:
        yield client, state
    state.engine.shutdown()


def test_a_grammar_holds_the_answer_and_leaves_the_thinking_free(r1_client):
    """As vLLM by default: under deepseek_r1 a structured-output request's thinking runs free of
    its grammar (the random model never writes </think>, so its whole reply is thinking, and it
    is not held to the regex); with vLLM's enable_in_reasoning the grammar holds it too."""
    client, state = r1_client
    ask = {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 12, "temperature": 0}
    regex = {"structured_outputs": {"regex": "[a-f]{2,6}-[0-9]{2}"}}

    def choice(body: dict) -> dict:
        reply = client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]

    held = choice(ask | regex)
    assert held["finish_reason"] == "length" and held["message"]["content"] is None
    assert re.search("[^a-f0-9-]", held["message"]["reasoning_content"])
    state.structured_outputs_in_reasoning = True
    try:
        inside = choice(ask | regex)["message"]
    finally:
        state.structured_outputs_in_reasoning = False
    assert re.fullmatch("[a-f]{2,6}-[0-9]{2}", inside["reasoning_content"]) and inside["content"] is None


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "lookup"}}])
def test_a_forced_call_comes_after_the_thinking(r1_client, tool_choice):
    """A forced call's grammar holds the answer too: cut short in its thinking, the reply makes
    no call (no empty arguments), streamed or not."""
    client, _ = r1_client
    lookup = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    ask = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 12,
        "temperature": 0,
        "tools": [lookup],
        "tool_choice": tool_choice,
    }
    reply = client.post("/v1/chat/completions", json=ask)
    assert reply.status_code == 200, reply.text
    (choice,) = reply.json()["choices"]
    message = choice["message"]
    assert choice["finish_reason"] == "length" and message["content"] is None and "tool_calls" not in message
    streamed = client.post("/v1/chat/completions", json=ask | {"stream": True})
    deltas = [
        json.loads(line[6:])["choices"][0]["delta"] for line in streamed.text.splitlines() if line.startswith("data: {")
    ]
    assert not any(d.get("tool_calls") or d.get("content") for d in deltas)
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
