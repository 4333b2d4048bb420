"""argparse types of the bench's own: lists of rates, counts and seeds. Counts, rates and ports use
llmfleet.arguments' (``positive_int``, ``positive``, ``non_negative``, ``port``), a dtype
server/engine_flags.py's ``dtype``: a wrong value is the parser's one-line error (exit 2) before a
model loads, not a traceback or a nan table."""

from __future__ import annotations

import argparse

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


def seeds(text: str) -> list[int | None]:
    """A comma-separated list of draws: whole numbers, or ``default`` for a workload's own seed;
    each at most once (a draw run twice gives the same rows twice)."""
    values: list[int | None] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            value = None if item == "default" else int(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is neither a whole number nor 'default'") from None
        if value in values:
            raise argparse.ArgumentTypeError(f"{item} is given twice")
        values.append(value)
    if not values:
        raise argparse.ArgumentTypeError(f"no seeds in {text!r}")
    return values
