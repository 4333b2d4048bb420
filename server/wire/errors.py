"""OpenAI-style error bodies, ``{"error": {"message", "type", "param", "code"}}``: made for our
answers, read from a peer's."""

from __future__ import annotations

import json
from typing import Any


def error_body(message: str, type_: str, status: int, param: str | None = None) -> dict:
    # A message quoting the request (a model name, say) may hold a lone surrogate, which JSON
    # cannot be rendered from as UTF-8: it goes out escaped.
    message = message.encode("utf-8", "backslashreplace").decode()
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def error_fields(content: bytes) -> tuple[Any, str | None] | None:
    """A peer's OpenAI-style error body's message and type, as sent; None for any other body."""
    try:
        error = json.loads(content)["error"]
        return error["message"], error.get("type")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
