"""Reconcile: a pure function from an InferenceService (spec plus tuner state) to the objects
that should exist. No API calls here; handlers.py applies the result idempotently.

Knob changes only touch each pool's engine ConfigMap, which pods watch and apply live; the pod
template carries a checksum of the start-up-only fields alone, so a knob change never restarts
a pod. Replica changes only touch Deployment.spec.replicas.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import yaml

from llmfleet.server.config import EngineConfig

from .spec import TUNABLE_KNOBS, InferenceServiceSpec

SERVER_PORT = 8000
CONFIG_DIR = "/etc/llm-fleet"
CONFIG_KEY = "engine.yaml"
MODELS_DIR = "/models"
DRAIN_SECONDS = 30


@dataclass
class TunerState:
    """What the tuner owns: current replicas and knobs per pool (spec bounds still win)."""

    replicas: dict[str, int] = field(default_factory=dict)
    knobs: dict[str, dict[str, float]] = field(default_factory=dict)  # pool -> camelCase knob -> value

    @classmethod
    def from_status(cls, status: dict[str, Any] | None) -> TunerState:
        tuner = (status or {}).get("tuner") or {}
        return cls(replicas=dict(tuner.get("replicas") or {}), knobs=dict(tuner.get("knobs") or {}))


@dataclass(frozen=True)
class Owner:
    name: str
    namespace: str
    uid: str
    api_version: str = "llmfleet.io/v1alpha1"
    kind: str = "InferenceService"

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def labels(owner: Owner, pool: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "llm-fleet",
        "app.kubernetes.io/instance": owner.name,
        "app.kubernetes.io/component": pool,
        "app.kubernetes.io/managed-by": "llm-fleet-operator",
        "llmfleet.io/inference-service": owner.name,
        "llmfleet.io/pool": pool,
    }


def selector(owner: Owner, pool: str) -> dict[str, str]:
    return {"llmfleet.io/inference-service": owner.name, "llmfleet.io/pool": pool}


def pool_object_name(owner: Owner, pool: str) -> str:
    return f"{owner.name}-{pool}"


def effective_engine(spec: InferenceServiceSpec, pool: str, tuner: TunerState | None) -> EngineConfig:
    """The pool's engine config: spec knobs, overridden by the tuner's, clamped to spec bounds."""
    pool_spec = spec.pool(pool)
    config = pool_spec.engine_config()
    updates: dict[str, Any] = {}
    tuned = (tuner.knobs.get(pool) if tuner else None) or {}
    for knob, attr in TUNABLE_KNOBS.items():
        value = tuned.get(knob, getattr(config, attr))
        bound = pool_spec.bounds.get(knob)
        if bound is not None:
            value = bound.clamp(value)
        updates[attr] = type(getattr(config, attr))(value)
    return config.model_copy(update=updates)


def effective_replicas(spec: InferenceServiceSpec, pool: str, tuner: TunerState | None) -> int:
    pool_spec = spec.pool(pool)
    wanted = tuner.replicas.get(pool) if tuner and pool in tuner.replicas else pool_spec.initial_replicas
    return max(pool_spec.min_replicas, min(pool_spec.max_replicas, int(wanted)))


def desired_objects(
    owner: Owner,
    spec: InferenceServiceSpec,
    tuner: TunerState | None = None,
    *,
    pod_monitor: bool = False,
) -> list[dict[str, Any]]:
    objects: list[dict[str, Any]] = []
    for pool in spec.active_pools:
        engine = effective_engine(spec, pool, tuner)
        objects.append(_config_map(owner, pool, engine))
        objects.append(_deployment(owner, spec, pool, engine, effective_replicas(spec, pool, tuner)))
        objects.append(_service(owner, pool_object_name(owner, pool), pool))
        objects.append(_pdb(owner, pool))
    entry = "colocated"
    if spec.mode == "disaggregated":
        entry = "router"
        objects.append(_router_deployment(owner, spec))
        objects.append(_service(owner, pool_object_name(owner, "router"), "router"))
    objects.append(_service(owner, owner.name, entry))  # the client-facing endpoint
    if pod_monitor:
        objects.append(_pod_monitor(owner))
    return objects


def _meta(owner: Owner, name: str, pool: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels(owner, pool),
        "ownerReferences": [owner.reference()],
        **extra,
    }


def _config_map(owner: Owner, pool: str, engine: EngineConfig) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(owner, f"{pool_object_name(owner, pool)}-engine", pool),
        "data": {CONFIG_KEY: engine.to_yaml()},
    }


def restart_checksum(engine: EngineConfig) -> str:
    """Hash of the start-up-only fields: the only engine change that must roll the pods."""
    fields = {name: getattr(engine, name) for name in sorted(EngineConfig.restart_fields())}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _server_container(spec: InferenceServiceSpec, role: str, args: list[str], resources: dict) -> dict[str, Any]:
    probe = {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5, "failureThreshold": 2}
    return {
        "name": "server",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "args": ["serve", "--role", role, "--host", "0.0.0.0", "--port", str(SERVER_PORT), *args],
        "ports": [{"name": "http", "containerPort": SERVER_PORT, "protocol": "TCP"}],
        "readinessProbe": probe,
        "startupProbe": {**probe, "periodSeconds": 5, "failureThreshold": 120},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "failureThreshold": 3},
        "lifecycle": {"preStop": {"sleep": {"seconds": 5}}},  # let endpoints drop the pod first
        "resources": resources,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "env": [{"name": "LLMFLEET_CACHE", "value": "/tmp/llm-fleet"}],
    }


def _pod_spec(containers: list[dict], volumes: list[dict], pool_spec=None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": containers,
        "volumes": [{"name": "tmp", "emptyDir": {}}, *volumes],
        "terminationGracePeriodSeconds": DRAIN_SECONDS + 15,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "seccompProfile": {"type": "RuntimeDefault"}},
    }
    for container in containers:
        container.setdefault("volumeMounts", []).insert(0, {"name": "tmp", "mountPath": "/tmp"})
    if pool_spec is not None and pool_spec.node_selector:
        spec["nodeSelector"] = dict(pool_spec.node_selector)
    if pool_spec is not None and pool_spec.tolerations:
        spec["tolerations"] = list(pool_spec.tolerations)
    return spec


def _deployment(owner: Owner, spec: InferenceServiceSpec, pool: str, engine: EngineConfig, replicas: int) -> dict:
    name = pool_object_name(owner, pool)
    pool_spec = spec.pool(pool)
    args = [
        "--model",
        spec.model.server_arg,
        "--served-model-name",
        spec.model.name or owner.name,
        "--config",
        f"{CONFIG_DIR}/{CONFIG_KEY}",
        "--drain-timeout",
        str(DRAIN_SECONDS),
    ]
    container = _server_container(spec, pool, args, pool_spec.resources)
    container["volumeMounts"] = [{"name": "engine-config", "mountPath": CONFIG_DIR, "readOnly": True}]
    volumes: list[dict] = [{"name": "engine-config", "configMap": {"name": f"{name}-engine"}}]
    if spec.model.volume:
        volumes.append({"name": "models", **spec.model.volume})
        container["volumeMounts"].append({"name": "models", "mountPath": MODELS_DIR, "readOnly": True})
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(owner, name, pool),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector(owner, pool)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {
                    "labels": labels(owner, pool),
                    "annotations": {"llmfleet.io/restart-checksum": restart_checksum(engine)},
                },
                "spec": _pod_spec([container], volumes, pool_spec),
            },
        },
    }


def _router_deployment(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    args = [
        "--served-model-name",
        spec.model.name or owner.name,
        "--prefill-service",
        pool_object_name(owner, "prefill"),
        "--decode-service",
        pool_object_name(owner, "decode"),
        "--router-policy",
        spec.router.policy,
    ]
    container = _server_container(spec, "router", args, spec.router.resources)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(owner, pool_object_name(owner, "router"), "router"),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": selector(owner, "router")},
            "template": {"metadata": {"labels": labels(owner, "router")}, "spec": _pod_spec([container], [])},
        },
    }


def _service(owner: Owner, name: str, pool: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, name, pool),
        "spec": {
            "selector": selector(owner, pool),
            "ports": [{"name": "http", "port": SERVER_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def _pdb(owner: Owner, pool: str) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(owner, pool_object_name(owner, pool), pool),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(owner, pool)}},
    }


def _pod_monitor(owner: Owner) -> dict[str, Any]:
    relabel = [
        {
            "sourceLabels": ["__meta_kubernetes_pod_label_llmfleet_io_inference_service"],
            "targetLabel": "inference_service",
        },
        {"sourceLabels": ["__meta_kubernetes_pod_label_llmfleet_io_pool"], "targetLabel": "pool"},
        {"sourceLabels": ["__meta_kubernetes_namespace"], "targetLabel": "namespace"},
    ]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": _meta(owner, owner.name, "all"),
        "spec": {
            "selector": {"matchLabels": {"llmfleet.io/inference-service": owner.name}},
            "podMetricsEndpoints": [{"port": "http", "path": "/metrics", "interval": "15s", "relabelings": relabel}],
        },
    }


def dump(objects: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(objects, sort_keys=False)
