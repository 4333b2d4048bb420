"""An InferenceService from a YAML file, the one `kubectl apply -f` would take: what the local
fleet (`llm-fleet up -f`) and the simulator (`llm-fleet sim -f`) run."""

from __future__ import annotations

from importlib.resources.abc import Traversable

import yaml

from .spec import InferenceServiceSpec, parse_spec


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
            return metadata.get("name") or default_name, parse_spec(spec)
    raise ValueError(f"no InferenceService in {source}")
