"""Generate crds/inferenceservice.yaml. The engine knob schema comes from the server's
EngineConfig, so the CRD can never drift from what the pods accept.

    python -m llmfleet.operator.crdgen > crds/inferenceservice.yaml
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from llmfleet.server.config import EngineConfig

GROUP = "llmfleet.io"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SHORT_NAMES = ["llmis", "llmsvc"]
TUNABLE_KNOBS = ["maxBatchSize", "batchTimeoutMs", "maxNumBatchedTokens"]


def engine_schema() -> dict[str, Any]:
    """EngineConfig's fields as a structural schema (camelCase, no $refs, no nulls)."""
    source = EngineConfig.model_json_schema(by_alias=True)
    defs = source.get("$defs", {})
    props = {}
    for name, field in source["properties"].items():
        props[name] = _structural(field, defs)
    return {
        "type": "object",
        "description": "Engine knobs (server/config.py). Live knobs change without a pod restart.",
        "properties": props,
    }


def _structural(field: dict, defs: dict) -> dict:
    field = dict(field)
    if "$ref" in field:
        field = {**defs[field.pop("$ref").split("/")[-1]], **field}
    if "anyOf" in field:  # Optional[X]: keep X (absent means default)
        options = [o for o in field.pop("anyOf") if o.get("type") != "null"]
        field = {**_structural(options[0], defs), **field}
    out: dict[str, Any] = {}
    for key in ("type", "enum", "minimum", "maximum", "exclusiveMinimum", "description"):
        if key in field:
            out[key] = field[key]
    if "const" in field:
        out["enum"] = [field["const"]]
    if "default" in field and field["default"] is not None:
        out["default"] = field["default"]
    if field.get("restart"):
        out["description"] = out.get("description", "") + " (start-up only: changing it restarts pods)"
    if out.get("type") == "number" and isinstance(out.get("default"), int):
        out["default"] = float(out["default"])
    return out


def _bounds() -> dict[str, Any]:
    bound = {
        "type": "object",
        "properties": {"min": {"type": "number", "minimum": 0}, "max": {"type": "number", "minimum": 0}},
        "x-kubernetes-validations": [
            {"rule": "!has(self.min) || !has(self.max) || self.min <= self.max", "message": "min must be <= max"}
        ],
    }
    return {
        "type": "object",
        "description": "Range each tunable knob must stay within; the tuner never crosses it.",
        "properties": {knob: bound for knob in TUNABLE_KNOBS},
    }


def _preserve(description: str) -> dict[str, Any]:
    return {"type": "object", "description": description, "x-kubernetes-preserve-unknown-fields": True}


def pool_schema(default_replicas: int) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "minReplicas": {"type": "integer", "minimum": 0, "default": default_replicas},
            "maxReplicas": {"type": "integer", "minimum": 1, "default": max(4, default_replicas)},
            "replicas": {"type": "integer", "minimum": 0, "description": "Initial replicas (default minReplicas)."},
            "resources": _preserve("Container resources (requests/limits, e.g. nvidia.com/gpu)."),
            "engine": engine_schema(),
            "bounds": _bounds(),
            "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
            "tolerations": {"type": "array", "items": _preserve("A toleration.")},
        },
        "x-kubernetes-validations": [
            {"rule": "self.minReplicas <= self.maxReplicas", "message": "minReplicas must be <= maxReplicas"},
            {
                "rule": "!has(self.replicas) || "
                "(self.replicas >= self.minReplicas && self.replicas <= self.maxReplicas)",
                "message": "replicas must lie within [minReplicas, maxReplicas]",
            },
        ],
    }


