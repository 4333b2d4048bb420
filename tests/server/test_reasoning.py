"""Reasoning parsers: a reply's thinking split from its answer, and a streamed reply, however its
text is cut, joining up to the split of the whole text."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmfleet.server import cli as server_cli
from llmfleet.server.api.reasoning import REASONING_PARSERS, Reasoning

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
    assert Reasoning.of(None, plain, False, True) is None  # no parser: all content
    assert Reasoning.of("qwen3", plain, False, True).starts_inside is False  # the reply opens it, or not
    assert Reasoning.of("deepseek_r1", plain, False, True).starts_inside is True  # R1 may skip the tag
    assert Reasoning.of("deepseek_r1", plain, True, True).starts_inside is False  # a grammar rules the reply
    opened = plain + "<think>\n"  # the template began the thinking (R1-0528, Qwen3-Thinking-2507)
    assert Reasoning.of("qwen3", opened, True, True).starts_inside is True
    closed = plain + "<think>\n\n</think>\n\n"  # Qwen3 with enable_thinking false
    assert Reasoning.of("qwen3", closed, False, True).starts_inside is False
    quoted = "<user>what does <think> mean?<assistant>"  # a tag in a message opens nothing
    assert Reasoning.of("qwen3", quoted, False, True).starts_inside is False
    assert Reasoning.of("qwen3", plain, False, False).fields("Hm.") == {}  # include_reasoning false
    assert Reasoning.of("qwen3", plain, False, True).fields("Hm.") == {"reasoning_content": "Hm.", "reasoning": "Hm."}


def test_the_flag_takes_vllms_parser_names():
    parser = argparse.ArgumentParser()
    server_cli.add_arguments(parser)
    for name in REASONING_PARSERS:
        assert parser.parse_args(["--reasoning-parser", name]).reasoning_parser == name
    with pytest.raises(SystemExit):
        parser.parse_args(["--reasoning-parser", "granite"])
