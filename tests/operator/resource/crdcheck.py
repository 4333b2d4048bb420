"""Validate a custom resource against the CRD the way the API server does, offline:
apply the schema's defaults, check the structural openAPIV3Schema with `jsonschema`, then run
every CEL `x-kubernetes-validations` rule with cel-python where its value is present."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema

try:
    import celpy
except ImportError:  # pragma: no cover - the test extra installs it
    celpy = None


def version_schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """Defaults land in objects that exist, recursively (the API server's defaulting)."""
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(value[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                if key not in (schema.get("properties") or {}):
                    value[key] = apply_defaults(value[key], extra)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(item, schema["items"]) for item in value]
    return value


def cel_errors(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    if celpy is None:
        return []
    errors = []
    env = celpy.Environment()
    for rule in schema.get("x-kubernetes-validations") or []:
        program = env.program(env.compile(rule["rule"]))
        if not program.evaluate({"self": celpy.json_to_cel(value)}):
            errors.append(f"{path or '.'}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                errors += cel_errors(value[key], sub, f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            errors += cel_errors(item, schema["items"], f"{path}[{index}]")
    return errors


def validate(doc: dict[str, Any], crd: dict[str, Any]) -> list[str]:
    """Everything the API server would reject in `doc`, as messages (empty: accepted)."""
    schema = version_schema(crd)
    doc = apply_defaults(copy.deepcopy(doc), schema)
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
    return errors or cel_errors(doc, schema)


def pruned(value: Any, schema: dict[str, Any]) -> Any:
    """``value`` as the API server stores it: fields the schema does not declare are dropped,
    except under x-kubernetes-preserve-unknown-fields."""
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [pruned(item, schema["items"]) for item in value]
    if not isinstance(value, dict):
        return value
    properties = schema.get("properties") or {}
    extra = schema.get("additionalProperties")
    out = {}
    for key, item in value.items():
        if key in properties:
            out[key] = pruned(item, properties[key])
        elif isinstance(extra, dict):
            out[key] = pruned(item, extra)
        elif schema.get("x-kubernetes-preserve-unknown-fields"):
            out[key] = item
    return out
