"""Generate crds/inferenceservice.yaml. The engine knob schema comes from the server's
EngineConfig, so the CRD can never drift from what the pods accept.

    python -m llmfleet.operator.resource.crd > crds/inferenceservice.yaml

Every field has a type and a description (`kubectl explain llmis.spec.pools.decode.bounds`);
cross-field rules are CEL `x-kubernetes-validations`, enforced by the API server (1.25+). The
operator re-checks what it needs (spec.py) and reports a Degraded condition instead of crashing.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from llmfleet.operator.resource.spec import (
    CHAT_TEMPLATE_MAX,
    DRAIN_MARGIN_SECONDS,
    DRAIN_STEPS_SECONDS,
    GRACE_MARGIN_SECONDS,
    MAX_NAME_LENGTH,
    NAME_PATTERN,
    PARALLEL_FIELDS,
    PATH_MAX,
    QUANTITY,
    REASONING_PARSERS,
    ROUTER_POLICIES,
    SLO_MAX_MS,
    STARTUP_TIMEOUT_MAX_SECONDS,
    TOOL_CALL_PARSERS,
    TUNABLE_KNOBS,
)
from llmfleet.operator.resource.spec import DNS_SUBDOMAIN as DNS_NAME
from llmfleet.server.config import DTYPE_ALIASES, EngineConfig

GROUP = "llmfleet.io"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SHORT_NAMES = ["llmis", "llmsvc"]
MIN_LE_MAX = "!has(self.min) || !has(self.max) || self.min <= self.max"
# model.uri as the API server checks it (RE2); spec.py's parse_uri checks the Hub's finer rules too.
MODEL_URI = r"^(hf://[A-Za-z0-9_][\w.-]*(/[\w.-]+)?(@[\w.-]+(/[\w.-]+)*)?|pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/\S*)?)$"


def _obj(description: str, properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "description": description, "properties": properties, **extra}


def _int(description: str, minimum: int | None = None, default: int | None = None, **extra: Any) -> dict:
    out: dict[str, Any] = {"type": "integer", "description": description, **extra}
    if minimum is not None:
        out["minimum"] = minimum
    if default is not None:
        out["default"] = default
    return out


def _str(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **extra}


# The API server's rules for the names a pod refers to (a Secret, a ServiceAccount, a class) and for
# a Secret's keys: refused here, by kubectl apply, rather than in the Deployment after other objects.
DNS_SUBDOMAIN = {"pattern": f"^{DNS_NAME}$", "maxLength": 253}
SECRET_KEY = {"pattern": r"^[-._a-zA-Z0-9]+$", "maxLength": 253}


def _name(description: str, **extra: Any) -> dict[str, Any]:
    return _str(description, **DNS_SUBDOMAIN, **extra)


def _map(description: str, values: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "description": description, "additionalProperties": values}


def _preserve(description: str) -> dict[str, Any]:
    return {"type": "object", "description": description, "x-kubernetes-preserve-unknown-fields": True}


# -- engine knobs ---------------------------------------------------------------------------------


def engine_schema() -> dict[str, Any]:
    """EngineConfig's fields as a structural schema (camelCase, no $refs, no nulls)."""
    source = EngineConfig.model_json_schema(by_alias=True)
    defs = source.get("$defs", {})
    props = {name: _structural(field, defs) for name, field in source["properties"].items()}
    props["dtype"]["enum"] = [*props["dtype"]["enum"], *DTYPE_ALIASES]  # vLLM's spellings, as the server takes them
    for name, axis in PARALLEL_FIELDS.items():
        if name in props:  # in the schema, so the pool's rule can refuse it by name; no default, which would set it
            props[name].pop("default", None)
            props[name]["description"] = f"Set by parallelism.{axis}: refused here."
    return _obj(
        "Initial engine knobs of this pool (the server's EngineConfig, camelCase). The operator writes "
        "them to the pool's engine ConfigMap; pods apply live knobs at their next step, without a restart. "
        "Start-up-only knobs roll the pods.",
        props,
    )


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
        out["description"] = out.get("description", "") + " Start-up only: changing it restarts the pool's pods."
    if out.get("type") == "number" and isinstance(out.get("default"), int):
        out["default"] = float(out["default"])
    return out