def spec_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["model", "slo"],
        "properties": {
            "model": {
                "type": "object",
                "description": "What to serve: a built-in test model, or a path (usually on a mounted volume).",
                "properties": {
                    "name": {
                        "type": "string",
                        "description": "Model id in the OpenAI API (default: the resource name).",
                    },
                    "builtin": {"type": "string", "enum": ["tiny", "small"]},
                    "path": {
                        "type": "string",
                        "description": "Model directory inside the container, e.g. /models/llama.",
                    },
                    "volume": _preserve("A Kubernetes volume source mounted read-only at /models."),
                },
                "x-kubernetes-validations": [
                    {"rule": "has(self.builtin) != has(self.path)", "message": "set exactly one of builtin or path"}
                ],
            },
            "image": {"type": "string", "default": "ghcr.io/llm-fleet/llm-fleet:0.1.0"},
            "imagePullPolicy": {
                "type": "string",
                "enum": ["Always", "IfNotPresent", "Never"],
                "default": "IfNotPresent",
            },
            "slo": {
                "type": "object",
                "required": ["ttftP95Ms", "itlP95Ms"],
                "properties": {
                    "ttftP95Ms": {"type": "number", "minimum": 1, "description": "p95 time to first token."},
                    "itlP95Ms": {"type": "number", "minimum": 1, "description": "p95 inter-token latency."},
                },
            },
            "mode": {"type": "string", "enum": ["colocated", "disaggregated"], "default": "colocated"},
            "pools": {
                "type": "object",
                "default": {},
                "properties": {
                    "colocated": pool_schema(1),
                    "prefill": pool_schema(1),
                    "decode": pool_schema(1),
                },
            },
            "autotune": {
                "type": "object",
                "default": {},
                "properties": {
                    "enabled": {"type": "boolean", "default": True},
                    "intervalSeconds": {"type": "integer", "minimum": 5, "default": 30},
                    "scaleUpStabilizationSeconds": {"type": "integer", "minimum": 0, "default": 0},
                    "scaleDownStabilizationSeconds": {"type": "integer", "minimum": 0, "default": 300},
                    "cooldownSeconds": {"type": "integer", "minimum": 0, "default": 60},
                    "headroom": {"type": "number", "minimum": 0, "maximum": 0.9, "default": 0.2},
                    "prometheusUrl": {"type": "string", "description": "Override the operator's Prometheus URL."},
                },
            },
            "router": {
                "type": "object",
                "default": {},
                "properties": {
                    "replicas": {"type": "integer", "minimum": 1, "default": 1},
                    "policy": {"type": "string", "enum": ["load", "round-robin"], "default": "load"},
                    "resources": _preserve("Router container resources."),
                },
            },
        },
        "x-kubernetes-validations": [
            {
                "rule": "self.mode != 'disaggregated' || (has(self.pools.prefill) && has(self.pools.decode))",
                "message": "disaggregated mode needs pools.prefill and pools.decode",
            }
        ],
    }


def status_schema() -> dict[str, Any]:
    condition = {
        "type": "object",
        "required": ["type", "status"],
        "properties": {
            "type": {"type": "string"},
            "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
            "reason": {"type": "string"},
            "message": {"type": "string"},
            "lastTransitionTime": {"type": "string", "format": "date-time"},
            "observedGeneration": {"type": "integer"},
        },
    }
    return {
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
        "properties": {
            "conditions": {"type": "array", "items": condition},
            "observedGeneration": {"type": "integer"},
            "ready": {"type": "string", "description": "Ready replicas / desired, all pools."},
            "pools": _preserve("Per pool: replicas, readyReplicas, knobs."),
            "latency": _preserve("Last measured p95 TTFT / ITL / queue time (ms) and when."),
            "lastDecision": _preserve("The tuner's last decision: what changed, why, from which numbers."),
            "tuner": _preserve("Tuner state (replicas and knobs it owns)."),
        },
    }


def crd() -> dict[str, Any]:
    columns = [
        ("Mode", "string", ".spec.mode"),
        ("Ready", "string", ".status.ready"),
        ("Prefill", "integer", ".status.pools.prefill.replicas"),
        ("Decode", "integer", ".status.pools.decode.replicas"),
        ("Batch", "integer", ".status.pools.decode.knobs.maxBatchSize"),
        ("TTFT-p95", "number", ".status.latency.ttftP95Ms"),
        ("ITL-p95", "number", ".status.latency.itlP95Ms"),
        ("Age", "date", ".metadata.creationTimestamp"),
    ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": SHORT_NAMES,
                "categories": ["llm-fleet"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [{"name": n, "type": t, "jsonPath": p} for n, t, p in columns],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "An LLM serving fleet held to latency SLOs at the lowest cost.",
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema(),
                                "status": status_schema(),
                            },
                        }
                    },
                }
            ],
        },
    }


def render() -> str:
    header = "# Generated by `python -m llmfleet.operator.crdgen`; do not edit by hand.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=120)


if __name__ == "__main__":
    sys.stdout.write(render())
