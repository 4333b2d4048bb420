"""The InferenceService spec as the operator reads it (mirrors crds/inferenceservice.yaml).

The CRD schema rejects most bad input at the API server; ``SpecError`` covers what it lets
through but the operator cannot serve. Its message becomes a Degraded condition's message.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Literal, get_args
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from llmfleet.operator.resource.layout import DEFAULT_GPUS_PER_NODE, Layout, LayoutError, layout
from llmfleet.server.config import EngineConfig
from llmfleet.server.core.chat_template import template_problem
from llmfleet.server.core.model_uri import ClaimModel, HubModel, parse_uri

POOL_NAMES = ("colocated", "prefill", "decode")
MODELS_DIR = "/models"  # where model.volume, a pvc:// claim or the hf:// download cache is mounted
QUANTITY = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"  # a size, as Kubernetes writes one
PATH_MAX = 4096  # model.path, as Linux's PATH_MAX (it also bounds the CRD's CEL rules on it)
# A container argument is at most 128 KiB (the kernel's MAX_ARG_STRLEN): 32 Ki characters of
# up to 4 UTF-8 bytes each fit in it.
CHAT_TEMPLATE_MAX = 32768
ToolCallParserName = Literal["hermes", "llama3_json", "mistral", "pythonic"]  # the server's --tool-call-parser choices
TOOL_CALL_PARSERS = get_args(ToolCallParserName)
ReasoningParserName = Literal["deepseek_r1", "qwen3"]  # the server's --reasoning-parser choices
REASONING_PARSERS = get_args(ReasoningParserName)
RouterPolicy = Literal["load", "round-robin", "prefix"]  # the router's --router-policy choices
ROUTER_POLICIES = get_args(RouterPolicy)
# The context of each built-in model (server/runner/builtin_models.py, which the operator does
# not import): what the longest stream of a pool that sets no maxModelLen is sized by.
BUILTIN_CONTEXT = {"tiny": 2048, "small": 4096}
# A pool's default drain: its longest stream (maxModelLen tokens at the ITL SLO) and a margin, rounded
# up to a step, at most the cap. The drain is in the pod template, so each change rolls every pod and
# reloads its model: the steps keep an SLO edit from doing that but where it crosses one.
DRAIN_MARGIN_SECONDS = 10
DRAIN_STEPS_SECONDS = (60, 120, 300, 600)
DRAIN_CAP_SECONDS = DRAIN_STEPS_SECONDS[-1]
SLO_MAX_MS = 3_600_000  # an hour: no latency objective past it means anything
STARTUP_TIMEOUT_MAX_SECONDS = 86_400  # a day to load a model; the startup probe's threshold stays an int32
GRACE_MARGIN_SECONDS = 10  # a pod's grace period beyond the preStop sleep and the drain: the process's exit
TUNABLE_KNOBS = {
    "maxBatchSize": "max_batch_size",
    "batchTimeoutMs": "batch_timeout_ms",
    "maxNumBatchedTokens": "max_num_batched_tokens",
}


def knob_range(knob: str, low: float, high: float) -> tuple[float, float]:
    """[low, high] cut to what EngineConfig accepts for the knob, to whole numbers for an integer
    knob. May come out empty (low > high): no value the engine takes lies in it."""
    field = EngineConfig.model_fields[TUNABLE_KNOBS[knob]]
    for item in field.metadata:
        low = max(low, float(getattr(item, "ge", low)))
        high = min(high, float(getattr(item, "le", high)))
    if is_integer_knob(knob):
        low, high = float(math.ceil(low)), float(math.floor(high))
    return low, high


class SpecError(ValueError):
    """A spec the operator cannot serve: reason (CamelCase) and a readable message."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class SecretKey(_Model):
    """One key of a Secret in the InferenceService's namespace."""

    name: str = Field(min_length=1)
    key: str = Field("api-key", min_length=1)


class HubTokenSecret(SecretKey):
    key: str = Field("token", min_length=1)


class ModelCache(_Model):
    """Where an hf:// model is downloaded to: a PersistentVolumeClaim the pool's pods share
    (ReadWriteMany: one download for all), or else an emptyDir per pod of at most sizeLimit."""

    claim_name: str | None = Field(None, min_length=1)
    size_limit: str | None = Field(None, pattern=QUANTITY)

    @model_validator(mode="after")
    def _one_kind(self) -> ModelCache:
        if self.claim_name is not None and self.size_limit is not None:
            raise ValueError("model.cache takes claimName (a shared claim) or sizeLimit (an emptyDir), not both")
        return self