def _bounds() -> dict[str, Any]:
    def bound(knob: str) -> dict[str, Any]:
        return _obj(
            f"Range of {knob} (inclusive). A side left out is the tuner's default (widened to take in the "
            "initial value), or the engine's own limit where the given side lies beyond that default; the "
            "range must hold a value the engine accepts.",
            {"min": {"type": "number", "minimum": 0}, "max": {"type": "number", "minimum": 0}},
            **{"x-kubernetes-validations": [{"rule": MIN_LE_MAX, "message": "min must be <= max"}]},
        )

    return _obj(
        "Range each tunable knob must stay within: the tuner never crosses it, and an initial knob outside "
        "it is clamped.",
        {knob: bound(knob) for knob in TUNABLE_KNOBS},
    )


# -- Kubernetes types the spec embeds -------------------------------------------------------------

_QUANTITY = {
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "x-kubernetes-int-or-string": True,
    # The API server's own quantity pattern, as in the built-in types' CRD schemas, less the leading
    # minus: a Deployment asking for a negative amount would be refused after the other objects land.
    "pattern": r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$",
}


def _resources(what: str) -> dict[str, Any]:
    return _obj(
        f"Compute resources of {what} (a Kubernetes ResourceRequirements), e.g. limits nvidia.com/gpu: 1.",
        {
            "limits": _map("Maximum amount of each resource.", _QUANTITY),
            "requests": _map("Amount of each resource the scheduler reserves.", _QUANTITY),
        },
    )


TAINT_EFFECTS = ["NoSchedule", "PreferNoSchedule", "NoExecute"]


def _tolerations() -> dict[str, Any]:
    toleration = _obj(
        "A Kubernetes toleration.",
        {
            "key": _str("Taint key; empty with operator Exists matches all taints."),
            "operator": _str("How key and value match.", enum=["Exists", "Equal"]),
            "value": _str("Taint value (operator Equal)."),
            "effect": _str("Taint effect to tolerate (empty: all).", enum=TAINT_EFFECTS),
            "tolerationSeconds": _int("How long a NoExecute taint is tolerated."),
        },
    )
    description = "Tolerations for this pool's pods (e.g. GPU node taints)."
    return {"type": "array", "description": description, "items": toleration}


def _pod_options() -> dict[str, Any]:
    env_var = {
        **_preserve(
            "A Kubernetes EnvVar: name with value or valueFrom (a secretKeyRef, e.g. for HF_TOKEN, only where "
            "the operator allows secretEnv)."
        ),
        "properties": {"name": _str("The variable's name.")},
        "required": ["name"],
    }
    return _obj(
        "Settings of the server pods the operator leaves to you, as in a pod spec; they apply to every pod it "
        "runs, except serviceAccountName, runtimeClassName, the host namespaces and securityContext, which apply "
        "to the engine pools (the router keeps its own account and needs no GPU). What reaches past the pod (the "
        "host, privileges, another identity, Secrets in env) is refused unless the operator allows it.",
        {
            "imagePullSecrets": {
                "type": "array",
                "description": "Secrets (names) for pulling the image from a private registry.",
                "items": {"type": "string", **DNS_SUBDOMAIN},
                "x-kubernetes-list-type": "set",
            },
            "serviceAccountName": _name(
                "ServiceAccount of the engine pods, e.g. for a cloud workload identity. Unset, they run as "
                "<name>-server, which the operator makes (with no API token mounted); another account only "
                "where the operator allows serviceAccount."
            ),
            "hostNetwork": _allowed_flag("The engine pods use the node's network namespace (e.g. RDMA)", "hostNetwork"),
            "hostPID": _allowed_flag("The engine pods share the node's process namespace", "hostPID"),
            "hostIPC": _allowed_flag("The engine pods share the node's IPC namespace", "hostIPC"),
            "securityContext": _obj(
                "What the engine containers may be granted past the operator's defaults (every capability "
                "dropped, no privilege escalation, non-root, read-only root filesystem).",
                {
                    "privileged": _allowed_flag("A privileged container", "privileged"),
                    "allowPrivilegeEscalation": _allowed_flag("Processes may gain privileges", "privileged"),
                    "capabilities": _obj(
                        "Linux capabilities.",
                        {
                            "add": {
                                "type": "array",
                                "description": "Capabilities to add, e.g. IPC_LOCK for RDMA; only where the "
                                "operator allows capabilities.",
                                "items": {"type": "string", "pattern": "^[A-Z_]+$", "maxLength": 64},
                                "maxItems": 64,
                                "x-kubernetes-list-type": "set",
                            }
                        },
                    ),
                },
            ),
            "priorityClassName": _name("PriorityClass of the pods."),
            "runtimeClassName": _name("RuntimeClass of the engine pods, e.g. nvidia."),
            "env": {
                "type": "array",
                "description": "More env for the server containers.",
                "items": env_var,
                "maxItems": 256,  # bounds the admission policy's CEL cost over it
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["name"],
            },
            "annotations": _map("Annotations of the pods.", {"type": "string"}),
            "labels": _map("More labels of the pods (not under llmfleet.io/, the operator's).", {"type": "string"}),
            "affinity": _preserve("A Kubernetes Affinity for the pods (node, pod and anti-affinity)."),
            "startupTimeoutSeconds": _int(
                "How long a server may take to load the model and become ready before the kubelet restarts it "
                "(the startup probe's budget). Raise it for large models on slow volumes.",
                minimum=10,
                default=600,
                maximum=STARTUP_TIMEOUT_MAX_SECONDS,
            ),
            "maxSurge": _pods_or_percent(
                "Pods a rollout may start above the desired count (the Deployments' strategy).", 1
            ),
            "maxUnavailable": _pods_or_percent(
                "Pods a rollout may take below the desired count; with maxSurge 0 and maxUnavailable 1, a "
                "rollout needs no room (a GPU) for an extra pod.",
                0,
            ),
        },
        **{
            "x-kubernetes-validations": [
                {
                    "rule": "!(has(self.maxSurge) && has(self.maxUnavailable)) || "
                    "!(string(self.maxSurge).matches('^0+%?$') && string(self.maxUnavailable).matches('^0+%?$'))",
                    "message": "maxSurge and maxUnavailable cannot both be 0",
                }
            ]
        },
    )


