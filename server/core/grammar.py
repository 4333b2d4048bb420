"""Structured output's grammars: a request's constraint (``StructuredOutput``) as an llguidance
grammar, and whether it compiles. The engine and the API check a request with it as it arrives;
the runner's grammar_masks.py compiles it against the vocabulary and masks the logits.
"""

from __future__ import annotations

import functools
import json

import llguidance

from .request import StructuredOutput


# Clients send the same schema request after request, and each request is checked twice at
# admission (the API, to name the field; the engine, its guard) and compiled once more at sampling.
@functools.lru_cache(maxsize=256)
def compile_grammar(structured: StructuredOutput) -> str:
    """The llguidance grammar of ``structured``. Raises ValueError where its text is not even
    the right shape (a schema that is not JSON, a choice that is not a list of strings)."""
    kind, spec = structured.kind, structured.spec
    if kind in ("json", "json_object"):
        schema = spec if kind == "json" else '{"type": "object"}'
        pattern = structured.whitespace_pattern
        overrides = {} if pattern is None else {"whitespace_pattern": pattern}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=overrides)
    if kind == "choice":
        choices = json.loads(spec)
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
            raise ValueError("choice must be a non-empty list of strings")
        return llguidance.grammar_from("choice", choices)
    return llguidance.grammar_from("regex" if kind == "regex" else "grammar", spec)


@functools.lru_cache(maxsize=256)
def check(structured: StructuredOutput) -> str | None:
    """Why ``structured`` cannot be compiled, or None where it can."""
    try:
        grammar = compile_grammar(structured)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return llguidance.LLMatcher.validate_grammar(grammar) or None
