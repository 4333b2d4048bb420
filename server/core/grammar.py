"""Structured output's grammars: a request's constraint (``StructuredOutput``) as an llguidance
grammar, and whether it compiles. The engine and the API check a request with it as it arrives;
the runner's grammar_masks.py compiles it against the vocabulary and masks the logits.

A constraint with ``thinking`` holds only a reasoning model's answer: the grammar is the
constraint's, named ``answer``, behind a lazy lexeme that takes any text up to the first
``</think>`` (lazy: it ends there, so thinking cannot run past its close). The tags are matched as
text, so one token or several alike, as long as the tokenizer does not mark them special (R1's
and Qwen3's do not). Thinking may be any text but cannot end the reply: the answer must follow.
"""

from __future__ import annotations

import functools
import json

import llguidance

from llmfleet.server.core.request import JSON_KINDS, StructuredOutput

_THINKING = {  # THINKING_MODES -> the top grammar in front of the answer's
    "open": "start: think @answer\nthink[lazy]: /(?s:.*)<\\/think>/",
    "leading": "start: @answer | think @answer\nthink[lazy]: /[ \\t\\r\\n]*<think>(?s:.*)<\\/think>/",
}


# Clients send the same schema request after request, and each request is checked twice at
# admission (the API, to name the field; the engine, its guard) and compiled once more at sampling.
# An entry holds the client's spec and its grammar after the request ended: only specs up to
# CACHED_SPEC_CHARS are kept, or 256 distinct megabyte regexes would pin half a gigabyte.
CACHE_ENTRIES = 256
CACHED_SPEC_CHARS = 64 * 1024


def compile_grammar(structured: StructuredOutput) -> str:
    """The llguidance grammar of ``structured``. Raises ValueError where its text is not even
    the right shape (a schema that is not JSON, a choice that is not a list of strings)."""
    return (_compile_cached if _cacheable(structured) else _compile)(structured)


def check(structured: StructuredOutput) -> str | None:
    """Why ``structured`` cannot be compiled, or None where it can."""
    return (_check_cached if _cacheable(structured) else _check)(structured)


def fits_cache(spec: str, whitespace_pattern: str | None) -> bool:
    """Whether a spec is small enough for the caches (the API refuses larger ones)."""
    return len(spec) + len(whitespace_pattern or "") <= CACHED_SPEC_CHARS


def _cacheable(structured: StructuredOutput) -> bool:
    return fits_cache(structured.spec, structured.whitespace_pattern)


def _compile(structured: StructuredOutput) -> str:
    answer = _answer_grammar(structured)
    if structured.thinking is None:
        return answer
    grammars = [{"lark_grammar": _THINKING[structured.thinking]}, _subgrammar(answer) | {"name": "answer"}]
    return json.dumps({"grammars": grammars})


def _subgrammar(grammar: str) -> dict:
    """One entry of llguidance's grammar list: a JSON schema's or a regex's comes as a list of one,
    a Lark (or converted GBNF) grammar as its text."""
    try:
        listed = json.loads(grammar)
    except ValueError:
        listed = None
    if isinstance(listed, dict) and len(listed.get("grammars") or []) == 1:
        return listed["grammars"][0]
    return {"lark_grammar": grammar}


def _answer_grammar(structured: StructuredOutput) -> str:
    kind, spec = structured.kind, structured.spec
    if kind in JSON_KINDS:
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


def _check(structured: StructuredOutput) -> str | None:
    try:
        grammar = compile_grammar(structured)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return llguidance.LLMatcher.validate_grammar(grammar) or None


_compile_cached = functools.lru_cache(maxsize=CACHE_ENTRIES)(_compile)
_check_cached = functools.lru_cache(maxsize=CACHE_ENTRIES)(_check)