def _allowed_flag(what: str, key: str) -> dict[str, Any]:
    return {"type": "boolean", "description": f"{what}; only where the operator allows {key} (podSecurity.allow)."}


def _pods_or_percent(description: str, default: int) -> dict[str, Any]:
    return {
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "x-kubernetes-int-or-string": True,
        "minimum": 0,  # for a count; the pattern for a percentage
        "pattern": "^[0-9]+%$",
        "description": description,
        "default": default,
    }


# -- spec -----------------------------------------------------------------------------------------


def pool_schema(role: str) -> dict[str, Any]:
    schema = _obj(
        f"The {role} pool: one Deployment of `llm-fleet serve --role {role}` (a LeaderWorkerSet where a "
        "replica spans nodes).",
        {
            "minReplicas": _int(
                "Fewest replicas the tuner may run. 0: with autotune, the pool scales to zero once idle for "
                "autotune.scaleToZeroAfterSeconds, and the router holds the next request and wakes it "
                "(router.holdTimeoutSeconds); without autotune, the pool starts with replicas.",
                minimum=0,
                default=1,
            ),
            "maxReplicas": _int("Most replicas the tuner may run.", minimum=1, default=4),
            "replicas": _int(
                "Initial replicas (default: minReplicas, at least 1); the tuner moves it within min/max.", 0
            ),
            "drainSeconds": _int(
                "How long a server told to stop (a scale-down, a rollout) may finish its streams: its "
                f"--drain-timeout; the pod's grace period adds the preStop sleep and {GRACE_MARGIN_SECONDS} s. "
                "Default: the longest stream the pool can serve, maxModelLen (or the built-in model's context) "
                f"tokens at the ITL SLO, plus {DRAIN_MARGIN_SECONDS} s, rounded up to "
                f"{', '.join(str(s) for s in DRAIN_STEPS_SECONDS)} s (the last where the context is unknown), "
                "so that an SLO edit seldom changes the pod template, which would roll the pods.",
                minimum=0,
                maximum=86400,
            ),
            "resources": _resources(
                "each server container. Where parallelism asks for more than one device, they name the GPU "
                "kind (nvidia.com/gpu, or another <vendor>/gpu) and the operator sets its count: tensor x pipeline "
                "GPUs a pod, or gpusPerNode each where a replica spans nodes"
            ),
            "parallelism": _obj(
                "How one replica splits the model: a replica runs on tensor x pipeline devices. A GPU pool's "
                "replica that fits on a node is one pod with that many GPUs; a larger one is a LeaderWorkerSet "
                "group of pods, gpusPerNode GPUs each (tensor x pipeline must then be a multiple of gpusPerNode; "
                "the LeaderWorkerSet controller must be installed). A CPU pool's replica is one pod of "
                "tensor x pipeline processes. The engine's tensorParallelSize and pipelineParallelSize follow.",
                {
                    "tensor": _int("Tensor-parallel ranks: each layer sharded over them.", 1, 1, maximum=64),
                    "pipeline": _int("Pipeline-parallel stages: the layers split between them.", 1, 1, maximum=64),
                },
                default={},
            ),
            "engine": engine_schema(),
            "bounds": _bounds(),
            "nodeSelector": _map("Node labels the pods must run on.", {"type": "string"}),
            "tolerations": _tolerations(),
        },
    )
    schema["x-kubernetes-validations"] = [
        {"rule": "self.minReplicas <= self.maxReplicas", "message": "minReplicas must be <= maxReplicas"},
        {
            "rule": "!has(self.replicas) || (self.replicas >= self.minReplicas && self.replicas <= self.maxReplicas)",
            "message": "replicas must lie within [minReplicas, maxReplicas]",
        },
        {
            "rule": "!has(self.engine) || (!has(self.engine.tensorParallelSize) && "
            "!has(self.engine.pipelineParallelSize))",
            "message": "set parallelism.tensor and parallelism.pipeline, not engine.tensorParallelSize or "
            "engine.pipelineParallelSize",
        },
    ]
    return schema


