"""How deep JSON may nest. Python's own parser and validators recurse once per level: about 330
levels of a request body (even in a field nobody reads) ran pydantic out of stack, and 1000 broke
``json.loads`` itself, each a 500. Our endpoints never need more than a JSON schema's nesting, so
a body, or JSON text inside one (a tool call's arguments, a schema), nests at most
``MAX_JSON_DEPTH`` levels, and deeper is a 400.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

MAX_JSON_DEPTH = 64
_CONTAINERS = frozenset({dict, list})  # what parsed JSON nests
# A run of 20 digits may be an integer past 64 bits, which orjson reads as a float and json keeps
# exact: found by mapping digits to "0" and the rest to " " (a pass in C, unlike a regex's).
_DIGITS_ONLY = bytes(ord("0") if b in b"0123456789" else ord(" ") for b in range(256))
_RUN_OF_20 = b"0" * 20
_NOT_PARSED = object()


class TooDeepError(ValueError):
    """JSON nested deeper than ``MAX_JSON_DEPTH`` (or than the parser itself can go)."""

    def __init__(self, limit: int = MAX_JSON_DEPTH) -> None:
        super().__init__(f"JSON nested deeper than {limit} levels is not accepted")


def depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """How deep ``value`` (parsed JSON) nests its arrays and objects, counted without recursion;
    stops counting past ``limit`` (the answer is then ``limit + 1``)."""
    if type(value) not in _CONTAINERS:
        return 0
    deepest, level = 0, [(value, 1)]
    while level:
        item, at = level.pop()
        children = item.values() if isinstance(item, dict) else item
        deepest = max(deepest, at)
        if deepest > limit:
            return deepest
        if _CONTAINERS.isdisjoint(map(type, children)):  # a million token ids: one pass in C
            continue
        level.extend((child, at + 1) for child in children if type(child) in _CONTAINERS)
    return deepest


def loads(text: str | bytes, limit: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads``, refusing JSON nested deeper than ``limit`` with TooDeepError (a ValueError,
    as a parse error is): never a RecursionError. Parsed by orjson, which holds the GIL a third
    as long on a list of token ids; what it refuses (lone surrogate escapes, NaN, nesting past
    1024) or reads otherwise (integers of 20 digits or more) goes to ``json``, whose answers the
    endpoints are built on."""
    value = _by_orjson(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
    if value is _NOT_PARSED:
        try:
            value = json.loads(text)
        except RecursionError as exc:
            raise TooDeepError(limit) from exc
    opened = "[{" if isinstance(text, str) else b"[{"
    if text.count(opened[0:1]) + text.count(opened[1:2]) > limit and depth(value, limit) > limit:
        raise TooDeepError(limit)  # (fewer brackets than the limit cannot nest past it: no walk)
    return value


def _by_orjson(raw: bytes) -> Any:
    """``raw`` parsed by orjson, or _NOT_PARSED where json must answer (see loads)."""
    if _RUN_OF_20 in raw.translate(_DIGITS_ONLY):
        return _NOT_PARSED
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return _NOT_PARSED
