"""json_depth.loads parses with orjson and answers as ``json`` does where orjson would not."""

from __future__ import annotations

import json

import pytest

from llmfleet.server.wire import json_depth


@pytest.mark.parametrize(
    "text",
    [
        b'{"prompt": [1, 2, 3], "temperature": 0.5}',
        b"[12345678901234567890, 18446744073709551615, 123456789012345678901234567890]",  # past 64 bits: exact
        b'{"a": NaN, "b": Infinity}',  # json's, which the endpoints refuse by name
        b'"a\\ud800b"',  # a lone surrogate, which the endpoints refuse as not valid Unicode
        b'{"a": 1, "a": 2}',
        '{"x": "\u00e9"}',
        '["a\ud800b"]',  # text already decoded, holding a lone surrogate (JSON inside a body)
    ],
)
def test_the_same_values_as_json(text):
    got, expected = json_depth.loads(text), json.loads(text)
    assert repr(got) == repr(expected)  # types too: an integer stays an integer


def test_deep_nesting_is_refused_and_bad_json_is_a_value_error():
    with pytest.raises(json_depth.TooDeepError):
        json_depth.loads(b"[" * 2000 + b"]" * 2000)
    with pytest.raises(json_depth.TooDeepError):
        json_depth.loads(b"[" * 70 + b"]" * 70)
    with pytest.raises(ValueError):
        json_depth.loads(b"{not json")
