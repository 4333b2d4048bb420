"""A small async Kubernetes API client for the operator's own calls (the child objects, the
InferenceService status, discovery). kopf keeps its own connection for watching and events.

Credentials come from kopf's public login helpers: ``$KUBECONFIG`` when set, else the pod's
service account, else ``~/.kube/config``. A 401 logs in again once (service-account tokens
rotate); 429, 5xx and dropped connections are retried with a short backoff.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp
import kopf

logger = logging.getLogger(__name__)

FIELD_MANAGER = "llm-fleet-operator"
RETRY_BACKOFFS = (0.2, 1.0, 3.0)


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

    def path(self, namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
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
SERVICE = ResourceKind("", "v1", "services", "Service")
CONFIG_MAP = ResourceKind("", "v1", "configmaps", "ConfigMap")
POD_DISRUPTION_BUDGET = ResourceKind("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget")
POD_MONITOR = ResourceKind("monitoring.coreos.com", "v1", "podmonitors", "PodMonitor")
POD = ResourceKind("", "v1", "pods", "Pod")
SERVICE_ACCOUNT = ResourceKind("", "v1", "serviceaccounts", "ServiceAccount")
ROLE = ResourceKind("rbac.authorization.k8s.io", "v1", "roles", "Role")
ROLE_BINDING = ResourceKind("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding")
SECRET = ResourceKind("", "v1", "secrets", "Secret")  # created, never read (kv_secret.py)

# Every kind reconcile.desired_objects() may return, in apply order (config and the router's
# account before their readers).
CHILD_KINDS: tuple[ResourceKind, ...] = (
    SERVICE_ACCOUNT,
    ROLE,
    ROLE_BINDING,
    CONFIG_MAP,
    SERVICE,
    DEPLOYMENT,
    POD_DISRUPTION_BUDGET,
    POD_MONITOR,
)


def kind_of(obj: dict[str, Any]) -> ResourceKind:
    for kind in (*CHILD_KINDS, INFERENCE_SERVICE, POD, SECRET):
        if kind.kind == obj.get("kind") and kind.api_version == obj.get("apiVersion"):
            return kind
    raise ValueError(f"the operator does not manage {obj.get('apiVersion')}/{obj.get('kind')}")


class ApiError(Exception):
    """A non-2xx answer from the API server, with its Status reason and message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def retryable(self) -> bool:
        return self.status in (409, 429) or self.status >= 500


def login(settings: kopf.OperatorSettings | None = None) -> kopf.ConnectionInfo:
    """Credentials the same way kopf's own fallback logins find them."""
    settings = settings or kopf.OperatorSettings()
    helpers = [kopf.login_with_service_account, kopf.login_with_kubeconfig]
    if os.environ.get("KUBECONFIG"):  # an explicit kubeconfig wins over an ambient service account
        helpers.reverse()
    for helper in helpers:
        info = helper(settings=settings)
        if info is not None:
            return info
    raise kopf.LoginError("no credentials: neither a service account nor a kubeconfig was found")


class KubeClient:
    def __init__(self, info: kopf.ConnectionInfo, settings: kopf.OperatorSettings | None = None) -> None:
        self._settings = settings
        self._info = info
        self._session = self._make_session(info)
        self._retired: list[aiohttp.ClientSession] = []

    @staticmethod
    def _make_session(info: kopf.ConnectionInfo) -> aiohttp.ClientSession:
        ssl_context = info.as_ssl_context() if info.server.startswith("https") else None
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=ssl_context if ssl_context is not None else True),
            headers={**info.as_http_headers(), "User-Agent": FIELD_MANAGER},
            timeout=aiohttp.ClientTimeout(total=30, sock_connect=10),
        )

    @classmethod
    def from_environment(cls, settings: kopf.OperatorSettings | None = None) -> KubeClient:
        return cls(login(settings), settings)

    async def close(self) -> None:
        await self._close_retired()
        await self._session.close()

    async def _relogin(self) -> None:
        """Fresh credentials (a rotated service-account token). Requests still in flight on the
        old session finish on it; it is closed at the next re-login (or close)."""
        await self._close_retired()
        self._retired.append(self._session)
        self._info = login(self._settings)
        self._session = self._make_session(self._info)

    async def _close_retired(self) -> None:
        while self._retired:
            await self._retired.pop().close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        relogged = False
        backoffs = list(RETRY_BACKOFFS)
        while True:
            try:
                async with self._session.request(
                    method,
                    self._info.server.rstrip("/") + path,
                    json=body,
                    params=params,
                    headers={"Content-Type": content_type} if body is not None else None,
                ) as response:
                    try:
                        payload = await response.json(content_type=None)
                    except ValueError:  # not JSON (a proxy's error page)
                        payload = None
                    if response.status < 400:
                        return payload
                    status = payload if isinstance(payload, dict) else {}
                    error = ApiError(response.status, status.get("reason", ""), status.get("message", ""))
            except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                error = ApiError(503, "Unreachable", repr(exc))
            if error.status == 401 and not relogged:
                relogged = True
                await self._relogin()
                continue
            if (error.status == 429 or error.status >= 500) and backoffs:
                await asyncio.sleep(backoffs.pop(0))
                continue
            raise error

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
            content_type="application/apply-patch+yaml",  # JSON is YAML
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
        path = f"/apis/{kind.group}/{kind.version}" if kind.group else f"/api/{kind.version}"
        try:
            answer = await self.request("GET", path)
        except ApiError as exc:
            if exc.status in (403, 404, 503):
                return False
            raise
        return any(r.get("name") == kind.plural for r in (answer or {}).get("resources", []))
