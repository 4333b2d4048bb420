"""argparse types of the bench's own: a list of rates and a dtype. Counts, rates and ports use
llmfleet.arguments' (``positive_int``, ``positive``, ``non_negative``, ``port``): a wrong value is
the parser's one-line error (exit 2) before a model loads, not a traceback or a nan table."""

from __future__ import annotations

import argparse
import typing

from llmfleet.arguments import positive, positive_int


def positive_floats(text: str) -> list[float]:
    """A comma-separated list of numbers > 0 (blank items skipped), at least one."""
    values = [positive(item) for item in text.split(",") if item.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"no numbers in {text!r}")
    return values


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of whole numbers > 0 (blank items skipped), at least one."""
    values = [positive_int(item) for item in text.split(",") if item.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"no numbers in {text!r}")
    return values


def dtype(text: str) -> str:
    """A dtype name as EngineConfig takes it (vLLM's aliases too), checked by EngineConfig itself."""
    from pydantic import ValidationError

    from llmfleet.server.config import DTYPE_ALIASES, EngineConfig

    try:
        return EngineConfig(dtype=text).dtype
    except ValidationError:
        names = [*typing.get_args(EngineConfig.model_fields["dtype"].annotation), *DTYPE_ALIASES]
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(names)}, got {text!r}") from None