class ModelSource(_Model):
    name: str | None = None
    builtin: Literal["tiny", "small"] | None = None
    path: str | None = None
    volume: dict[str, Any] | None = None
    uri: str | None = None  # hf://org/name[@revision] or pvc://claim/path
    cache: ModelCache | None = None  # hf:// only: the download cache volume
    token_secret: HubTokenSecret | None = None  # hf:// only: HF_TOKEN for the download, key 'token' by default
    tool_call_parser: ToolCallParserName | None = None  # tool_choice 'auto', as vLLM's flag
    reasoning_parser: ReasoningParserName | None = None  # thinking apart in chat replies, as vLLM's flag
    chat_template: str | None = Field(None, min_length=1, max_length=CHAT_TEMPLATE_MAX)  # as vLLM's flag

    @field_validator("chat_template")
    @classmethod
    def _template_parses(cls, value: str | None) -> str | None:
        problem = None if value is None else template_problem(value)
        if problem is not None:
            raise ValueError(f"model.chatTemplate is no chat template: {problem}")
        return value

    @field_validator("path")
    @classmethod
    def _normal_path(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not value.startswith("/"):
            raise ValueError(f"model.path must be absolute inside the container, got {value!r}")
        if len(value) > PATH_MAX:
            raise ValueError(f"model.path is longer than {PATH_MAX} characters")
        return normalized_path(value)

    @model_validator(mode="after")
    def _one_source(self) -> ModelSource:
        if sum(source is not None for source in (self.builtin, self.path, self.uri)) != 1:
            raise ValueError("set exactly one of model.builtin, model.path or model.uri")
        if self.uri is not None:
            parse_uri(self.uri)  # its ValueError says what is wrong
        if self.volume and self.path is None:
            raise ValueError("model.volume goes with model.path (a pvc:// uri mounts its claim itself)")
        if (self.cache or self.token_secret) and not isinstance(self.source, HubModel):
            raise ValueError("model.cache and model.tokenSecret go with an hf:// model.uri")
        if self.volume and self.path is not None and not (self.path + "/").startswith(MODELS_DIR + "/"):
            raise ValueError(f"model.path {self.path!r} is outside the model volume, which is mounted at {MODELS_DIR}")
        return self

    @property
    def source(self) -> HubModel | ClaimModel | None:
        """model.uri parsed; None for a built-in or a path."""
        return None if self.uri is None else parse_uri(self.uri)

    @property
    def server_arg(self) -> str:
        """The server's --model: a Hub model by its hf:// name (a pod's init container has put it in
        the cache the server reads), a claim's directory where the claim is mounted."""
        source = self.source
        if isinstance(source, ClaimModel):
            return f"{MODELS_DIR}/{source.path}".rstrip("/")
        if isinstance(source, HubModel):
            return str(source)
        return f"builtin:{self.builtin}" if self.builtin else str(self.path)

    @property
    def server_args(self) -> list[str]:
        """What a model server is started with to serve this model."""
        args = ["--model", self.server_arg]
        if self.tool_call_parser:
            args += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_call_parser]
        if self.reasoning_parser:
            args += ["--reasoning-parser", self.reasoning_parser]
        if self.chat_template:
            args += ["--chat-template", self.chat_template]
        return args


