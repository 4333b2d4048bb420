"""Reconcile: a pure function from an InferenceService (spec plus tuner state) to the objects
that should exist. No API calls here; apply.py writes the difference.

Per serving pool (colocated, or prefill and decode): an engine ConfigMap, a Deployment (a
LeaderWorkerSet where a replica spans nodes: leader_worker_set.py; its pods ask for their share of
the replica's GPUs, resource/layout.py), a headless Service (one DNS record per ready pod, a
group's leader only: how the router and direct scraping find pods), a PodDisruptionBudget and a
NetworkPolicy (network_policy.py: the API port takes the router's requests, and a decode server's
KV fetches on a prefill server; the metrics port takes scrapers'). Every mode has the router in
front: its Deployment and PDB, and its own ServiceAccount with a Role that reads the pools'
EndpointSlices (how it finds the pods that are ready, as they come and go) and may stamp one
ConfigMap, ``<name>-wake``, when it holds requests for a pool at zero (the operator watches it). A
disaggregated fleet's roles read the KV-transfer token from the spec's Secret or, where it names
none, from the one kv_secret.py makes. The Service named like the InferenceService is the client
endpoint: the routers. The model servers run as ``<name>-server``, a ServiceAccount of their own
with no token mounted (they never call the API); what an admin allows beyond that (pod_security.py:
another account, the host's namespaces, privileges, capabilities) lands in the engine pools' pods
only. A PodMonitor comes along when the Prometheus operator is installed.

Knob changes only touch each pool's engine ConfigMap, which pods watch and apply live; the pod
template carries a checksum of the start-up-only fields alone, so a knob change never restarts
a pod. Replica changes only touch Deployment.spec.replicas (a LeaderWorkerSet's: its groups).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from llmfleet.operator.reconcile import leader_worker_set as lws
from llmfleet.operator.reconcile.model_storage import model_storage
from llmfleet.operator.reconcile.network_policy import server_policy
from llmfleet.operator.resource import pod_security
from llmfleet.operator.resource.layout import with_gpu_count
from llmfleet.operator.resource.spec import (
    GRACE_MARGIN_SECONDS,
    ContainerSecurity,
    InferenceServiceSpec,
    KVTransferSecret,
    PodOptions,
    Pool,
)
from llmfleet.operator.resource.tuner_state import TunerState, effective_engine, effective_replicas
from llmfleet.server.config import EngineConfig

SERVER_PORT = 8000
METRICS_PORT = 9100  # `serve --metrics-port`: /metrics, /load and the probes only (scrapers, the operator)
CONFIG_DIR = "/etc/llm-fleet"
CONFIG_KEY = "engine.yaml"
PRE_STOP_SECONDS = 5  # endpoints drop the pod before it stops accepting
STARTUP_PROBE_PERIOD = 5  # seconds between /ready checks while a server loads
# The servers' probes past start-up (the local fleet plays them too); timeoutSeconds is 1 where unset
READINESS_PROBE = {"periodSeconds": 5, "failureThreshold": 2}
LIVENESS_PROBE = {"periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3}
RUN_AS_USER = 65532
MODE_ANNOTATION = "llmfleet.io/mode"  # on the router Deployment: the pools it relays to (handover.py)

OWNER_LABEL = "llmfleet.io/inference-service"
POOL_LABEL = "llmfleet.io/pool"
MANAGED_BY = "llm-fleet-operator"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
RESTART_CHECKSUM = "llmfleet.io/restart-checksum"
REPLICAS_OWNER = "llmfleet.io/replicas"  # EXTERNAL on a Deployment: the user's autoscaler owns its replicas
EXTERNAL = "external"


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


def owner_labels(owner: Owner) -> dict[str, str]:
    """On every child: how the operator lists what it owns."""
    return {
        "app.kubernetes.io/name": "llm-fleet",
        "app.kubernetes.io/instance": owner.name,
        MANAGED_BY_LABEL: MANAGED_BY,
        OWNER_LABEL: owner.name,
    }


def labels(owner: Owner, pool: str) -> dict[str, str]:
    return {**owner_labels(owner), "app.kubernetes.io/component": pool, POOL_LABEL: pool}


def selector(owner: Owner, pool: str | None = None) -> dict[str, str]:
    """Pod selector of one pool, or (pool=None) the label query for all of the owner's children."""
    return {OWNER_LABEL: owner.name} if pool is None else {OWNER_LABEL: owner.name, POOL_LABEL: pool}


