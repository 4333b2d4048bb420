"""tool_choice 'auto': the parsers read calls out of a model's text, and a streamed reply, however
its text is cut, joins up to the message the whole text gives."""

from __future__ import annotations

import argparse
import itertools
import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st

from llmfleet.server import cli as server_cli
from llmfleet.server.config import EngineConfig
from llmfleet.server.openai.app import create_app
from llmfleet.server.openai.tool_calls import AutoToolCalls
from llmfleet.server.parsers.tools import TOOL_CALL_PARSERS
from llmfleet.server.serve import local_engine_state
from tests.server.fakes import real_tiny_state

WEATHER = '{"name": "weather", "arguments": {"city": "Oslo", "days": 3}}'
TIME = '{"name": "time", "arguments": {}}'

HERMES = [  # (text, content, [(name, arguments)])
    ("It is sunny.", "It is sunny.", []),
    (f"<tool_call>\n{WEATHER}\n</tool_call>", None, [("weather", {"city": "Oslo", "days": 3})]),
    (f"Let me look.\n<tool_call>{WEATHER}</tool_call>", "Let me look.\n", [("weather", {"city": "Oslo", "days": 3})]),
    (
        f"<tool_call>{WEATHER}</tool_call>\n<tool_call>{TIME}</tool_call>\n",
        None,
        [("weather", {"city": "Oslo", "days": 3}), ("time", {})],
    ),
    (f"<tool_call>{TIME}</tool_call>\nDone.", "\nDone.", [("time", {})]),
    (f"<tool_call>\n{WEATHER}", None, [("weather", {"city": "Oslo", "days": 3})]),  # left open at the end
    ('<tool_call>{"name": "time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>', None, [("time", {"tz": "UTC"})]),
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": "city=Oslo"}</tool_call>', None, [("f", "city=Oslo")]),  # still JSON
    ("a < b and <tool", "a < b and <tool", []),  # a tag's start that never became one
    ("Température ☀", "Température ☀", []),
]

LLAMA3 = [
    ("It is sunny.", "It is sunny.", []),
    ('{"name": "weather", "parameters": {"city": "Oslo"}}', None, [("weather", {"city": "Oslo"})]),
    (
        '<|python_tag|>{"name": "time", "parameters": {}}; {"name": "weather", "parameters": {"city": "Lima"}}',
        None,
        [("time", {}), ("weather", {"city": "Lima"})],
    ),
    ('  {"name": "time", "arguments": {}}', None, [("time", {})]),
    ('{"name": "time", "parameters": {}} and then words', '{"name": "time", "parameters": {}} and then words', []),
    ('{"name": "Alice", "age": 30}', '{"name": "Alice", "age": 30}', []),  # an answer in JSON, not a call
    ('{"name": "weather", "parameters": {"city": "Os', '{"name": "weather", "parameters": {"city": "Os', []),
]


PYTHONIC = [
    ("It is sunny.", "It is sunny.", []),
    ('[weather(city="Oslo", days=3)]', None, [("weather", {"city": "Oslo", "days": 3})]),
    (
        "  [time(), weather(city='Lima', hourly=True, at=None, days=[1, 2])]\n",
        None,
        [("time", {}), ("weather", {"city": "Lima", "hourly": True, "at": None, "days": [1, 2]})],
    ),
    ('[weather(city="Tōkyō", opts={"unit": "C"})]', None, [("weather", {"city": "Tōkyō", "opts": {"unit": "C"}})]),
    ("[weather(city=oslo)]", "[weather(city=oslo)]", []),  # not a literal
    ('[weather("Oslo")]', '[weather("Oslo")]', []),  # positional
    ("[1] First, the weather.", "[1] First, the weather.", []),
    ("[]", "[]", []),
    ('[weather(city="Os', '[weather(city="Os', []),  # cut short
    ("[" * 400, "[" * 400, []),
]


MISTRAL = [
    ("It is sunny.", "It is sunny.", []),
    (f"[TOOL_CALLS] [{WEATHER}, {TIME}]", None, [("weather", {"city": "Oslo", "days": 3}), ("time", {})]),
    (f"Let me look. [TOOL_CALLS][{TIME}]\n", "Let me look. ", [("time", {})]),
    (
        '[TOOL_CALLS]weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get-time[ARGS]{}',
        None,
        [("weather", {"city": "Oslo"}), ("get-time", {})],
    ),  # v11
    ('[TOOL_CALLS]weather[ARGS]{"city": "Os', '[TOOL_CALLS]weather[ARGS]{"city": "Os', []),  # cut short
    ("[TOOL_CALLS] not a call", "[TOOL_CALLS] not a call", []),
    ("[TOOL_CALLS] []", "[TOOL_CALLS] []", []),
    ("a [TOOL", "a [TOOL", []),  # a tag's start that never became one
]


def replied(parser: str, text: str, finish: str = "stop") -> tuple[dict, str]:
    return AutoToolCalls(TOOL_CALL_PARSERS[parser]).message(text, finish)


CASES = (
    [("hermes", *case) for case in HERMES]
    + [("llama3_json", *case) for case in LLAMA3]
    + [("pythonic", *case) for case in PYTHONIC]
    + [("mistral", *case) for case in MISTRAL]
)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_a_whole_reply_becomes_content_and_calls(parser, text, content, calls):
    message, finish = replied(parser, text)
    assert message["role"] == "assistant" and message["content"] == content
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]
    assert got == calls
    assert all(c["type"] == "function" for c in message.get("tool_calls", []))
    ids = [c["id"] for c in message.get("tool_calls", [])]
    if parser == "mistral":  # its chat templates take back only these
        assert all(len(i) == 9 and i.isalnum() and i.isascii() for i in ids)
    else:
        assert all(i.startswith("call_") for i in ids)
    assert len(set(ids)) == len(ids)
    assert finish == ("tool_calls" if calls else "stop")


