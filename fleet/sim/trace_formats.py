"""The request-log formats a trace is read in, each told from the file's first line, and their
readers: each line becomes (arrival, prompt length, output length) in flat arrays.

- JSONL, llm-fleet's own: ``{"arrival_s": 0.42, "prompt_tokens": 180, "output_tokens": 96}``,
  and where the prompt's content is known, ``hash_ids`` as Mooncake's, in blocks of
  ``block_tokens`` (default 512).
- JSONL, Mooncake's (its FAST'25 traces, which Dynamo's planner and AIPerf replay):
  ``{"timestamp": 3052, "input_length": 7234, "output_length": 794, "hash_ids": [...]}``, the
  timestamp in milliseconds. ``hash_ids`` name the prompt's content in blocks of 512 tokens,
  so requests that share a prefix share its ids: the simulated pods' prefix caches hit on them.
- CSV, Azure's public LLM inference traces (2023 and 2024): ``TIMESTAMP`` an ISO date and time
  (``2023-11-16 18:15:46.6805900``; ``2024-05-10 00:00:00.009930+00:00``; UTC where it names no
  zone) or seconds, ``ContextTokens``, ``GeneratedTokens``.
- CSV, BurstGPT's: ``Timestamp`` in seconds, ``Request tokens``, ``Response tokens``. Its traces
  log failed requests with 0 response tokens; a row with 0 tokens either way is a request that
  did not run and is left out.

Other keys and columns are ignored, but may pick the rows replayed: ``match`` keeps only those
whose fields hold the values given (BurstGPT's ``Model`` = ``GPT-4``, a log's tenant). A file
compressed with gzip, bzip2 or xz (told from its first bytes, whatever its name) is read as it is
decompressed.
"""

from __future__ import annotations

import bz2
import csv
import gzip
import itertools
import json
import lzma
import math
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

MAX_TOKENS = 2**31 - 1  # a length past any context (and past the 32-bit arrays the reader keeps)
BLOCK_TOKENS = 512  # the tokens one of a Mooncake trace's hash_ids stands for


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the line."""


_COMPRESSED = ((b"\x1f\x8b", gzip.open, ".gz"), (b"BZh", bz2.open, ".bz2"), (b"\xfd7zXZ\x00", lzma.open, ".xz"))
# what a compressed file's read raises beyond OSError: a truncated stream, a corrupt xz block
READ_ERRORS = (OSError, EOFError, lzma.LZMAError, UnicodeDecodeError)


def open_text(path: str | Path) -> IO[str]:
    """The trace as text, decompressed as it is read where its first bytes say gzip, bzip2 or xz:
    a long log is usually kept compressed, and a replay reads it once. A byte order mark (some
    editors and spreadsheets write one) is dropped by the decoder, whatever the format."""
    with open(path, "rb") as raw:
        head = raw.read(6)
    for magic, opener, _ in _COMPRESSED:
        if head.startswith(magic):
            return opener(path, "rt", encoding="utf-8-sig", newline="")  # type: ignore[operator]
    return open(path, encoding="utf-8-sig", newline="")


@dataclass(frozen=True)
class Format:
    """A log format: the names of its arrival, prompt-length and output-length fields, the
    seconds in one unit of its arrival, whether a row without tokens is a failed request to
    leave out (rather than an error), and whether its rows may name the prompt's content blocks
    (``hash_ids``, of ``block_tokens`` tokens each where a row does not say)."""

    name: str
    fields: tuple[str, str, str]
    seconds_per_unit: float = 1.0
    skips_empty: bool = False
    has_blocks: bool = False

    def describe(self) -> str:
        return f"{', '.join(self.fields)} ({self.name})"


JSONL_FORMATS = (
    Format("llm-fleet", ("arrival_s", "prompt_tokens", "output_tokens"), has_blocks=True),
    Format("Mooncake", ("timestamp", "input_length", "output_length"), seconds_per_unit=1e-3, has_blocks=True),
)
CSV_FORMATS = (
    Format("Azure", ("TIMESTAMP", "ContextTokens", "GeneratedTokens")),
    Format("BurstGPT", ("Timestamp", "Request tokens", "Response tokens"), skips_empty=True),
)


Content = tuple[tuple[int, ...], int]  # a prompt's content block ids, and the tokens in one block
NO_CONTENT: Content = ((), 0)


class Rows:
    """A trace's requests as read, in file order, in flat arrays (16 bytes a request), and the
    prompts' content where the format names it."""

    def __init__(self) -> None:
        self.arrivals = array("d")
        self.prompts = array("i")
        self.outputs = array("i")
        self.content: list[Content] = []  # one per request from the first that names any, else none

    def add(self, arrival: float, prompt: int, output: int, content: Content = NO_CONTENT) -> None:
        self.arrivals.append(arrival)
        self.prompts.append(prompt)
        self.outputs.append(output)
        if content[0] and not self.content:  # a log of lengths alone pays nothing for the list
            self.content = [NO_CONTENT] * (len(self.arrivals) - 1)
        if self.content or content[0]:
            self.content.append(content)

    def content_of(self, index: int) -> Content:
        return self.content[index] if self.content else NO_CONTENT

    def by_arrival(self) -> Sequence[int]:
        """Indices in arrival order, ties in file order (a log is usually in order already)."""
        a = self.arrivals
        if all(x <= y for x, y in itertools.pairwise(a)):
            return range(len(a))
        return sorted(range(len(a)), key=a.__getitem__)