def serving_selector(owner: Owner, spec: InferenceServiceSpec, pool: str) -> dict[str, str]:
    """The pool's pods that take requests and report metrics: the group leaders where a replica
    spans nodes (leader_worker_set.py), else every pod of the pool."""
    return lws.leader_only(selector(owner, pool), spec.layout(pool))


def workload_kind(spec: InferenceServiceSpec, pool: str) -> str:
    """What runs a pool's replicas: a LeaderWorkerSet where one spans nodes, else a Deployment."""
    return lws.KIND if spec.layout(pool).spans_nodes else "Deployment"


WORKLOAD_KINDS = ("Deployment", lws.KIND)


def live_workload(live: Mapping[str, dict[str, Any]], owner: Owner, pool: str) -> dict[str, Any] | None:
    """A pool's Deployment or LeaderWorkerSet among the live children ("Kind/name" -> object)."""
    name = pool_object_name(owner, pool)
    return next((live[f"{kind}/{name}"] for kind in WORKLOAD_KINDS if f"{kind}/{name}" in live), None)


def pool_object_name(owner: Owner, pool: str) -> str:
    return f"{owner.name}-{pool}"


def wake_config_map_name(owner: Owner) -> str:
    """The ConfigMap a router stamps to ask for servers (server/wire/wake.py)."""
    return f"{owner.name}-wake"


def grace_seconds(drain_seconds: int) -> int:
    """A pod's termination grace period: the preStop sleep, the server's drain, and its exit."""
    return PRE_STOP_SECONDS + drain_seconds + GRACE_MARGIN_SECONDS


def generated_kv_secret(owner: Owner, spec: InferenceServiceSpec) -> KVTransferSecret | None:
    """The KV-transfer token Secret the operator makes (kv_secret.py): a disaggregated fleet's
    whose spec names none; None otherwise (a colocated fleet makes no transfers)."""
    if spec.kv_transfer_secret is not None or spec.mode != "disaggregated":
        return None
    return KVTransferSecret(name=f"{owner.name}-kv-transfer")


def kv_transfer_secret(owner: Owner, spec: InferenceServiceSpec) -> KVTransferSecret | None:
    """Where the pods read their KV-transfer token: the spec's Secret, else the generated one."""
    return spec.kv_transfer_secret or generated_kv_secret(owner, spec)