def normalized_path(path: str) -> str:
    """An absolute path with no empty or '.' segments; a '..' segment is refused, not resolved:
    /models/../etc would leave the model volume (the CRD's rule refuses it too)."""
    parts = [part for part in path.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise ValueError(f"model.path {path!r} has a '..' segment: name the model directory itself")
    return "/" + "/".join(parts)


class Bound(_Model):
    min: float | None = None
    max: float | None = None

    def limits(self) -> tuple[float, float]:
        """(min, max), a missing side unbounded."""
        return (-math.inf if self.min is None else self.min, math.inf if self.max is None else self.max)


def is_integer_knob(knob: str) -> bool:
    return EngineConfig.model_fields[TUNABLE_KNOBS[knob]].annotation is int


# Engine fields a pool's parallelism sets (camelCase, snake_case): one place for the layout.
PARALLEL_FIELDS = {
    "tensorParallelSize": "tensor",
    "tensor_parallel_size": "tensor",
    "pipelineParallelSize": "pipeline",
    "pipeline_parallel_size": "pipeline",
}


class Parallelism(_Model):
    """How one replica splits the model: ``tensor`` ranks shard each layer, ``pipeline`` stages
    split the layers; a replica runs on tensor x pipeline devices (layout.py places them)."""

    tensor: int = Field(1, ge=1, le=64)
    pipeline: int = Field(1, ge=1, le=64)

    @property
    def devices(self) -> int:
        return self.tensor * self.pipeline


class Pool(_Model):
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    replicas: int | None = Field(None, ge=0)
    # How long a server that is told to stop may finish its streams (None: derived, see drain_seconds)
    drain_seconds: int | None = Field(None, ge=0, le=86400)
    resources: dict[str, Any] = Field(default_factory=dict)
    engine: dict[str, Any] = Field(default_factory=dict)
    bounds: dict[str, Bound] = Field(default_factory=dict)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    parallelism: Parallelism = Field(default_factory=Parallelism)

    @field_validator("engine")
    @classmethod
    def _layout_elsewhere(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in value:
            if key in PARALLEL_FIELDS:
                raise ValueError(
                    f"engine.{key}: set parallelism.{PARALLEL_FIELDS[key]} instead (the pods and their "
                    "devices follow it)"
                )
        return value

    @model_validator(mode="after")
    def _ranges(self) -> Pool:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"minReplicas {self.min_replicas} > maxReplicas {self.max_replicas}")
        for knob, bound in self.bounds.items():
            if knob not in TUNABLE_KNOBS:
                raise ValueError(f"bounds.{knob}: not a tunable knob (one of {sorted(TUNABLE_KNOBS)})")
            if bound.min is not None and bound.max is not None and bound.min > bound.max:
                raise ValueError(f"bounds.{knob}: min {bound.min} > max {bound.max}")
            low, high = knob_range(knob, *bound.limits())
            if low > high:  # e.g. {min: 10.2, max: 10.8} on an integer knob, or {min: 5000} on maxBatchSize
                engine_low, engine_high = knob_range(knob, -math.inf, math.inf)
                raise ValueError(
                    f"bounds.{knob}: no value the engine accepts lies within it "
                    f"({'whole numbers ' if is_integer_knob(knob) else ''}from {engine_low:g} to {engine_high:g})"
                )
        return self

    def engine_config(self) -> EngineConfig:
        """The engine's config: ``engine``, with the parallel sizes from ``parallelism``."""
        return EngineConfig.model_validate(
            {
                **self.engine,
                "tensor_parallel_size": self.parallelism.tensor,
                "pipeline_parallel_size": self.parallelism.pipeline,
            }
        )

    def layout(self, gpus_per_node: int) -> Layout:
        """Where one replica runs (layout.py); raises LayoutError where it cannot be placed."""
        return layout(self.resources, self.parallelism.tensor, self.parallelism.pipeline, gpus_per_node)

    @property
    def initial_replicas(self) -> int:
        """A new pool's replicas: ``replicas``, else ``minReplicas`` but at least one (a pool that
        may scale to zero starts warm and goes to zero once idle)."""
        return max(1, self.min_replicas) if self.replicas is None else self.replicas


class SLO(_Model):
    ttft_p95_ms: float = Field(gt=0, le=SLO_MAX_MS)
    itl_p95_ms: float = Field(gt=0, le=SLO_MAX_MS)
    window_seconds: int = Field(60, ge=10)  # each p95 is judged over this window


MIN_SEASON_SECONDS = 600  # a season's profile needs bins of at least two tuner runs, and a few of them


class Autotune(_Model):
    enabled: bool = True
    interval_seconds: int = Field(30, ge=5)
    scale_up_stabilization_seconds: int = Field(0, ge=0)
    scale_down_stabilization_seconds: int = Field(300, ge=0)
    cooldown_seconds: int = Field(60, ge=0)
    headroom: float = Field(0.2, ge=0, le=0.9)
    # A pool with minReplicas 0 goes to zero once no request has arrived or been in flight this long
    scale_to_zero_after_seconds: int = Field(300, ge=0)
    prometheus_url: str | None = None
    # act: the tuner's values run; observe: it decides and reports (status, Events, metrics) and
    # changes nothing, to be trialled beside an autoscaler already in place
    mode: Literal["act", "observe"] = "act"
    predictive: bool = True  # scale up a pod start-up ahead of a rising trend (never below the reactive law)
    # ... and ahead of a rise the load repeats each period (a day); 0: no season
    season_seconds: int = Field(86400, ge=0)
    prefill_decode_ratio: Bound | None = None  # disaggregated: prefill:decode replicas within [min, max]

    @field_validator("season_seconds")
    @classmethod
    def _season(cls, value: int) -> int:
        if 0 < value < MIN_SEASON_SECONDS:
            raise ValueError(
                f"seasonSeconds {value} is shorter than {MIN_SEASON_SECONDS} s: 0 turns the season off, 86400 is a day"
            )
        return value

    @field_validator("prefill_decode_ratio")
    @classmethod
    def _ratio(cls, value: Bound | None) -> Bound | None:
        if value is not None:
            low, high = value.limits()
            if low <= 0 or high <= 0 or low > high:
                raise ValueError(f"prefillDecodeRatio needs 0 < min <= max, got min {value.min}, max {value.max}")
        return value

    @field_validator("prometheus_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        # a URL no request can be sent to would fail every tuner run; a spec error says so once
        if value is None:
            return value
        try:
            url = urlsplit(value)
            url.port  # noqa: B018 - a port that is no number raises here
        except ValueError as exc:
            raise ValueError(f"prometheusUrl {value!r} is not a URL: {exc}") from None
        if url.scheme not in ("http", "https") or not url.hostname or any(c.isspace() for c in value):
            raise ValueError(f"prometheusUrl {value!r} is not an http(s) URL like http://prometheus.monitoring:9090")
        return value


class Router(_Model):
    """The routers: ``replicas`` of them, or, with ``maxReplicas`` above it, from ``replicas`` to
    ``maxReplicas`` by a HorizontalPodAutoscaler on CPU use. A router is a proxy that relays
    streams: its work grows with the tokens it relays, and CPU is what runs out first."""

    replicas: int = Field(1, ge=1)
    max_replicas: int | None = Field(None, ge=1)
    target_cpu_utilization: int = Field(70, ge=10, le=100, alias="targetCPUUtilizationPercentage")  # as HPA v1 names it
    policy: RouterPolicy = "load"
    resources: dict[str, Any] = Field(default_factory=dict)
    # A request for a pool with no ready server (scaled to zero, a rollout's gap) waits this long
    # at the router, at most this many at once; then a 503 with Retry-After
    hold_timeout_seconds: int = Field(300, ge=0, le=3600)
    max_held_requests: int = Field(1024, ge=1)

    @model_validator(mode="after")
    def _scaling(self) -> Router:
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ValueError(f"router.maxReplicas {self.max_replicas} < router.replicas {self.replicas}")
        if self.autoscaled and "cpu" not in (self.resources.get("requests") or {}):
            raise ValueError(
                "router.maxReplicas needs router.resources.requests.cpu: the autoscaler scales on CPU use "
                "as a share of the request"
            )
        return self

    @property
    def autoscaled(self) -> bool:
        """A HorizontalPodAutoscaler sets the routers' replicas, from ``replicas`` up to ``maxReplicas``."""
        return self.max_replicas is not None and self.max_replicas > self.replicas


# Env the operator sets on every server container itself (reconcile/desired.py): a pod option may not set them.
RESERVED_ENV = frozenset(
    {
        "LLMFLEET_CACHE",
        "HOME",
        "POD_NAME",
        "POD_NAMESPACE",
        "VLLM_API_KEY",
        "LLMFLEET_KV_TRANSFER_TOKEN",
        "HF_HUB_OFFLINE",
    }
)
RESERVED_LABEL_PREFIX = "llmfleet.io/"  # the operator's selector labels


class Capabilities(_Model):
    add: list[str] = Field(default_factory=list)


class ContainerSecurity(_Model):
    """What the model servers' containers may be granted past the operator's defaults (no
    privilege escalation, every capability dropped): each needs the operator's allowlist
    (pod_security.py), e.g. IPC_LOCK for RDMA."""

    privileged: bool | None = None
    allow_privilege_escalation: bool | None = None
    capabilities: Capabilities = Field(default_factory=Capabilities)


class PodOptions(_Model):
    """Settings of the pods that the operator has no opinion on, as KServe's pod spec takes them: a
    private registry, a workload identity, a GPU runtime class, a token in the env, scheduling.
    What reaches past the pod (the host, privileges, another identity, Secrets) is refused unless
    the operator allows it (pod_security.py)."""

    image_pull_secrets: list[str] = Field(default_factory=list)
    service_account_name: str | None = None  # the engine pools (the router keeps its own account)
    host_network: bool | None = None  # the engine pools, as runtime_class_name; each needs the allowlist
    host_pid: bool | None = Field(None, alias="hostPID")  # not to_camel's hostPid
    host_ipc: bool | None = Field(None, alias="hostIPC")
    security_context: ContainerSecurity = Field(default_factory=ContainerSecurity)
    priority_class_name: str | None = None
    runtime_class_name: str | None = None  # the engine pools (the router needs no GPU)
    env: list[dict[str, Any]] = Field(default_factory=list)
    annotations: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    affinity: dict[str, Any] = Field(default_factory=dict)
    # Loading weights can take many minutes: how long a server may take to become ready before the
    # kubelet restarts it (the startup probe's budget).
    startup_timeout_seconds: int = Field(600, ge=10, le=STARTUP_TIMEOUT_MAX_SECONDS)
    # The Deployments' rollout: new pods start before old ones drain, unless there is no room for
    # one more (a GPU pool on a full node pool: maxSurge 0, maxUnavailable 1).
    max_surge: int | str = 1
    max_unavailable: int | str = 0

    @field_validator("max_surge", "max_unavailable")
    @classmethod
    def _count_or_percent(cls, value: int | str) -> int | str:
        count = isinstance(value, int) and value >= 0
        if not count and not (isinstance(value, str) and re.fullmatch(r"[0-9]+%", value)):
            raise ValueError(f"{value!r}: a count of pods (0 or more) or a percentage such as '25%'")
        return value

    @model_validator(mode="after")
    def _rollout_moves(self) -> PodOptions:
        # as the API server reads them: numbers ("00%" is 0), and no more than all pods unavailable
        if _amount(self.max_surge) == 0 and _amount(self.max_unavailable) == 0:
            raise ValueError("maxSurge and maxUnavailable cannot both be 0: a rollout could never move")
        if str(self.max_unavailable).endswith("%") and _amount(self.max_unavailable) > 100:
            raise ValueError(f"maxUnavailable {self.max_unavailable}: at most 100%")
        return self

    @field_validator("image_pull_secrets")
    @classmethod
    def _pull_secrets_once(cls, value: list[str]) -> list[str]:
        if len(set(value)) < len(value):  # a list the API server keys by name: a duplicate fails the apply
            raise ValueError(f"imagePullSecrets names a Secret twice: {value}")
        return value

    @field_validator("env")
    @classmethod
    def _own_names(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        seen: set[str] = set()
        for item in value:
            name = item.get("name")
            if not isinstance(name, str) or not name:
                raise ValueError("every env entry needs a name")
            if name in seen:  # a list the API server keys by name: a duplicate fails the apply
                raise ValueError(f"env {name} is given twice")
            seen.add(name)
            if name in RESERVED_ENV:
                raise ValueError(
                    f"env {name} is set by the operator (use apiKeySecret for VLLM_API_KEY, "
                    "kvTransferSecret for LLMFLEET_KV_TRANSFER_TOKEN; HF_HUB_OFFLINE: an hf:// model's "
                    "server reads the cache its init container filled)"
                )
        return value

    @field_validator("labels")
    @classmethod
    def _not_ours(cls, value: dict[str, str]) -> dict[str, str]:
        taken = sorted(k for k in value if k.startswith(RESERVED_LABEL_PREFIX))
        if taken:
            raise ValueError(f"labels {taken}: the {RESERVED_LABEL_PREFIX} prefix holds the operator's selector labels")
        for key, text in value.items():
            if problem := _metadata_key_problem(key) or _label_value_problem(text):
                raise ValueError(f"label {key}: {problem}")
        return value

    @field_validator("annotations")
    @classmethod
    def _annotation_keys(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if problem := _metadata_key_problem(key):
                raise ValueError(f"annotation {key}: {problem}")
        return value


# The API server's rules for label and annotation keys and label values: checked here, so a bad
# one is a condition on the InferenceService, not a write refused after others have landed.
_QUALIFIED_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"  # the CRD's names too
_DNS_SUBDOMAIN = re.compile(DNS_SUBDOMAIN)


def _metadata_key_problem(key: str) -> str | None:
    prefix, slash, name = key.rpartition("/")
    if slash and not (len(prefix) <= 253 and _DNS_SUBDOMAIN.fullmatch(prefix)):
        return "the key's prefix must be a DNS subdomain (lower-case letters, digits, '-' and '.')"
    if not (len(name) <= 63 and _QUALIFIED_NAME.fullmatch(name)):
        return "the key's name must be 1-63 letters, digits, '-', '_' or '.', starting and ending alphanumeric"
    return None


def _label_value_problem(value: str) -> str | None:
    if value == "" or (len(value) <= 63 and _QUALIFIED_NAME.fullmatch(value)):
        return None
    return f"value {value!r} must be at most 63 letters, digits, '-', '_' or '.', starting and ending alphanumeric"


def _amount(value: int | str) -> int:
    return int(str(value).rstrip("%"))


class KVTransferSecret(SecretKey):
    key: str = Field("token", min_length=1)


# The server image where spec.image is unset: the operator's --server-image, which the chart sets
# to its own image (the one the user named), so no spec needs an image and none names a missing one.
SERVER_IMAGE_ENV = "LLMFLEET_SERVER_IMAGE"


def default_server_image() -> str | None:
    return os.environ.get(SERVER_IMAGE_ENV) or None


# The GPUs of a node where spec.gpusPerNode is unset: the operator's --gpus-per-node (the chart's
# gpusPerNode value), else 8.
GPUS_PER_NODE_ENV = "LLMFLEET_GPUS_PER_NODE"


def default_gpus_per_node() -> int:
    text = os.environ.get(GPUS_PER_NODE_ENV, "")
    return int(text) if text.isdigit() and int(text) > 0 else DEFAULT_GPUS_PER_NODE


class InferenceServiceSpec(_Model):
    model: ModelSource
    image: str | None = Field(default_factory=default_server_image, min_length=1)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    slo: SLO
    mode: Literal["colocated", "disaggregated"] = "colocated"
    pools: dict[str, Pool] = Field(default_factory=dict)
    autotune: Autotune = Field(default_factory=Autotune)
    router: Router = Field(default_factory=Router)
    api_key_secret: SecretKey | None = None  # vLLM's --api-key for every pod, from this Secret
    # the token of the fleet's own KV-transfer paths (server/http/auth.py), for every pod
    kv_transfer_secret: KVTransferSecret | None = None
    pod: PodOptions = Field(default_factory=PodOptions)
    # An HPA, KEDA or `kubectl scale` owns the Deployments' replicas: set only at creation
    external_autoscaler: bool = False
    # A replica larger than a node spans several (layout.py): how many GPUs one node has
    gpus_per_node: int = Field(default_factory=default_gpus_per_node, ge=1)

    @model_validator(mode="after")
    def _one_hub_token(self) -> InferenceServiceSpec:
        if self.model.token_secret and any(item.get("name") == "HF_TOKEN" for item in self.pod.env):
            raise ValueError(
                "HF_TOKEN is in pod.env and model.tokenSecret: keep one (tokenSecret reaches the download)"
            )
        return self

    @model_validator(mode="after")
    def _one_scaler(self) -> InferenceServiceSpec:
        if self.external_autoscaler and self.autotune.enabled and self.autotune.mode != "observe":
            raise ValueError(
                "externalAutoscaler needs autotune.enabled: false or autotune.mode: observe "
                "(the tuner scales the pools itself)"
            )
        return self

    @model_validator(mode="after")
    def _pools_for_mode(self) -> InferenceServiceSpec:
        unknown = set(self.pools) - set(POOL_NAMES)
        if unknown:
            raise ValueError(f"unknown pools {sorted(unknown)}; use {list(POOL_NAMES)}")
        if self.mode == "disaggregated":
            missing = [p for p in ("prefill", "decode") if p not in self.pools]
            if missing:
                raise ValueError(f"disaggregated mode needs pools {missing}")
        return self

    @property
    def active_pools(self) -> list[str]:
        return ["prefill", "decode"] if self.mode == "disaggregated" else ["colocated"]

    @property
    def entry_pool(self) -> str:
        """The pool the client Service sends requests to: the router, in every mode."""
        return "router"

    @property
    def deployed_pools(self) -> list[str]:
        """Every pool with a Deployment: the engine pools and the router."""
        return [*self.active_pools, "router"]

    def pool(self, name: str) -> Pool:
        return self.pools.get(name) or Pool()

    def layout(self, pool: str) -> Layout:
        """Where one replica of ``pool`` runs; parse_spec has refused a layout that cannot be placed.
        The router is one pod of its own."""
        return Layout() if pool == "router" else self.pool(pool).layout(self.gpus_per_node)

    def drain_seconds(self, pool: str) -> int:
        """How long a server of ``pool`` may finish its streams once told to stop (its
        ``--drain-timeout``; the pod's grace period adds the preStop sleep and a margin): the
        pool's ``drainSeconds``, else its longest stream, ``maxModelLen`` tokens at the ITL SLO
        (the built-in model's context where none is set), plus a margin, rounded up to one of
        ``DRAIN_STEPS_SECONDS`` (the last, the cap, where the context is unknown). The router
        relays every pool's streams: it gets the longest."""
        if pool == "router":
            return max(self.drain_seconds(p) for p in self.active_pools)
        spec = self.pool(pool)
        if spec.drain_seconds is not None:
            return spec.drain_seconds
        context = spec.engine_config().max_model_len or BUILTIN_CONTEXT.get(self.model.builtin or "")
        if context is None:
            return DRAIN_CAP_SECONDS
        longest = math.ceil(context * self.slo.itl_p95_ms / 1000.0) + DRAIN_MARGIN_SECONDS
        return next((step for step in DRAIN_STEPS_SECONDS if step >= longest), DRAIN_CAP_SECONDS)


def parse_spec(raw: dict[str, Any]) -> InferenceServiceSpec:
    """Validate a spec dict, raising SpecError(reason, message) on anything unservable."""
    try:
        spec = InferenceServiceSpec.model_validate(raw)
    except ValidationError as exc:
        parts = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"])
            parts.append(f"{loc}: {err['msg']}" if loc else err["msg"])
        raise SpecError("InvalidSpec", "; ".join(parts)) from exc
    for name in spec.active_pools:
        try:
            spec.pool(name).engine_config()
        except ValidationError as exc:
            msgs = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise SpecError("InvalidEngineConfig", f"pools.{name}.engine: {msgs}") from exc
        try:
            spec.layout(name)
        except LayoutError as exc:
            raise SpecError("InvalidSpec", f"pools.{name}.parallelism: {exc}") from exc
    return spec


def require_image(spec: InferenceServiceSpec) -> None:
    """A spec the operator can deploy names its image, or the operator has a default for it."""
    if spec.image is None:
        raise SpecError(
            "NoImage",
            f"spec.image is unset and the operator has no default server image (--server-image or "
            f"${SERVER_IMAGE_ENV}, which the Helm chart sets to its image.repository:image.tag)",
        )


# Children are named "<name>" and "<name>-<pool>"; Services among them, whose names must be
# DNS-1035 labels (a letter first, no dots, at most 63 characters). KServe asks the same of its names.
NAME_PATTERN = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
MAX_NAME_LENGTH = 63 - max(len(f"-{pool}") for pool in (*POOL_NAMES, "router"))


# A pool whose replicas span nodes is a LeaderWorkerSet "<name>-<pool>"; its worker StatefulSets
# are "<that>-<group>", and their pods' controller-revision-hash label is the StatefulSet's name and
# an 11-character "-<hash>", which the API server refuses past 63 (kubernetes#64023, lws#410): the
# LeaderWorkerSet is made, its worker pods never are. Room for groups 0-99.
MAX_GROUP_NAME_LENGTH = 63 - len("-99") - len("-0123456789")


def group_name_problem(name: str, spec: InferenceServiceSpec) -> str | None:
    """Why a pool of this fleet spanning nodes cannot be named after it, or None."""
    for pool in spec.active_pools:
        if spec.layout(pool).spans_nodes and len(f"{name}-{pool}") > MAX_GROUP_NAME_LENGTH:
            longest = MAX_GROUP_NAME_LENGTH - len(f"-{pool}")
            return (
                f"name {name!r} is too long for pool {pool}, whose replicas span nodes: its LeaderWorkerSet's "
                f"worker pods would carry a label past 63 characters; use at most {longest} characters"
            )
    return None


def name_problem(name: str) -> str | None:
    """Why an InferenceService cannot have this name (its Services would be rejected), or None."""
    if re.fullmatch(NAME_PATTERN, name) and len(name) <= MAX_NAME_LENGTH:
        return None
    return (
        f"name {name!r} cannot name this fleet's Services: use at most {MAX_NAME_LENGTH} characters "
        "(lower-case letters, digits and '-', a letter first, no dots)"
    )