def spec_schema() -> dict[str, Any]:
    model = _obj(
        "What to serve: one of uri (a Hugging Face model or a directory on a PersistentVolumeClaim), path "
        "(a model directory, usually on a volume) or builtin (a test model).",
        {
            "name": _str("Model id in the OpenAI API (default: the InferenceService's name)."),
            "uri": _str(
                "Where the model comes from. hf://org/name or hf://org/name@revision (a branch, tag or commit; "
                "pin a commit for reproducible pools): an init container downloads the model files with "
                "huggingface_hub into the cache volume (see cache) before the server starts. "
                "pvc://claim/path: the directory path on that PersistentVolumeClaim, mounted read-only at /models.",
                pattern=MODEL_URI,
                maxLength=1024,
            ),
            "cache": _obj(
                "With an hf:// uri: the volume the model is downloaded into, at /models. Unset, an emptyDir per "
                "pod (each pod downloads the model). claimName: a PersistentVolumeClaim (ReadWriteMany) the "
                "pool's pods share, so the model is downloaded once and found there by every later pod.",
                {
                    "claimName": _name("A PersistentVolumeClaim in the InferenceService's namespace."),
                    "sizeLimit": _str("The emptyDir's size limit, e.g. 40Gi.", pattern=QUANTITY),
                },
                **{
                    "x-kubernetes-validations": [
                        {
                            "rule": "!(has(self.claimName) && has(self.sizeLimit))",
                            "message": "set claimName (a shared claim) or sizeLimit (an emptyDir), not both",
                        }
                    ]
                },
            ),
            "tokenSecret": _obj(
                "With an hf:// uri: a Secret key holding a Hugging Face token, for private and gated "
                "repositories. Only the download (the init container) sees it, as HF_TOKEN.",
                {
                    "name": _name("The Secret, in the InferenceService's namespace."),
                    "key": _str("The key within it.", default="token", **SECRET_KEY),
                },
                required=["name"],
            ),
            "builtin": _str(
                "A built-in random-weight model, created in the pod (for trying the stack).", enum=["tiny", "small"]
            ),
            "path": _str(
                "Model directory inside the container, e.g. /models/llama-3 (under /models with a volume): "
                "absolute, with no '..' segment.",
                maxLength=PATH_MAX,
            ),
            "volume": _preserve(
                "With path: a Kubernetes volume source holding the model, mounted read-only at /models, e.g. "
                "{persistentVolumeClaim: {claimName: llama}}, {image: {reference: ...}} or {emptyDir: {}}. A hostPath, "
                "a Secret or a projected ServiceAccount token only where the operator allows it."
            ),
            "toolCallParser": _str(
                "The model's tool-call format, as vLLM's --tool-call-parser: with it, tool_choice 'auto' (the "
                "default when a request gives tools) returns the calls the model writes as tool_calls. hermes: "
                "Hermes 2 Pro, Qwen 2.5 and 3; llama3_json: Llama 3.1 and later; pythonic: Llama 3.2 and 4 with their "
                "pythonic template; mistral: Mistral 7B v0.3, Nemo, Small. Unset, 'auto' is refused.",
                enum=list(TOOL_CALL_PARSERS),
            ),
            "reasoningParser": _str(
                "The model's thinking format, as vLLM's --reasoning-parser: with it, chat replies carry the "
                "<think> text as reasoning_content, apart from the content, and a structured-output grammar holds "
                "the answer after the thinking. deepseek_r1: DeepSeek R1, its distills, QwQ; qwen3: Qwen3.",
                enum=list(REASONING_PARSERS),
            ),
            "chatTemplate": _str(
                "The chat template (Jinja), as vLLM's --chat-template: replaces the tokenizer's own, for a model "
                "that ships none or one you need to change. Unset, the model's template applies.",
                minLength=1,
                maxLength=CHAT_TEMPLATE_MAX,
            ),
        },
    )
    model["x-kubernetes-validations"] = [
        {
            "rule": "(has(self.builtin) ? 1 : 0) + (has(self.path) ? 1 : 0) + (has(self.uri) ? 1 : 0) == 1",
            "message": "set exactly one of builtin, path or uri",
        },
        {
            "rule": "!has(self.uri) || !self.uri.matches('/\\\\.\\\\.(/|@|$)')",
            "message": "uri may not hold '..': the model must lie on the claim",
        },
        {"rule": "!has(self.volume) || has(self.path)", "message": "volume goes with path"},
        {
            "rule": "!(has(self.cache) || has(self.tokenSecret)) || (has(self.uri) && self.uri.startsWith('hf://'))",
            "message": "cache and tokenSecret go with an hf:// uri",
        },
        {
            "rule": "!has(self.path) || !self.path.matches('(^|/)[.][.](/|$)')",
            "message": "path must not hold a '..' segment: name the model directory itself",
        },
        {
            "rule": "!has(self.volume) || !has(self.path) || self.path == '/models' "
            "|| self.path.startsWith('/models/')",
            "message": "with a volume, path must lie under /models, where the volume is mounted",
        },
    ]
    slo = _obj(
        "Latency objectives the tuner holds the fleet to, at the lowest cost.",
        {
            "ttftP95Ms": {
                "type": "number",
                "minimum": 1,
                "maximum": SLO_MAX_MS,
                "description": "p95 time to first token, milliseconds.",
            },
            "itlP95Ms": {
                "type": "number",
                "minimum": 1,
                "maximum": SLO_MAX_MS,
                "description": "p95 inter-token latency, milliseconds.",
            },
            "windowSeconds": _int(
                "The window each p95 is judged over (as an SLO's evaluation period): the tuner adds or keeps "
                "replicas for latency read over it, while its knobs react to its shorter metric window.",
                minimum=10,
                default=60,
            ),
        },
        required=["ttftP95Ms", "itlP95Ms"],
    )
    autotune = _obj(
        "The tuner: batch size, batching window and replicas from live metrics, within the bounds.",
        {
            "enabled": {"type": "boolean", "default": True, "description": "Off: the spec's values stand as written."},
            "intervalSeconds": _int("How often the tuner decides.", minimum=5, default=30),
            "scaleUpStabilizationSeconds": _int("Look-back window before scaling up (as HPA behavior).", 0, 0),
            "scaleDownStabilizationSeconds": _int("Look-back window before scaling down (as HPA behavior).", 0, 300),
            "cooldownSeconds": _int("Least time between two changes of the same pool.", minimum=0, default=60),
            "headroom": {
                "type": "number",
                "minimum": 0,
                "maximum": 0.9,
                "default": 0.2,
                "description": "Spare capacity kept above measured demand (0.2: plan for 20% more).",
            },
            "scaleToZeroAfterSeconds": _int(
                "A pool with minReplicas 0 goes to zero replicas once no request has arrived, run or waited "
                "for this long (all pools of a disaggregated fleet together).",
                minimum=0,
                default=300,
            ),
            "prometheusUrl": _str("Prometheus API URL for this service (default: the operator's --prometheus-url)."),
            "mode": _str(
                "act: the tuner's values run. observe: it decides and reports (status.lastDecision, Events, "
                "decision metrics) and changes nothing, to be trialled beside an autoscaler already in place.",
                enum=["act", "observe"],
                default="act",
            ),
            "predictive": {
                "type": "boolean",
                "default": True,
                "description": "Scale up one pod start-up ahead of a rising trend in the pools' rates (Holt's "
                "smoothing); never to fewer replicas than the reactive law asks.",
            },
            "seasonSeconds": _int(
                "With predictive: the period the load repeats over (a day). Each pool keeps a profile of its "
                "rates over it and scales up one pod start-up ahead of a rise the profile has seen twice; 0 "
                "turns the season off.",
                minimum=0,
                default=86400,
                **{"x-kubernetes-validations": [{"rule": "self == 0 || self >= 600", "message": "0 (off) or >= 600"}]},
            ),
            "prefillDecodeRatio": _obj(
                "Disaggregated: the prefill:decode replica ratio stays within [min, max] (inclusive); the pool "
                "that falls short is raised.",
                {"min": {"type": "number", "minimum": 0}, "max": {"type": "number", "minimum": 0}},
                **{"x-kubernetes-validations": [{"rule": MIN_LE_MAX, "message": "min must be <= max"}]},
            ),
        },
    )
    router = _obj(
        "The routers in front of the pools, in every mode: the client Service selects them, and they pick "
        "servers by load and prefix affinity.",
        {
            "replicas": _int(
                "Router replicas; with maxReplicas above it, the fewest the autoscaler keeps.", minimum=1, default=1
            ),
            "maxReplicas": _int(
                "Above replicas: a HorizontalPodAutoscaler scales the routers from replicas to this many on CPU "
                "use (needs resources.requests.cpu). Unset: replicas routers.",
                minimum=1,
            ),
            "targetCPUUtilizationPercentage": _int(
                "The routers' average CPU use, as a percentage of their CPU request, the autoscaler holds.",
                minimum=10,
                maximum=100,
                default=70,
            ),
            "policy": _str(
                "How the router picks pods: load (the least loaded), round-robin, or prefix (of the pods that took "
                "the longest prefix of the prompt, the least loaded, while its load stays within two queued requests "
                "of the least loaded: its prefix cache hits).",
                enum=list(ROUTER_POLICIES),
                default="load",
            ),
            "resources": _resources("each router container"),
            "holdTimeoutSeconds": _int(
                "How long a request waits at the router for a pool with no ready server (scaled to zero, a "
                "rollout's gap) before a 503 with Retry-After; 0: a 503 at once.",
                minimum=0,
                maximum=3600,
                default=300,
            ),
            "maxHeldRequests": _int(
                "Requests one router holds at once; more get a 503 with Retry-After.", minimum=1, default=1024
            ),
        },
    )
    router["x-kubernetes-validations"] = [
        {
            "rule": "!has(self.maxReplicas) || self.maxReplicas >= self.replicas",
            "message": "router.maxReplicas must be >= router.replicas",
        },
        {
            "rule": "!has(self.maxReplicas) || self.maxReplicas == self.replicas || "
            "(has(self.resources) && has(self.resources.requests) && 'cpu' in self.resources.requests)",
            "message": "router.maxReplicas needs router.resources.requests.cpu: the autoscaler scales on CPU use",
        },
    ]
    schema = _obj(
        "The desired serving fleet.",
        {
            "model": model,
            "image": _str(
                "The image the server pods run (`llm-fleet serve`). Unset: the operator's default, the image the "
                "Helm chart installed it with (its serverImage, else image.repository:image.tag).",
                minLength=1,
            ),
            "imagePullPolicy": _str(
                "Image pull policy.", enum=["Always", "IfNotPresent", "Never"], default="IfNotPresent"
            ),
            "slo": slo,
            "mode": _str(
                "colocated: one pool does prefill and decode. disaggregated: prefill and decode pools scaled "
                "apart, with a router in front.",
                enum=["colocated", "disaggregated"],
                default="colocated",
            ),
            "pools": _obj(
                "The serving pools: colocated, or prefill and decode.",
                {role: pool_schema(role) for role in ("colocated", "prefill", "decode")},
                default={},
            ),
            "autotune": {**autotune, "default": {}},
            "router": {**router, "default": {}},
            "pod": {**_pod_options(), "default": {}},
            "gpusPerNode": _int(
                "The GPUs of one node (default: the operator's --gpus-per-node, the chart's gpusPerNode, else 8): "
                "a pool replica whose parallelism needs more spans nodes, as a LeaderWorkerSet group.",
                1,
            ),
            "externalAutoscaler": {
                "type": "boolean",
                "default": False,
                "description": "An HPA, KEDA or kubectl scale owns the replica counts of the Deployments "
                "(pools and router): the operator sets them only when it creates one (replicas, else "
                "minReplicas) and never reverts them. Needs autotune.enabled false, or autotune.mode observe.",
            },
            "apiKeySecret": _obj(
                "A Secret key holding an API key, as vLLM's --api-key: clients send it as "
                "'Authorization: Bearer <key>' on /v1 paths, and the pods' own calls to each other carry "
                "it. Probes and Prometheus scrapes need none.",
                {
                    "name": _name("The Secret, in the InferenceService's namespace."),
                    "key": _str("The key within it.", default="api-key", **SECRET_KEY),
                },
                required=["name"],
            ),
            "kvTransferSecret": _obj(
                "A Secret key holding a random token the router and the prefill and decode servers share: "
                "KV transfers (kv_transfer_params, /v1/kv) then need it, so a client holding the API key "
                "cannot send a decode server KV of its own making or have it fetch from another URL. "
                "Unset, a disaggregated fleet gets one of its own: the operator makes the Secret "
                "<name>-kv-transfer (key token) once, with a random token.",
                {
                    "name": _name("The Secret, in the InferenceService's namespace."),
                    "key": _str("The key within it.", default="token", **SECRET_KEY),
                },
                required=["name"],
            ),
        },
        required=["model", "slo"],
    )
    schema["x-kubernetes-validations"] = [
        {
            "rule": "self.mode != 'disaggregated' || (has(self.pools.prefill) && has(self.pools.decode))",
            "message": "disaggregated mode needs pools.prefill and pools.decode",
        },
        {
            "rule": "!has(self.externalAutoscaler) || !self.externalAutoscaler || "
            "(has(self.autotune) && ((has(self.autotune.enabled) && !self.autotune.enabled) || "
            "(has(self.autotune.mode) && self.autotune.mode == 'observe')))",
            "message": "externalAutoscaler needs autotune.enabled: false or autotune.mode: observe "
            "(the tuner scales the pools itself)",
        },
    ]
    return schema