def desired_objects(
    owner: Owner,
    spec: InferenceServiceSpec,
    tuner: TunerState | None = None,
    *,
    pod_monitor: bool = False,
    pod_monitor_labels: dict[str, str] | None = None,
    serving: str | None = None,
    router_mode: str | None = None,
    scaled: Mapping[str, int] | None = None,
    metrics_peers: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Every object the InferenceService needs. ``pod_monitor``: add a PodMonitor (the Prometheus
    operator is installed), with ``pod_monitor_labels`` on it (how that Prometheus selects them,
    e.g. ``release: kube-prometheus-stack``). ``serving``: the pool the client Service selects
    instead of the routers, ``router_mode``: the pools the routers relay to instead of the spec's
    mode's (a mode switch, handover.py). ``scaled``: each existing Deployment's replicas per pool,
    which stand where an external autoscaler owns them (spec.externalAutoscaler).
    ``metrics_peers``: the labels of the namespaces whose pods may scrape the servers' metrics
    port (None or empty: every namespace)."""
    objects: list[dict[str, Any]] = []
    for pool in spec.active_pools:
        engine = effective_engine(spec, pool, tuner)
        objects.append(_config_map(owner, pool, engine))
        objects.append(_workload(owner, spec, pool, engine, effective_replicas(spec, pool, tuner)))
        serving_pods = serving_selector(owner, spec, pool)
        objects.append(_service(owner, pool_object_name(owner, pool), pool, headless=True, pods=serving_pods))
        objects.append(_pdb(owner, pool))
        objects.append(server_network_policy(owner, spec, pool, metrics_peers or {}))
    objects.append(_server_account(owner))
    objects.extend(_router_account(owner))
    router = _router_deployment(owner, spec, router_mode or spec.mode)
    objects.append(router)
    if spec.router.autoscaled:
        _scaled_externally(router, (scaled or {}).get("router"))
        objects.append(_router_autoscaler(owner, spec))
    objects.append(_pdb(owner, "router"))
    objects.append(_wake_config_map(owner))
    # the client endpoint: the routers, or the old entry pool while a fleet from before the routers
    # fronted every mode hands over to them
    objects.append(_service(owner, owner.name, serving or spec.entry_pool, headless=False))
    if pod_monitor:
        groups = any(spec.layout(pool).spans_nodes for pool in spec.active_pools)
        objects.append(_pod_monitor(owner, pod_monitor_labels or {}, leaders_only=groups))
    if spec.external_autoscaler:
        for deployment in (o for o in objects if o["kind"] in WORKLOAD_KINDS):
            _scaled_externally(deployment, (scaled or {}).get(deployment["metadata"]["labels"][POOL_LABEL]))
    return objects


def _scaled_externally(deployment: dict[str, Any], replicas: int | None) -> None:
    """Replicas as the autoscaler left them (the spec's only for a new Deployment), marked so that
    the applied hash leaves them out: its scaling is no edit to revert, nor a change to apply."""
    deployment["metadata"].setdefault("annotations", {})[REPLICAS_OWNER] = EXTERNAL
    if replicas is not None:
        deployment["spec"]["replicas"] = replicas


def _meta(owner: Owner, name: str, object_labels: dict[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": object_labels,
        "ownerReferences": [owner.reference()],
    }


# Written to the engine ConfigMap and hashed only where a pool's parallelism sets them: a fleet
# without it keeps the file and the checksum it had, so no pod rolls for fields it does not use,
# and a server image older than the fields still reads its file.
SINGLE_DEVICE = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}


def _engine_fields(engine: EngineConfig) -> dict[str, Any]:
    fields = engine.model_dump(mode="json", exclude_none=True)
    return {k: v for k, v in fields.items() if SINGLE_DEVICE.get(k, object()) != v}


def _config_map(owner: Owner, pool: str, engine: EngineConfig) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(owner, f"{pool_object_name(owner, pool)}-engine", labels(owner, pool)),
        "data": {CONFIG_KEY: yaml.safe_dump(_engine_fields(engine), sort_keys=False)},
    }


def restart_checksum(engine: EngineConfig) -> str:
    """Hash of the start-up-only fields: the only engine change that must roll the pods."""
    fields = {
        name: getattr(engine, name)
        for name in sorted(EngineConfig.restart_fields())
        if SINGLE_DEVICE.get(name, object()) != getattr(engine, name)
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _server_container(
    owner: Owner, spec: InferenceServiceSpec, role: str, args: list[str], resources: dict
) -> dict[str, Any]:
    def http_get(path: str) -> dict[str, Any]:
        return {"httpGet": {"path": path, "port": "http"}}

    listen = ["--host", "0.0.0.0", "--port", str(SERVER_PORT), "--metrics-port", str(METRICS_PORT)]
    return {
        "name": "server",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["llm-fleet"],
        "args": ["serve", "--role", role, *listen, *args, "--drain-timeout", str(spec.drain_seconds(role))],
        "ports": [
            {"name": "http", "containerPort": SERVER_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        # Loading weights can take minutes: the startup probe holds liveness off until /ready.
        "startupProbe": {
            **http_get("/ready"),
            "periodSeconds": STARTUP_PROBE_PERIOD,
            "failureThreshold": math.ceil(spec.pod.startup_timeout_seconds / STARTUP_PROBE_PERIOD),
        },
        "readinessProbe": {**http_get("/ready"), **READINESS_PROBE},
        "livenessProbe": {**http_get("/health"), **LIVENESS_PROBE},
        "lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_SECONDS}}},
        "resources": resources,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "env": [
            {"name": "LLMFLEET_CACHE", "value": "/tmp/llm-fleet"},  # built-in models are created here
            {"name": "HOME", "value": "/tmp"},  # the root filesystem is read-only
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            *_secret_env(owner, spec),
            *spec.pod.env,
        ],
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }


def _secret_env(owner: Owner, spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """From Secrets, for every role: VLLM_API_KEY (its --api-key) and the fleet's KV-transfer token."""
    named = (("VLLM_API_KEY", spec.api_key_secret), ("LLMFLEET_KV_TRANSFER_TOKEN", kv_transfer_secret(owner, spec)))
    return [
        {"name": env, "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}}}
        for env, secret in named
        if secret is not None
    ]


def _pod_template(
    owner: Owner,
    pool: str,
    container: dict,
    volumes: list[dict],
    pool_spec: Pool | None,
    pod: PodOptions,
    drain_seconds: int,
) -> dict:
    spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}}, *volumes],
        "terminationGracePeriodSeconds": grace_seconds(drain_seconds),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "automountServiceAccountToken": False,  # the engine servers never call the API
        # Spread replicas over nodes where possible: one node going away takes few of them.
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": selector(owner, pool)},
            }
        ],
    }
    if pool_spec is not None and pool_spec.node_selector:
        spec["nodeSelector"] = dict(pool_spec.node_selector)
    if pool_spec is not None and pool_spec.tolerations:
        spec["tolerations"] = [dict(t) for t in pool_spec.tolerations]
    if pod.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": name} for name in pod.image_pull_secrets]
    if pod.priority_class_name:
        spec["priorityClassName"] = pod.priority_class_name
    if pod.affinity:
        spec["affinity"] = dict(pod.affinity)
    if pool != "router":  # the router reads EndpointSlices with an account of its own, and needs no GPU
        spec["serviceAccountName"] = pod.service_account_name or server_account_name(owner)
        if pod.runtime_class_name:
            spec["runtimeClassName"] = pod.runtime_class_name
        # only where an admin allows them (pod_security.py; converge refuses them otherwise)
        for field, key in (("host_network", "hostNetwork"), ("host_pid", "hostPID"), ("host_ipc", "hostIPC")):
            if getattr(pod, field):
                spec[key] = True
        if pod.host_network:  # the decode servers find the prefill pool through the cluster's DNS
            spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    metadata: dict[str, Any] = {"labels": {**pod.labels, **labels(owner, pool)}}
    if pod.annotations:
        metadata["annotations"] = dict(pod.annotations)
    return {"metadata": metadata, "spec": spec}


