"""The operator's own Kubernetes API calls: the children, pods, the InferenceService status and
discovery. kopf keeps its own connection for watching, events and its bookkeeping.

The official client (``kubernetes``) carries them: credentials, TLS, token refresh, JSON on the
wire. It is synchronous, so each request runs in a worker thread (``asyncio.to_thread``) and
kopf's event loop never waits on a socket. Requests go to the paths ResourceKind builds, through
``ApiClient.call_api``; not through the DynamicClient, which reads the whole discovery when it is
made and caches it in a temp file (``serves()`` must notice a CRD installed later), and wraps
answers in objects where the callers want the plain dicts they apply.

Retries are ours (retry_delay), short and bounded. A 401 loads the credentials again, once:
service-account tokens rotate.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config

logger = logging.getLogger(__name__)

FIELD_MANAGER = "llm-fleet-operator"  # also the User-Agent: tests tell our calls from kopf's by it
RETRY_BACKOFFS = (0.2, 1.0, 3.0)  # seconds before each retry; their number is the most retries
MAX_RETRY_AFTER = 10.0  # a longer Retry-After is cut short: past that, kopf retries the whole pass
REQUEST_TIMEOUT = (10, 30)  # connect, read (seconds)
DEFAULT_KUBECONFIG = "~/.kube/config"
UNREACHABLE = "Unreachable"  # no connection: the request never reached the server
DISCONNECTED = "Disconnected"  # the connection broke after the request went out: it may have landed
# Every PATCH this module sends sets fixed values (an apply, a merge patch), so it may be repeated.
IDEMPOTENT = frozenset({"GET", "PUT", "PATCH", "DELETE"})


@dataclass(frozen=True)
class ResourceKind:
    """Where a kind lives in the API."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_path(self) -> str:
        return f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"

    def path(self, namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
        base = self.group_path
        if self.namespaced and namespace:
            base += f"/namespaces/{quote(namespace)}"
        base += f"/{self.plural}"
        if name:
            base += f"/{quote(name)}"
        if subresource:
            base += f"/{subresource}"
        return base


INFERENCE_SERVICE = ResourceKind("llmfleet.io", "v1alpha1", "inferenceservices", "InferenceService")
DEPLOYMENT = ResourceKind("apps", "v1", "deployments", "Deployment")
# A pool whose replica spans nodes (leader_worker_set.py); its CRD may be missing (serves() says)
LEADER_WORKER_SET = ResourceKind("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", "LeaderWorkerSet")
SERVICE = ResourceKind("", "v1", "services", "Service")
CONFIG_MAP = ResourceKind("", "v1", "configmaps", "ConfigMap")
POD_DISRUPTION_BUDGET = ResourceKind("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget")
POD_MONITOR = ResourceKind("monitoring.coreos.com", "v1", "podmonitors", "PodMonitor")
POD = ResourceKind("", "v1", "pods", "Pod")
SERVICE_ACCOUNT = ResourceKind("", "v1", "serviceaccounts", "ServiceAccount")
ROLE = ResourceKind("rbac.authorization.k8s.io", "v1", "roles", "Role")
ROLE_BINDING = ResourceKind("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding")
SECRET = ResourceKind("", "v1", "secrets", "Secret")  # created, never read (kv_secret.py)
NETWORK_POLICY = ResourceKind("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy")
HORIZONTAL_POD_AUTOSCALER = ResourceKind("autoscaling", "v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler")

# Every kind reconcile.desired_objects() may return, in apply order (config and the router's
# account before their readers).
CHILD_KINDS: tuple[ResourceKind, ...] = (
    SERVICE_ACCOUNT,
    ROLE,
    ROLE_BINDING,
    CONFIG_MAP,
    NETWORK_POLICY,  # before the pods it guards
    SERVICE,
    DEPLOYMENT,
    LEADER_WORKER_SET,
    HORIZONTAL_POD_AUTOSCALER,  # after the Deployment it scales
    POD_DISRUPTION_BUDGET,
    POD_MONITOR,
)


def child_kinds(*, pod_monitor: bool, leader_worker_sets: bool) -> tuple[ResourceKind, ...]:
    """CHILD_KINDS less those whose CRD the cluster does not serve: listing one would fail."""
    return tuple(
        kind
        for kind in CHILD_KINDS
        if (kind is not POD_MONITOR or pod_monitor) and (kind is not LEADER_WORKER_SET or leader_worker_sets)
    )


def kind_of(obj: dict[str, Any]) -> ResourceKind:
    for kind in (*CHILD_KINDS, INFERENCE_SERVICE, POD, SECRET):
        if kind.kind == obj.get("kind") and kind.api_version == obj.get("apiVersion"):
            return kind
    raise ValueError(f"the operator does not manage {obj.get('apiVersion')}/{obj.get('kind')}")


class ApiError(Exception):
    """A non-2xx answer from the API server, with its Status reason and message; or a 503 for a
    connection that failed (reason UNREACHABLE or DISCONNECTED)."""

    def __init__(self, status: int, reason: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.retry_after = retry_after  # seconds, from the answer's Retry-After header

    @property
    def retryable(self) -> bool:
        """Worth another pass soon (kopf's retry), once the client's own retries are spent."""
        return self.status in (409, 429) or self.status >= 500


def retry_delay(method: str, error: ApiError, attempt: int) -> float | None:
    """Seconds to wait before sending a request again after its `attempt`-th failure (from 0),
    or None: raise `error`.

    429 is retried whatever the method (the server throttled it and did nothing), as is a request
    that never reached the server. 5xx and connections that broke are retried only for requests
    that may land twice: not a POST, whose retry could find its own object (409). 4xx is an
    answer. A Retry-After the server sends stands in for the backoff."""
    if attempt >= len(RETRY_BACKOFFS):
        return None
    if not (error.status == 429 or error.reason == UNREACHABLE or (error.status >= 500 and method in IDEMPOTENT)):
        return None
    if error.retry_after is not None:
        return min(error.retry_after, MAX_RETRY_AFTER)
    return RETRY_BACKOFFS[attempt]


def load_configuration() -> k8s.Configuration:
    """Credentials: ``$KUBECONFIG`` when set, else the pod's service account, else
    ``~/.kube/config``. An explicit kubeconfig wins over an ambient service account: whoever sets
    it in a pod (a debug shell, an operator run against another cluster) means it."""
    configuration = k8s.Configuration()
    explicit = os.environ.get("KUBECONFIG")
    if not explicit:
        try:
            k8s_config.load_incluster_config(client_configuration=configuration)
            return configuration
        except k8s_config.ConfigException:  # not in a pod
            if not os.path.exists(os.path.expanduser(DEFAULT_KUBECONFIG)):
                raise k8s_config.ConfigException(
                    f"no credentials: neither a service account nor a kubeconfig ({DEFAULT_KUBECONFIG}) was found"
                ) from None
    path = explicit or DEFAULT_KUBECONFIG
    if not any(os.path.exists(os.path.expanduser(p)) for p in path.split(os.pathsep) if p):
        # the client's loader skips missing files and then only says it found no configuration
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    # the path is passed on: the client's own default was read from $KUBECONFIG at its import
    k8s_config.load_kube_config(config_file=path, client_configuration=configuration, persist_config=False)
    return configuration


def _send(api: k8s.ApiClient, method: str, path: str, body: Any, params: dict[str, str], content_type: str) -> Any:
    """One request, blocking (run in a thread): the decoded answer, or ApiError."""
    request = api.param_serialize(
        method,
        path,
        query_params=list(params.items()),
        header_params={"Accept": "application/json", "Content-Type": content_type},
        body=body,
        auth_settings=["BearerToken"],
    )
    try:
        response = api.call_api(*request, _request_timeout=REQUEST_TIMEOUT)
        data = response.read()
    except urllib3.exceptions.ConnectTimeoutError as exc:  # a refused or timed-out connect, an unknown host
        raise ApiError(503, UNREACHABLE, repr(exc)) from exc
    except k8s.ApiException as exc:  # status 0: the client's word for a failed TLS handshake
        raise ApiError(503, UNREACHABLE, exc.reason or repr(exc)) from exc
    except urllib3.exceptions.HTTPError as exc:  # read timeout, connection reset, a cut-off answer
        raise ApiError(503, DISCONNECTED, repr(exc)) from exc
    try:
        payload = json.loads(data) if data else None
    except ValueError:  # not JSON (a proxy's error page)
        payload = None
    if 200 <= response.status < 300:
        return payload
    status = payload if isinstance(payload, dict) else {}
    reason = status.get("reason") or response.reason or ""
    raise ApiError(response.status, reason, status.get("message", ""), _seconds(response.headers.get("Retry-After")))


def _seconds(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:  # an HTTP date: the API server sends seconds
        return None


class KubeClient:
    """The operator's API calls, as coroutines (operator/deploy/rbac.py grants each one).

    ``load`` makes the client's Configuration: at the start and again after a 401."""

    def __init__(self, load: Callable[[], k8s.Configuration] = load_configuration) -> None:
        self._load = load
        self._lock = threading.Lock()
        self._api = self._connect()

    @classmethod
    def from_environment(cls) -> KubeClient:
        return cls(load_configuration)

    def _connect(self) -> k8s.ApiClient:
        configuration = self._load()
        configuration.retries = False  # urllib3 would retry by itself, a POST included: request() decides
        api = k8s.ApiClient(configuration)
        api.user_agent = FIELD_MANAGER
        return api

    def _reconnect(self, stale: k8s.ApiClient) -> None:
        """Fresh credentials, once for all requests that got a 401 from the same client. Requests
        still in flight on the stale one finish there."""
        with self._lock:
            if self._api is stale:
                self._api = self._connect()

    async def close(self) -> None:
        await asyncio.to_thread(self._api.close)

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        """Send one request, retried as retry_delay says, with fresh credentials once on a 401."""
        relogged = False
        attempt = 0
        while True:
            api = self._api
            try:
                return await asyncio.to_thread(_send, api, method, path, body, params or {}, content_type)
            except ApiError as error:
                if error.status == 401 and not relogged:
                    relogged = True
                    await asyncio.to_thread(self._reconnect, api)
                    continue
                delay = retry_delay(method, error, attempt)
                if delay is None:
                    raise
                attempt += 1
                logger.debug(f"{method} {path}: {error}; again in {delay:.1f}s")
                await asyncio.sleep(delay)

    # -- the calls the operator makes (operator/deploy/rbac.py lists their permissions) ------------------

    async def get(self, kind: ResourceKind, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", kind.path(namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, kind: ResourceKind, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        selector = ",".join(f"{key}={value}" for key, value in sorted(labels.items()))
        answer = await self.request("GET", kind.path(namespace), params={"labelSelector": selector})
        items = answer.get("items") or []
        for item in items:  # list items come without apiVersion/kind
            item.setdefault("apiVersion", kind.api_version)
            item.setdefault("kind", kind.kind)
        return items

    async def apply(self, obj: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        """Server-side apply: creates the object or takes over exactly the fields it names. A dry
        run is validated and admitted as the write would be, and stores nothing."""
        kind = kind_of(obj)
        meta = obj["metadata"]
        params = {"fieldManager": FIELD_MANAGER, "force": "true"} | ({"dryRun": "All"} if dry_run else {})
        return await self.request(
            "PATCH",
            kind.path(meta.get("namespace"), meta["name"]),
            body=obj,
            params=params,
            content_type="application/apply-patch+yaml",  # sent as JSON, which is YAML
        )

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        """POST: a 409 (AlreadyExists) raises, where an apply would take the object over."""
        return await self.request("POST", kind_of(obj).path(obj["metadata"]["namespace"]), body=obj)

    async def delete(self, kind: ResourceKind, namespace: str, name: str, uid: str | None = None) -> None:
        options: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        if uid:
            options["preconditions"] = {"uid": uid}  # never delete a same-named newcomer
        try:
            await self.request("DELETE", kind.path(namespace, name), body=options)
        except ApiError as exc:
            if exc.status not in (404, 409):
                raise

    async def patch_status(
        self, kind: ResourceKind, namespace: str, name: str, status: dict[str, Any], resource_version: str | None = None
    ) -> None:
        """Merge-patch the status subresource; with `resource_version`, only if nobody wrote since (else 409)."""
        body: dict[str, Any] = {"status": status}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        await self.request(
            "PATCH", kind.path(namespace, name, "status"), body=body, content_type="application/merge-patch+json"
        )

    async def patch_merge(self, kind: ResourceKind, namespace: str, name: str, patch: dict[str, Any]) -> None:
        await self.request("PATCH", kind.path(namespace, name), body=patch, content_type="application/merge-patch+json")

    async def serves(self, kind: ResourceKind) -> bool:
        """Discovery: is this kind served (e.g. is the Prometheus operator's PodMonitor CRD installed)?"""
        try:
            answer = await self.request("GET", kind.group_path)
        except ApiError as exc:
            if exc.status in (403, 404, 503):
                return False
            raise
        return any(r.get("name") == kind.plural for r in (answer or {}).get("resources", []))