def test_a_reply_cut_short_keeps_its_finish_reason_and_parallel_false_keeps_the_first_call():
    text = f"<tool_call>{WEATHER}</tool_call><tool_call>{TIME}</tool_call>"
    assert replied("hermes", text, "length")[1] == "length"
    message, finish = AutoToolCalls(TOOL_CALL_PARSERS["hermes"], parallel=False).message(text, "stop")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["weather"] and finish == "tool_calls"


def streamed(parser: str, pieces: list[str], parallel: bool = True) -> tuple[dict, str]:
    """The deltas of a stream fed ``pieces``, joined as a client joins them."""
    stream = AutoToolCalls(TOOL_CALL_PARSERS[parser], parallel).stream()
    content, calls, finish = "", [], None
    for i, piece in enumerate(pieces):
        deltas, finish = stream.deltas(piece, "stop" if i == len(pieces) - 1 else None)
        assert finish is None or i == len(pieces) - 1
        for delta in deltas:
            content += delta.get("content", "")
            for call in delta.get("tool_calls", []):
                assert call.pop("index") == len(calls)
                calls.append(call)
    message = {"role": "assistant", "content": content or None} | ({"tool_calls": calls} if calls else {})
    return message, finish


def without_ids(message: dict) -> dict:
    return message | {"tool_calls": [c | {"id": None} for c in message.get("tool_calls", [])]}


@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 200), max_size=12), parallel=st.booleans())
def test_a_stream_cut_anywhere_joins_up_to_the_whole_reply(case, cuts, parallel):
    parser, text = case[:2]
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)] or [""]
    pieces.append("")  # the finishing event may bring no text, as a stop token's does
    message, finish = AutoToolCalls(TOOL_CALL_PARSERS[parser], parallel).message(text, "stop")
    joined, joined_finish = streamed(parser, pieces, parallel)
    assert without_ids(joined) == without_ids(message) and joined_finish == finish


def test_words_go_out_as_they_come_and_a_call_once_it_is_whole():
    stream = AutoToolCalls(TOOL_CALL_PARSERS["hermes"]).stream()
    assert stream.deltas("Let me ", None) == ([{"content": "Let me "}], None)
    assert stream.deltas("look.<tool", None) == ([{"content": "look."}], None)  # '<tool' may open a block
    assert stream.deltas('_call>{"name": "time", ', None) == ([], None)
    (delta,), _ = stream.deltas('"arguments": {}}</tool_call>', None)
    assert [c["function"] for c in delta["tool_calls"]] == [{"name": "time", "arguments": "{}"}]
    assert stream.deltas("", "stop") == ([], "tool_calls")


def test_auto_tool_choice_without_a_parser_stops_the_server_before_it_loads_the_model():
    parser = argparse.ArgumentParser()
    server_cli.add_arguments(parser)
    with pytest.raises(SystemExit, match="--enable-auto-tool-choice needs --tool-call-parser"):
        local_engine_state(parser.parse_args(["--enable-auto-tool-choice"]))
    with pytest.raises(SystemExit):  # argparse: an unknown format
        parser.parse_args(["--tool-call-parser", "granite"])


def test_special_tokens_stay_in_the_text_when_asked_and_under_the_mistral_parser():
    """vLLM's skip_special_tokens (default true), and its mistral parser's adjustment: [TOOL_CALLS]
    is a special token, so a reply read by it keeps special tokens in its text. A bias makes the
    tiny model write <|pad|>, a special token that does not stop it."""
    state = real_tiny_state(EngineConfig(dtype="float32", kv_cache_memory_mb=8))
    pad = state.tokenizer.convert_tokens_to_ids("<|pad|>")
    ask = {"max_tokens": 4, "temperature": 0, "logit_bias": {str(pad): 100}}
    tools = [{"type": "function", "function": {"name": "time"}}]
    chat = ask | {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "none"}
    try:
        with TestClient(create_app(state)) as client:

            def text(path: str, body: dict) -> str:
                reply = client.post(path, json=body)
                assert reply.status_code == 200, reply.text
                choice = reply.json()["choices"][0]
                return choice["text"] if "text" in choice else choice["message"]["content"] or ""

            assert text("/v1/completions", ask | {"prompt": "hi"}) == ""
            assert text("/v1/completions", ask | {"prompt": "hi", "skip_special_tokens": False}) == "<|pad|>" * 4
            assert text("/v1/chat/completions", chat) == ""
            state.tool_call_parser = "mistral"  # 'auto' reads the reply with it
            assert text("/v1/chat/completions", chat | {"tool_choice": "auto"}) == "<|pad|>" * 4
    finally:
        state.engine.shutdown()


def test_a_piece_holding_words_and_a_call_keeps_them_in_the_order_written():
    """A consumer that falls behind the engine gets its tokens merged into one piece: the call
    and the words after it must still come out in that order (the Responses API's items do)."""
    stream = AutoToolCalls(TOOL_CALL_PARSERS["hermes"]).stream()
    deltas, finish = stream.deltas(f"Hi <tool_call>{TIME}</tool_call>\nDone.", "stop")
    assert [list(delta) for delta in deltas] == [["content"], ["tool_calls"], ["content"]]
    assert deltas[0]["content"] == "Hi " and deltas[2]["content"] == "\nDone." and finish == "tool_calls"