def _deployment_object(owner: Owner, pool: str, replicas: int, template: dict, pod: PodOptions) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(owner, pool_object_name(owner, pool), labels(owner, pool)),
        "spec": {
            "replicas": replicas,
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": selector(owner, pool)},
            # By default never below the serving capacity: new pods start before old ones drain.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": pod.max_unavailable, "maxSurge": pod.max_surge},
            },
            "template": template,
        },
    }


def _workload(owner: Owner, spec: InferenceServiceSpec, pool: str, engine: EngineConfig, replicas: int) -> dict:
    """The pool's Deployment, or its LeaderWorkerSet where a replica spans nodes; either way each
    pod asks for its share of the replica's GPUs (layout.py)."""
    pool_spec = spec.pool(pool)
    placed = spec.layout(pool)
    args = [
        *spec.model.server_args,
        "--served-model-name",
        spec.model.name or owner.name,
        "--config",
        f"{CONFIG_DIR}/{CONFIG_KEY}",
    ]
    if pool == "decode":  # the only servers it fetches KV from: the prefill pool's ready pods, by DNS
        args += ["--prefill-host", f"{pool_object_name(owner, 'prefill')}:{SERVER_PORT}"]
    container = _server_container(owner, spec, pool, args, with_gpu_count(pool_spec.resources, placed))
    _grant(container["securityContext"], spec.pod.security_context)
    container["volumeMounts"].append({"name": "engine-config", "mountPath": CONFIG_DIR, "readOnly": True})
    volumes: list[dict] = [{"name": "engine-config", "configMap": {"name": f"{pool_object_name(owner, pool)}-engine"}}]
    storage = model_storage(spec, container["env"], container["securityContext"])
    container["args"].extend(storage.args)
    container["env"].extend(storage.env)
    container["volumeMounts"].extend(storage.mounts)
    volumes.extend(storage.volumes)
    template = _pod_template(owner, pool, container, volumes, pool_spec, spec.pod, spec.drain_seconds(pool))
    if storage.init_containers:
        template["spec"]["initContainers"] = storage.init_containers
    template["metadata"].setdefault("annotations", {})[RESTART_CHECKSUM] = restart_checksum(engine)
    if placed.spans_nodes:
        meta = _meta(owner, pool_object_name(owner, pool), labels(owner, pool))
        return lws.leader_worker_set(meta, replicas, template, placed, spec.pod)
    return _deployment_object(owner, pool, replicas, template, spec.pod)


