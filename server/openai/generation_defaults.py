"""Default sampling parameters from the model's ``generation_config.json``, as vLLM's
``--generation-config auto`` (its default) takes them: a request that leaves ``temperature``,
``top_p``, ``top_k``, ``min_p`` or ``repetition_penalty`` out gets the model creator's value
instead of the API's neutral one, and a chat without ``max_tokens`` gets ``max_new_tokens`` (within
what the context has left). ``vllm`` takes none; a folder takes that folder's file."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmfleet.server.core.request import SamplingParams

FILE = "generation_config.json"
# What the file may set, and its name in a request (vLLM reads the same keys)
KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


class GenerationConfigError(ValueError):
    """A generation config that was asked for and cannot be read; the message names the file."""


def read_generation_defaults(source: str, model_dir: Path | None, override: str | None = None) -> dict[str, float]:
    """The request defaults ``source`` gives: ``auto`` (the model directory's file, if any),
    ``vllm`` (none) or a folder holding a ``generation_config.json``; ``override`` (JSON, as
    vLLM's ``--override-generation-config``) sets keys over them."""
    readers: list[tuple[str, Callable[[], str]]] = []
    path = _file(source, model_dir)
    if path is not None:
        readers.append((str(path), path.read_text))
    if override:
        readers.append(("--override-generation-config", lambda: override))
    raw: dict[str, Any] = {}
    for where, read in readers:
        raw |= _object(where, read)
    where = " and ".join(w for w, _ in readers)
    values = {KEYS[key]: _number(where, key, value) for key, value in raw.items() if key in KEYS and value is not None}
    return checked(values, where)


def _file(source: str, model_dir: Path | None) -> Path | None:
    if source == "vllm":
        return None
    if source == "auto":
        return model_dir / FILE if model_dir is not None and (model_dir / FILE).is_file() else None
    return Path(source) / FILE if Path(source).is_dir() else Path(source)


def _object(where: str, read: Callable[[], str]) -> dict[str, Any]:
    try:
        raw = json.loads(read())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise GenerationConfigError(f"cannot read the generation config {where}: {exc}") from exc
    if not isinstance(raw, dict):
        raise GenerationConfigError(f"generation config {where}: expected a JSON object")
    return raw


def _number(where: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise GenerationConfigError(f"generation config {where}: {key} must be a number, got {value!r}")
    return value


def checked(values: dict[str, float], source: str) -> dict[str, float]:
    """``values`` if a request could carry them: a model's bad default is its server's start-up
    error, not every request's 400."""
    for key, low in (("top_k", -1), ("max_tokens", 1)):  # whole numbers in a request
        if key in values and (values[key] != int(values[key]) or values[key] < low):
            raise GenerationConfigError(
                f"generation config ({source}): {key} must be a whole number >= {low}, got {values[key]!r}"
            )
    try:
        SamplingParams(
            max_tokens=int(values.get("max_tokens", 1)),
            temperature=values.get("temperature", 1.0),
            top_p=values.get("top_p", 1.0),
            top_k=max(0, int(values.get("top_k", 0))),
            min_p=values.get("min_p", 0.0),
            repetition_penalty=values.get("repetition_penalty", 1.0),
        )
    except ValueError as exc:
        raise GenerationConfigError(f"generation config ({source}): {exc}") from exc
    return values