# -- status ---------------------------------------------------------------------------------------


def status_schema() -> dict[str, Any]:
    condition = _obj(
        "Ready, Progressing, Degraded, TunerActive or ScalingLimited.",
        {
            "type": _str("Condition type."),
            "status": _str("True, False or Unknown.", enum=["True", "False", "Unknown"]),
            "reason": _str("Machine-readable reason, CamelCase."),
            "message": _str("Human-readable details."),
            "lastTransitionTime": _str("When status last changed.", format="date-time"),
            "observedGeneration": _int("The metadata.generation this condition describes."),
        },
        required=["type", "status"],
    )
    knobs = _obj(
        "Live values of the tunable knobs.",
        {knob: {"type": "number", "description": f"Current {knob}."} for knob in TUNABLE_KNOBS},
    )
    pool = _obj(
        "One pool as it runs now.",
        {
            "replicas": _int("Desired replicas."),
            "readyReplicas": _int("Replicas passing their readiness probe."),
            "knobs": knobs,
            "lastColdStartSeconds": {
                "type": "number",
                "description": "The last start from zero: from a router's wake request to the pool's first ready pod.",
            },
        },
    )
    tuner = _obj(
        "What the tuner owns; reconcile applies it within the spec's bounds and min/max replicas.",
        {
            "replicas": _map("Replicas per pool.", {"type": "integer", "minimum": 0}),
            "knobs": _map("Knobs per pool.", {"type": "object", "additionalProperties": {"type": "number"}}),
            "memory": _preserve("The tuner's own bookkeeping between runs (stabilization history); opaque."),
        },
    )
    latency = _obj(
        "The last measured p95 latencies, milliseconds.",
        {
            "ttftP95Ms": {"type": "number", "description": "p95 time to first token, as clients see it."},
            "ttftFrom": _str(
                "Where ttftP95Ms was read: the router (disaggregated: it times the whole wait), the prefill "
                "and decode pools' p95s added (while the router has too few first tokens in its window), the "
                "prefill pool alone (the decode pool's unknown too), or the colocated pool.",
                enum=["router", "prefill+decode", "prefill", "colocated"],
            ),
            "itlP95Ms": {"type": "number", "description": "p95 inter-token latency."},
            "queueP95Ms": {"type": "number", "description": "p95 time waiting in the queue."},
            "at": _str("When they were measured.", format="date-time"),
        },
    )
    decision = _obj(
        "The tuner's last decision.",
        {
            "time": _str("When it was made.", format="date-time"),
            "changes": {
                "type": "array",
                "description": "What changed: pool, knob or replicas, from and to.",
                "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            },
            "reason": _str("Why, in words."),
            "inputs": _preserve("The numbers it decided from."),
            "observed": {
                "type": "boolean",
                "description": "autotune.mode observe: the changes are what the tuner would have made; none was.",
            },
        },
    )
    cost = _map(
        "Per pool: the replica-minutes run over the tuner's trailing window against those its own demand "
        "estimate (and latency projection) said were needed, and their ratio (excess).",
        _obj(
            "One pool's spend.",
            {
                "windowSeconds": _int("The window the figures cover."),
                "replicaMinutes": {"type": "number", "description": "Replica-minutes run."},
                "neededReplicaMinutes": {"type": "number", "description": "Replica-minutes the tuner judged needed."},
                "excess": {"type": "number", "description": "replicaMinutes / neededReplicaMinutes."},
                "deviceMinutes": {
                    "type": "number",
                    "description": "Device-minutes run: replicaMinutes times the devices of a replica "
                    "(parallelism tensor x pipeline), where above one.",
                },
                "neededDeviceMinutes": {
                    "type": "number",
                    "description": "Device-minutes the tuner judged needed, where a replica runs on several.",
                },
            },
        ),
    )
    return _obj(
        "What the operator and the tuner observed.",
        {
            "conditions": {
                "type": "array",
                "description": "Ready, Progressing, Degraded, TunerActive, ScalingLimited.",
                "items": condition,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
            "observedGeneration": _int("The metadata.generation the operator last acted on."),
            "ready": _str("Ready replicas / desired replicas, all pools."),
            "url": _str("Where clients in the cluster send OpenAI API requests: the client Service."),
            "batch": _int("maxBatchSize of the decode (or colocated) pool."),
            "pools": _map("Per pool: colocated, prefill, decode, router.", pool),
            "handoverPool": _str(
                "During a mode switch: the pool that served when it began, which clients stay on until the new "
                "pools are ready and the routers relay to them."
            ),
            "wake": _obj(
                "The last wake request of a router holding requests for a pool at zero.",
                {
                    "requestedAt": _str("When the router asked.", format="date-time"),
                    "pools": {
                        "type": "array",
                        "items": {"type": "string"},
                        "description": "The pools woken that have no ready pod yet.",
                    },
                },
            ),
            "tuner": tuner,
            "latency": latency,
            "lastDecision": decision,
            "cost": cost,
        },
    )


def crd() -> dict[str, Any]:
    columns = [
        ("Mode", "string", ".spec.mode", "colocated or disaggregated"),
        ("Ready", "string", ".status.ready", "ready / desired replicas"),
        ("Reason", "string", '.status.conditions[?(@.type=="Ready")].reason', "why Ready is what it is"),
        ("Prefill", "integer", ".status.pools.prefill.replicas", "prefill replicas"),
        ("Decode", "integer", ".status.pools.decode.replicas", "decode replicas"),
        ("Batch", "integer", ".status.batch", "decode (or colocated) maxBatchSize"),
        ("TTFT-p95", "number", ".status.latency.ttftP95Ms", "measured p95 time to first token, ms"),
        ("ITL-p95", "number", ".status.latency.itlP95Ms", "measured p95 inter-token latency, ms"),
        ("Age", "date", ".metadata.creationTimestamp", ""),
        ("URL", "string", ".status.url", "the OpenAI API endpoint in the cluster", 1),  # -o wide
    ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}", "labels": {"app.kubernetes.io/name": "llm-fleet"}},
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
                    "additionalPrinterColumns": [
                        {"name": n, "type": t, "jsonPath": p, **({"description": d} if d else {})}
                        | ({"priority": wide[0]} if wide else {})
                        for n, t, p, d, *wide in columns
                    ],
                    "schema": {
                        "openAPIV3Schema": _obj(
                            "An LLM serving fleet held to latency SLOs at the lowest cost.",
                            {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": _metadata(),
                                "spec": spec_schema(),
                                "status": status_schema(),
                            },
                            required=["spec"],
                            **{"x-kubernetes-validations": [_NAME_RULE]},
                        )
                    },
                }
            ],
        },
    }


# The operator names Services after the InferenceService (reconcile/desired.py): it must be a DNS-1035
# label, short enough for the longest suffix. maxLength also bounds the rule's CEL cost.
_NAME_RULE = {
    "rule": f"size(self.metadata.name) <= {MAX_NAME_LENGTH} && self.metadata.name.matches('{NAME_PATTERN}')",
    "message": f"the name must be at most {MAX_NAME_LENGTH} characters of lower-case letters, digits and '-', "
    "starting with a letter, with no dots: the operator names Services after it",
}


def _metadata() -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"type": "string", "maxLength": MAX_NAME_LENGTH}}}


def render() -> str:
    header = "# Generated by `python -m llmfleet.operator.resource.crd`; do not edit by hand.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=120)


if __name__ == "__main__":
    sys.stdout.write(render())