Match = tuple[tuple[str, str], ...]  # (field, value): a row is kept where every field holds its value


def read_rows(
    path: str | Path, lines: Iterable[str], first_number: int, first: str, rows: Rows, match: Match = ()
) -> None:
    """Every request of ``lines`` (the file from its first line with text, ``first``, which is
    line ``first_number``) whose fields hold the values ``match`` gives, into ``rows``, in the
    format that line shows."""
    if is_csv(path, first):
        _read_csv(path, lines, first_number, rows, match)
    else:
        _read_jsonl(path, lines, first_number, rows, match)


def is_csv(path: str | Path, first: str) -> bool:
    """A CSV trace's first line is its header (a JSONL one's is an object), so a CSV with other
    columns is told which it lacks, not that its header is not JSON."""
    head = first.lstrip(" \t")
    name = Path(path).name.lower()
    for _, _, suffix in _COMPRESSED:
        name = name.removesuffix(suffix)
    return not head.startswith(("{", "[")) and ("," in head or name.endswith(".csv"))


def _format_of(names: Iterable[str], formats: Sequence[Format], where: str, what: str) -> Format:
    """The format whose fields ``names`` hold; else a TraceError naming what the nearest lacks."""
    present = set(names)
    for fmt in formats:
        if present.issuperset(fmt.fields):
            return fmt
    nearest = max(formats, key=lambda f: len(present.intersection(f.fields)))
    missing = [k for k in nearest.fields if k not in present]
    known = " or ".join(f.describe() for f in formats)
    raise TraceError(f"{where}: {what} needs {known}; missing {', '.join(missing)}")


