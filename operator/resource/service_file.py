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
    """(name, parsed spec) of the InferenceService in ``source``, in a document of its own or in a
    ``kind: List``'s items, as ``kubectl apply -f`` reads them. A file that is not YAML, that holds
    more than one InferenceService (one fleet runs one), or whose InferenceService's metadata or
    spec is not a mapping, is a ValueError that says so in one line; a spec the operator would
    refuse is its SpecError."""
    try:
        docs = list(yaml.safe_load_all(source.read_text()))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(source)
        raise ValueError(f"{where}: not valid YAML: {exc.problem or exc.context}") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"{source}: not valid YAML: {exc}") from exc
    services = [doc for doc in _objects(docs) if doc.get("kind") == "InferenceService"]
    if not services:
        raise ValueError(f"no InferenceService in {source}")
    if len(services) > 1:
        names = ", ".join(str((doc.get("metadata") or {}).get("name", "?")) for doc in services)
        raise ValueError(f"{source} holds {len(services)} InferenceServices ({names}): one fleet runs one a file")
    doc = services[0]
    metadata, spec = doc.get("metadata") or {}, doc.get("spec") or {}
    for field, value in (("metadata", metadata), ("spec", spec)):
        if not isinstance(value, dict):
            raise ValueError(f"{source}: InferenceService {field} must be a mapping, got {value!r}")
    problems = strict_decoding_problems(spec, spec_schema(), "spec")
    if problems:  # what `kubectl apply` (strict field validation) refuses, not run half-read
        raise ValueError(f"{source}: InferenceService {'; '.join(problems)}")
    return metadata.get("name") or default_name, parse_spec(spec)


def _objects(docs: list[Any]) -> list[dict[str, Any]]:
    """The objects of a file's documents, a ``kind: List``'s items among them."""
    out = []
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == "List" and isinstance(doc.get("items"), list):
            out += [item for item in doc["items"] if isinstance(item, dict)]
        elif isinstance(doc, dict):
            out.append(doc)
    return out


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
