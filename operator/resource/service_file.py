"""An InferenceService from a YAML file, the one `kubectl apply -f` would take: what the local
fleet (`llm-fleet up -f`) and the simulator (`llm-fleet sim -f`) run."""

from __future__ import annotations

from importlib.resources.abc import Traversable
from typing import Any

import yaml

from llmfleet.operator.resource.crd import spec_schema
from llmfleet.operator.resource.spec import InferenceServiceSpec, parse_spec

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "boolean": (bool,),
    "integer": (int,),
    "number": (int, float),
}


def read_service(source: Traversable, default_name: str) -> tuple[str, InferenceServiceSpec]:
    """(name, parsed spec) of the first InferenceService in ``source``. A file that is not YAML,
    or an InferenceService whose metadata or spec is not a mapping, is a ValueError that says
    so; a spec the operator would refuse is its SpecError."""
    try:
        docs = list(yaml.safe_load_all(source.read_text()))
    except yaml.YAMLError as exc:
        raise ValueError(f"{source}: not valid YAML: {exc}") from exc
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == "InferenceService":
            metadata, spec = doc.get("metadata") or {}, doc.get("spec") or {}
            for field, value in (("metadata", metadata), ("spec", spec)):
                if not isinstance(value, dict):
                    raise ValueError(f"{source}: InferenceService {field} must be a mapping, got {value!r}")
            problems = strict_decoding_problems(spec, spec_schema(), "spec")
            if problems:  # what `kubectl apply` (strict field validation) refuses, not run half-read
                raise ValueError(f"{source}: InferenceService {'; '.join(problems)}")
            return metadata.get("name") or default_name, parse_spec(spec)
    raise ValueError(f"no InferenceService in {source}")


def strict_decoding_problems(value: Any, schema: dict[str, Any], path: str) -> list[str]:
    """Fields the CRD's schema does not declare and values of the wrong JSON type, as the API
    server's strict field validation reports them (``kubectl apply`` refuses both): a typo such
    as ``minReplica`` would otherwise be dropped without a word, and ``"1"`` read as 1."""
    if value is None:
        return []
    wanted = schema.get("type")
    if schema.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, int | str):
            return [f"{path}: must be an integer or a string, got {value!r}"]
    elif wanted in _JSON_TYPES and not _is_a(value, wanted):
        return [f"{path}: must be {'an' if wanted[0] in 'aeiou' else 'a'} {wanted}, got {value!r}"]
    problems: list[str] = []
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            problems += strict_decoding_problems(item, schema["items"], f"{path}[{i}]")
    elif isinstance(value, dict) and not schema.get("x-kubernetes-preserve-unknown-fields"):
        properties, extra = schema.get("properties") or {}, schema.get("additionalProperties")
        for key, item in value.items():
            if key in properties:
                problems += strict_decoding_problems(item, properties[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                problems += strict_decoding_problems(item, extra, f"{path}.{key}")
            else:
                problems.append(f'unknown field "{path}.{key}"')
    return problems


def _is_a(value: Any, json_type: str) -> bool:
    if isinstance(value, bool):  # a bool is an int to Python, not to JSON
        return json_type == "boolean"
    return isinstance(value, _JSON_TYPES[json_type])