def _read_jsonl(path: str | Path, lines: Iterable[str], first_number: int, rows: Rows, match: Match) -> None:
    fmt: Format | None = None
    for number, line in enumerate(lines, first_number):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise TraceError(f"{where}: not JSON: {exc}") from exc
        if not isinstance(record, dict):
            raise TraceError(f"{where}: expected an object with {' or '.join(f.describe() for f in JSONL_FORMATS)}")
        if match and not all(_as_text(record.get(field)) == value for field, value in match):
            continue
        if fmt is None:
            fmt = _format_of(record, JSONL_FORMATS, where, "a JSONL trace")
        at, prompt_key, output_key = fmt.fields
        missing = [k for k in fmt.fields if k not in record]
        if missing:
            raise TraceError(f"{where}: missing {', '.join(missing)}")
        arrival, prompt, output = record[at], record[prompt_key], record[output_key]
        if (
            isinstance(arrival, bool)
            or not isinstance(arrival, int | float)
            or not math.isfinite(arrival)
            or arrival < 0
        ):
            raise TraceError(f"{where}: {at} must be a finite number >= 0, got {arrival!r}")
        for key, value in ((prompt_key, prompt), (output_key, output)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TraceError(f"{where}: {key} must be an integer >= 1, got {value!r}")
        content = _content(record, where) if fmt.has_blocks else NO_CONTENT
        _keep(fmt, rows, where, float(arrival), prompt, output, content)


def _content(record: dict, where: str) -> Content:
    """A row's content blocks (none: its prompt shares nothing) and their size in tokens."""
    ids, size = record.get("hash_ids", []), record.get("block_tokens", BLOCK_TOKENS)
    if not isinstance(ids, list) or not all(_whole(i, 0) for i in ids):
        raise TraceError(f"{where}: hash_ids must be a list of integers >= 0, got {ids!r:.80}")
    if not _whole(size, 1):
        raise TraceError(f"{where}: block_tokens must be an integer >= 1, got {size!r}")
    return (tuple(ids), size) if ids else NO_CONTENT


def _whole(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _keep(
    fmt: Format, rows: Rows, where: str, arrival: float, prompt: int, output: int, content: Content = NO_CONTENT
) -> None:
    """One row's request into ``rows``, in seconds; a failed request (no tokens, where ``fmt``
    logs those) is left out, and a length no model could have is an error."""
    if fmt.skips_empty and (prompt == 0 or output == 0):
        return
    for key, value in zip(fmt.fields[1:], (prompt, output), strict=True):
        if value < 1:
            raise TraceError(f"{where}: {key} must be an integer >= 1, got {value!r}")
        if value > MAX_TOKENS:
            raise TraceError(f"{where}: {key} {value} is past any model's context (at most {MAX_TOKENS})")
    rows.add(arrival * fmt.seconds_per_unit, prompt, output, content)


def _as_text(value: object) -> str | None:
    """A JSONL field as a match compares it: text as it is, anything else as JSON (1, true)."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value)


def _read_csv(path: str | Path, lines: Iterable[str], header_number: int, rows: Rows, match: Match) -> None:
    reader = csv.reader(lines)
    header = [h.strip() for h in next(reader)]
    fmt = _format_of(header, CSV_FORMATS, f"{path}:{header_number}", "a CSV trace")
    at, prompt_at, output_at = (header.index(c) for c in fmt.fields)
    for field, _ in match:
        if field not in header:
            raise TraceError(f"{path}:{header_number}: no column {field!r} to match; it has {', '.join(header)}")
    wanted = [(header.index(field), value) for field, value in match]
    timestamps = _Timestamps(fmt.fields[0])
    for row in reader:
        if not row or not any(cell.strip() for cell in row):
            continue
        where = f"{path}:{header_number - 1 + reader.line_num}"
        if len(row) < len(header):
            raise TraceError(f"{where}: expected {len(header)} columns, got {len(row)}")
        if any(row[index].strip() != value for index, value in wanted):
            continue
        arrival = timestamps.seconds(row[at].strip(), where)
        lengths = []
        for column, index in ((fmt.fields[1], prompt_at), (fmt.fields[2], output_at)):
            try:
                lengths.append(int(row[index]))
            except ValueError:
                raise TraceError(f"{where}: {column} must be an integer >= 1, got {row[index]!r}") from None
        _keep(fmt, rows, where, arrival, lengths[0], lengths[1])


class _Timestamps:
    """Reads a timestamp column as seconds or as an ISO date and time, trying first the form the
    last one had (a trace keeps one form; an exception a row would cost more than the row)."""

    def __init__(self, column: str) -> None:
        self.column = column
        self.dates = False

    def seconds(self, text: str, where: str) -> float:
        value = self._date(text) if self.dates else self._number(text, where)
        if value is None:
            self.dates = not self.dates
            value = self._date(text) if self.dates else self._number(text, where)
        if value is None:
            raise TraceError(f"{where}: {self.column} {text!r} is neither seconds nor an ISO date and time")
        return value

    def _number(self, text: str, where: str) -> float | None:
        try:
            value = float(text)
        except ValueError:
            return None
        if not math.isfinite(value) or value < 0:
            raise TraceError(f"{where}: {self.column} must be a finite number >= 0 or a date, got {text!r}")
        return value

    @staticmethod
    def _date(text: str) -> float | None:
        try:
            when = datetime.fromisoformat(text)
        except ValueError:
            return None
        return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()
