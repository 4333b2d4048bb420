"""Structured output as vLLM's OpenAI server takes it, to one engine constraint per request.

Three ways to ask, as in vLLM: OpenAI's ``response_format`` (``json_object``, or ``json_schema``
with its ``schema``); vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``,
``grammar`` or ``json_object``, with ``whitespace_pattern`` or ``disable_any_whitespace``); and
its older ``guided_json``, ``guided_regex``, ``guided_choice`` and ``guided_grammar``, with
``guided_whitespace_pattern``. A request names one constraint at most. ``guided_decoding_backend``
and ``disable_fallback`` are accepted and change nothing: this server has one backend
(llguidance, one of vLLM's). The grammar itself is compiled as the request arrives
(core/grammar.py), so that one that does not compile is a 400 naming its field.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from llmfleet.server.core.grammar import CACHED_SPEC_CHARS, fits_cache
from llmfleet.server.core.request import StructuredOutput
from llmfleet.server.http.errors import APIError
from llmfleet.server.wire import json_depth


class StructuredOutputError(APIError):
    """A request's structured output (or tool choice) cannot be served as asked: a 400 naming
    ``param``, the field, wherever a route meets it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(400, message, param=param)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema", "structural_tag"] = "text"
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's ``structured_outputs``. An unknown key is a 400: a misspelt one would leave the
    output unconstrained without a word."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    structural_tag: str | None = None


class StructuredOutputFields(BaseModel):
    """The request fields that ask for structured output (the sampling models inherit them)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None

    def structured_output(self) -> tuple[StructuredOutput, str] | None:
        """The one constraint this request asks for and the field that asks, or None. Raises
        StructuredOutputError where it asks for two, or for what is not supported."""
        asked = self._asked()
        if len(asked) > 1:
            fields = ", ".join(field for field, *_ in asked)
            raise StructuredOutputError(f"only one kind of structured output per request, got {fields}", asked[1][0])
        if not asked:
            return None
        field, kind, spec = asked[0]
        whitespace = self.guided_whitespace_pattern
        options = self.structured_outputs
        if options is not None:
            if options.disable_additional_properties:
                raise StructuredOutputError(
                    "structured_outputs.disable_additional_properties is not supported", "structured_outputs"
                )
            if options.whitespace_pattern is not None:
                whitespace = options.whitespace_pattern
            if options.disable_any_whitespace:
                whitespace = ""
        # a megabyte of choices took seconds to compile, and past llguidance's limits answered "":
        # a larger spec than the grammar cache keeps is no real client's
        if not fits_cache(spec, whitespace):
            raise StructuredOutputError(
                f"{field} is too large for structured output: at most {CACHED_SPEC_CHARS} characters (as JSON)", field
            )
        return StructuredOutput(kind, spec, whitespace), field

    def _asked(self) -> list[tuple[str, str, str]]:
        """(field, kind, spec) of every constraint the request names."""
        asked = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asked.append(("response_format", "json_object", ""))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise StructuredOutputError("response_format json_schema needs json_schema.schema", "response_format")
            asked.append(("response_format", "json", json.dumps(fmt.json_schema.schema_)))
        elif fmt is not None and fmt.type == "structural_tag":
            raise StructuredOutputError("response_format structural_tag is not supported", "response_format")
        options = self.structured_outputs
        if options is not None:
            if options.structural_tag is not None:
                raise StructuredOutputError("structured_outputs.structural_tag is not supported", "structured_outputs")
            named = [
                ("json", _schema_text(options.json_, "structured_outputs.json")),
                ("regex", options.regex),
                ("choice", _choice_text(options.choice, "structured_outputs.choice")),
                ("grammar", options.grammar),
                ("json_object", "" if options.json_object else None),
            ]
            asked += [(f"structured_outputs.{kind}", kind, spec) for kind, spec in named if spec is not None]
        legacy = [
            ("guided_json", "json", _schema_text(self.guided_json, "guided_json")),
            ("guided_regex", "regex", self.guided_regex),
            ("guided_choice", "choice", _choice_text(self.guided_choice, "guided_choice")),
            ("guided_grammar", "grammar", self.guided_grammar),
        ]
        return asked + [(field, kind, spec) for field, kind, spec in legacy if spec is not None]


def _schema_text(schema: dict[str, Any] | str | None, field: str) -> str | None:
    if schema is None or isinstance(schema, dict):
        return None if schema is None else json.dumps(schema)
    try:
        parsed = json_depth.loads(schema)
    except ValueError as exc:
        message = f"{field} must be a JSON schema (an object, or its JSON text): {exc}"
        raise StructuredOutputError(message, field) from None
    if not isinstance(parsed, dict):
        raise StructuredOutputError(f"{field} must be a JSON schema (an object), got {type(parsed).__name__}", field)
    return schema


def _choice_text(choice: list[str] | None, field: str) -> str | None:
    if choice is None:
        return None
    if not choice:
        raise StructuredOutputError(f"{field} needs at least one option", field)
    return json.dumps(choice)