def _grant(context: dict[str, Any], asked: ContainerSecurity) -> None:
    """What the spec asks past the container defaults, where an admin allows it (pod_security.py):
    a privileged container must allow escalation (the API server refuses privileged with
    allowPrivilegeEscalation false)."""
    if asked.privileged:
        context["privileged"] = True
    if asked.privileged or asked.allow_privilege_escalation:
        context["allowPrivilegeEscalation"] = True
    if asked.capabilities.add:
        context["capabilities"]["add"] = sorted(set(asked.capabilities.add))


ROUTED_POOLS = {"colocated": ("colocated",), "disaggregated": ("prefill", "decode")}  # per mode


def router_args(owner: Owner, spec: InferenceServiceSpec, mode: str) -> list[str]:
    """The router's own flags: the pools' Services it finds servers in (those of ``mode``), its
    policy, how it holds requests for a pool at zero and where it asks for servers."""
    args = ["--served-model-name", spec.model.name or owner.name]
    for pool in ROUTED_POOLS[mode]:
        args += [f"--{pool}-service", pool_object_name(owner, pool)]
    return [
        *args,
        "--router-policy",
        spec.router.policy,
        "--hold-timeout",
        str(spec.router.hold_timeout_seconds),
        "--max-held",
        str(spec.router.max_held_requests),
        "--wake-config-map",
        wake_config_map_name(owner),
    ]


def _router_deployment(owner: Owner, spec: InferenceServiceSpec, mode: str) -> dict[str, Any]:
    container = _server_container(owner, spec, "router", router_args(owner, spec, mode), spec.router.resources)
    template = _pod_template(owner, "router", container, [], None, spec.pod, spec.drain_seconds("router"))
    # Only the router calls the API (EndpointSlices, the wake ConfigMap), with a token of its own account.
    template["spec"]["serviceAccountName"] = router_account_name(owner)
    template["spec"]["automountServiceAccountToken"] = True
    deployment = _deployment_object(owner, "router", spec.router.replicas, template, spec.pod)
    deployment["metadata"]["annotations"] = {MODE_ANNOTATION: mode}
    return deployment


def _router_autoscaler(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    """The routers' HorizontalPodAutoscaler: from ``router.replicas`` to ``router.maxReplicas`` on
    their average CPU use. Scale-down waits HPA's default five minutes, and a router it removes
    drains its streams first (its grace period is its pools' longest stream)."""
    name = pool_object_name(owner, "router")
    target = {"type": "Utilization", "averageUtilization": spec.router.target_cpu_utilization}
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _meta(owner, name, labels(owner, "router")),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": spec.router.replicas,
            "maxReplicas": spec.router.max_replicas,
            "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": target}}],
        },
    }


def router_account_name(owner: Owner) -> str:
    return pool_object_name(owner, "router")


def server_account_name(owner: Owner) -> str:
    return pod_security.server_account_name(owner.name)


def _server_account(owner: Owner) -> dict[str, Any]:
    """The model servers' own identity: not the namespace's default account (which others' pods
    share and an admin may have granted rights), with no token (they never call the API)."""
    meta = _meta(owner, server_account_name(owner), {**owner_labels(owner), "app.kubernetes.io/component": "server"})
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta, "automountServiceAccountToken": False}


