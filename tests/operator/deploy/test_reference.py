"""The InferenceService reference page: generated from the CRD schema (no drift), every field listed."""

from __future__ import annotations

import re
from typing import Any

from llmfleet.operator.deploy.reference import render
from llmfleet.operator.resource.crd import crd

PAGE = "docs/reference/inferenceservice.md"


def test_committed_reference_is_generated(repo_root):
    assert (repo_root / PAGE).read_text() == render(), (
        f"{PAGE} is stale: run `python -m llmfleet.operator.deploy.reference > {PAGE}`"
    )


def sections(page: str) -> dict[str, str]:
    """Each object's section, by the path in its heading."""
    return {m[1]: m[2] for m in re.finditer(r"^## `([^`]+)`\n(.*?)(?=^## |\Z)", page, re.M | re.S)}


def check(schema: dict[str, Any], path: str, parent: str, field: str, listed: dict[str, str]) -> None:
    """Every field of the object at path has a row in its section, or in the section of the object
    it repeats, which its row in the parent's table names."""
    if schema.get("properties"):
        own = listed.get(path)
        if own is None:
            row = re.search(rf"^\| `{re.escape(field)}`.*fields as \[`([^`]+)`\]", listed[parent], re.M)
            assert row, f"{path}: neither a section nor a link to the object it repeats"
            own = listed[row[1]]
        for key, sub in schema["properties"].items():
            assert f"| `{key}`" in own, f"{path}.{key} has no row"
            if path in listed:  # a repeat's children are the first's, checked there
                check(sub, f"{path}.{key}", path, key, listed)
    for key, suffix in (("items", "[]"), ("additionalProperties", ".*")):
        if isinstance(schema.get(key), dict):
            check(schema[key], path + suffix, parent, field, listed)


def test_every_field_has_a_row():
    listed = sections(render())
    root = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for name in ("spec", "status"):
        check(root["properties"][name], name, "", name, listed)


def test_links_point_at_sections():
    page = render()
    anchors = {re.sub(r"[^\w-]", "", path).lower() for path in sections(page)}
    targets = re.findall(r"\]\(#([\w-]+)\)", page)
    assert targets and set(targets) <= anchors
