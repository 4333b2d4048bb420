"""A rendered ValidatingAdmissionPolicy evaluated offline as the API server does: its
matchConditions, then every validation, each a CEL expression run by cel-python over
``object``, ``oldObject`` and ``request``."""

from __future__ import annotations

from typing import Any

import pytest


def _run(expression: str, activation: dict[str, Any]) -> bool:
    celpy = pytest.importorskip("celpy")
    env = celpy.Environment()
    program = env.program(env.compile(expression))
    return bool(program.evaluate({key: celpy.json_to_cel(value) for key, value in activation.items()}))


def refusals(
    policy: dict[str, Any], obj: dict[str, Any], old: dict[str, Any] | None = None, operation: str = "CREATE"
) -> list[str] | None:
    """The messages of the validations ``obj`` fails (empty: admitted); None where a
    matchCondition leaves the request to pass unchecked."""
    activation = {"object": obj, "oldObject": old, "request": {"operation": operation}}
    for condition in policy["spec"].get("matchConditions") or []:
        if not _run(condition["expression"], activation):
            return None
    return [v["message"] for v in policy["spec"]["validations"] if not _run(v["expression"], activation)]