def server_network_policy(
    owner: Owner, spec: InferenceServiceSpec, pool: str, metrics_namespaces: dict[str, str]
) -> dict[str, Any]:
    """One pool's servers take API requests from the fleet's routers (and a prefill server KV
    fetches from its decode servers), their metrics port from the given namespaces' pods."""
    peers = [selector(owner, "router")] + ([selector(owner, "decode")] if pool == "prefill" else [])
    meta = _meta(owner, pool_object_name(owner, pool), labels(owner, pool))
    group = selector(owner, pool) if spec.layout(pool).spans_nodes else None
    return server_policy(meta, selector(owner, pool), peers, metrics_namespaces, group=group)


def _wake_config_map(owner: Owner) -> dict[str, Any]:
    """Empty: a router stamps its annotation to ask for servers (the operator answers at once)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(owner, wake_config_map_name(owner), labels(owner, "router")),
    }


def _router_account(owner: Owner) -> list[dict[str, Any]]:
    """ServiceAccount, Role and RoleBinding: the router may read EndpointSlices and stamp its wake
    ConfigMap (that one object: never the InferenceService, whose spec says what pods run)."""
    name = router_account_name(owner)
    meta = _meta(owner, name, labels(owner, "router"))
    rules = [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": [wake_config_map_name(owner)],
            "verbs": ["get", "patch"],
        },
    ]
    rbac = "rbac.authorization.k8s.io"
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta, "automountServiceAccountToken": False},
        {"apiVersion": f"{rbac}/v1", "kind": "Role", "metadata": meta, "rules": rules},
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": rbac, "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
        },
    ]


def client_url(owner: Owner) -> str:
    """Where clients in the cluster send requests: the client Service (KServe's status.url)."""
    return f"http://{owner.name}.{owner.namespace}.svc.cluster.local:{SERVER_PORT}"


def _service(
    owner: Owner, name: str, pool: str, *, headless: bool, pods: dict[str, str] | None = None
) -> dict[str, Any]:
    """``pods``: the pods it sends to, where not every pod of ``pool`` (the leaders of groups)."""
    spec: dict[str, Any] = {
        "selector": pods or selector(owner, pool),
        "ports": [{"name": "http", "port": SERVER_PORT, "targetPort": "http", "protocol": "TCP"}],
    }
    if headless:
        spec["clusterIP"] = "None"
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(owner, name, labels(owner, pool)), "spec": spec}


def _pdb(owner: Owner, pool: str) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(owner, pool_object_name(owner, pool), labels(owner, pool)),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector(owner, pool)},
            # A pod that never became ready may always be evicted (it serves nothing).
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def _pod_monitor(owner: Owner, extra_labels: dict[str, str], *, leaders_only: bool = False) -> dict[str, Any]:
    """Scrape every server and router pod of the owner; ``leaders_only``: not the headless workers
    of a group (leader_worker_set.py), which serve no metrics."""
    pods: dict[str, Any] = {"matchLabels": selector(owner)}
    if leaders_only:
        pods["matchExpressions"] = [{"key": lws.HEADLESS_LABEL, "operator": "DoesNotExist"}]

    def copy_label(source: str, target: str) -> dict[str, Any]:
        return {"sourceLabels": [source], "targetLabel": target, "action": "replace"}

    relabelings = [
        copy_label("__meta_kubernetes_pod_label_llmfleet_io_inference_service", "inference_service"),
        copy_label("__meta_kubernetes_pod_label_llmfleet_io_pool", "pool"),
        copy_label("__meta_kubernetes_namespace", "namespace"),
        copy_label("__meta_kubernetes_pod_name", "pod"),
    ]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": _meta(owner, owner.name, {**extra_labels, **owner_labels(owner)}),
        "spec": {
            "selector": pods,
            "podMetricsEndpoints": [
                {"port": "metrics", "path": "/metrics", "interval": "15s", "relabelings": relabelings}
            ],
        },
    }


class _Dumper(yaml.SafeDumper):
    """Readable manifests: no YAML anchors, multi-line strings (engine.yaml) as literal blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def dump(objects: list[dict[str, Any]]) -> str:
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False)
