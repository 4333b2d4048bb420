"""Fixtures for the operator's integration tests: the emulated API server (emulator.py) in its own
thread and loop, a kubeconfig pointing at it, the real kopf operator through KopfRunner, and a
small synchronous client (what kubectl would do)."""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.operator.emulator import INFERENCE_SERVICES, Call, RunningCluster, kubeconfig, make_cluster, serve
from tests.operator.resource import crdcheck

CRD_FILE = Path(__file__).resolve().parents[2] / "crds" / "inferenceservice.yaml"


@functools.cache
def _crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_FILE.read_text())


# Read by llmfleet.operator.handlers at import: resync every 2 s, so a test sees several passes.
os.environ.setdefault("LLMFLEET_OPERATOR_RESYNC_SECONDS", "2")
# The operator's default server image, as the chart sets it (specs here name none).
TEST_IMAGE = "registry.example/llm-fleet:0.1.0-cpu"
os.environ.setdefault("LLMFLEET_SERVER_IMAGE", TEST_IMAGE)

NAMESPACE = "ml"
PATHS = {
    "InferenceService": f"/apis/llmfleet.io/v1alpha1/namespaces/{NAMESPACE}/inferenceservices",
    "Deployment": f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments",
    "LeaderWorkerSet": f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NAMESPACE}/leaderworkersets",
    "Service": f"/api/v1/namespaces/{NAMESPACE}/services",
    "ConfigMap": f"/api/v1/namespaces/{NAMESPACE}/configmaps",
    "PodDisruptionBudget": f"/apis/policy/v1/namespaces/{NAMESPACE}/poddisruptionbudgets",
    "NetworkPolicy": f"/apis/networking.k8s.io/v1/namespaces/{NAMESPACE}/networkpolicies",
    "HorizontalPodAutoscaler": f"/apis/autoscaling/v2/namespaces/{NAMESPACE}/horizontalpodautoscalers",
    "Role": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NAMESPACE}/roles",
    "ServiceAccount": f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts",
    "PodMonitor": f"/apis/monitoring.coreos.com/v1/namespaces/{NAMESPACE}/podmonitors",
    "Event": f"/api/v1/namespaces/{NAMESPACE}/events",
    "Secret": f"/api/v1/namespaces/{NAMESPACE}/secrets",
    "Pod": f"/api/v1/namespaces/{NAMESPACE}/pods",  # no kubelet: a test plays it
}


def eventually(check: Callable[[], Any], timeout: float = 15.0, interval: float = 0.1) -> Any:
    """Poll until check() returns something truthy without raising; then return it.

    A missing key or an absent object (KeyError, TypeError on None) means "not written yet":
    the operator writes status after its children, so a check may read it before it exists.
    """
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except (AssertionError, KeyError, TypeError, httpx.HTTPError) as exc:  # not yet, or not up yet
            last = exc
        time.sleep(interval)
    if last is not None:
        raise last
    raise AssertionError(f"timed out after {timeout}s waiting for {check}")


class Kube:
    """What a user does with kubectl, against the emulated API server."""

    def __init__(self, running: RunningCluster) -> None:
        self.running = running
        self.http = httpx.Client(base_url=running.url, timeout=10)

    @property
    def cluster(self):
        return self.running.cluster

    def create(self, doc: dict[str, Any], *, schema_checked: bool = True) -> dict[str, Any]:
        """Create ``doc``; an InferenceService first passes the CRD's schema and CEL rules, as on a
        real API server (``schema_checked=False``: what an older or hand-edited CRD lets through)."""
        if doc["kind"] == "InferenceService" and schema_checked:
            errors = crdcheck.validate(doc, _crd())
            assert not errors, f"the API server would reject this InferenceService: {errors}"
        response = self.http.post(PATHS[doc["kind"]], json=doc)
        response.raise_for_status()
        return response.json()

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        response = self.http.get(f"{PATHS[kind]}/{name}")
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return response.json()

    def list(self, kind: str) -> dict[str, dict[str, Any]]:
        response = self.http.get(PATHS[kind])
        if response.status_code == 404:
            return {}
        response.raise_for_status()
        return {item["metadata"]["name"]: item for item in response.json()["items"]}

    def patch(self, kind: str, name: str, patch: dict[str, Any], subresource: str = "") -> dict[str, Any]:
        suffix = f"/{subresource}" if subresource else ""
        response = self.http.patch(
            f"{PATHS[kind]}/{name}{suffix}", json=patch, headers={"Content-Type": "application/merge-patch+json"}
        )
        response.raise_for_status()
        return response.json()

    def delete(self, kind: str, name: str) -> None:
        self.http.delete(f"{PATHS[kind]}/{name}").raise_for_status()

    def writes(self) -> list[str]:
        return self.running.call(self.cluster.writes)

    def calls(self) -> list[tuple]:
        return self.running.call(self.cluster.calls)

    def condition(self, name: str, type_: str) -> dict[str, Any] | None:
        obj = self.get("InferenceService", name) or {}
        return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), None)

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.list("Event").values() if e["involvedObject"].get("name") == name]

    def quiet(self, seconds: float) -> list[str]:
        """The writes made during the next `seconds`."""
        before = len(self.writes())
        time.sleep(seconds)
        return self.writes()[before:]


@pytest.fixture
def running() -> Iterator[RunningCluster]:
    """The emulated API server alone (tests of our own client code, without kopf)."""
    running = serve(make_cluster())
    yield running
    running.stop()


@pytest.fixture
async def client(running: RunningCluster):
    """Our API client on the emulator, anonymous (the emulator asks for no credentials)."""
    from kubernetes.client import Configuration

    from llmfleet.operator.reconcile.cluster import KubeClient

    client = KubeClient(lambda: Configuration(host=running.url))
    yield client
    await client.close()


@pytest.fixture
def cluster_options() -> dict[str, Any]:
    return {}


@pytest.fixture
def kube(cluster_options, tmp_path, monkeypatch) -> Iterator[Kube]:
    running = serve(make_cluster(**cluster_options))
    config = tmp_path / "kubeconfig"
    config.write_text(kubeconfig(running.url))
    monkeypatch.setenv("KUBECONFIG", str(config))
    client = Kube(running)
    try:
        yield client
    finally:
        client.http.close()
        running.stop()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def verbs_of(call: Call) -> set[str]:
    """The RBAC verbs a request needs (a server-side apply may create the object)."""
    if call.method == "GET":
        if call.params.get("watch") in ("true", "1"):
            return {"watch"}
        return {"get"} if call.name else {"list"}
    if call.method == "PATCH" and call.content_type.startswith("application/apply-patch"):
        return {"patch", "create"}
    return {{"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[call.method]}


def assert_calls_covered_by_rbac(kube: Kube) -> None:
    """Every request the operator (kopf's or ours) made is granted by llmfleet.operator.deploy.rbac."""
    from llmfleet.operator.deploy.rbac import allows

    made = {
        (call.group, call.resource, verb)
        for call in kube.calls()
        if call.user_agent.startswith(("kopf/", "llm-fleet-operator"))
        for verb in verbs_of(call)
    }
    missing = sorted(m for m in made if not allows(*m))
    assert not missing, f"API calls not covered by RBAC_RULES: {missing}"


@contextlib.contextmanager
def operator_running(kube: Kube, *extra: str) -> Iterator[Any]:
    """The real operator: `kopf run --standalone -A -m llmfleet.operator.handlers` in a thread,
    with its liveness endpoint (runner.liveness_url). On exit: a clean stop, and every API call
    it made is covered by the RBAC rules the chart grants."""
    from kopf.testing import KopfRunner

    liveness = f"http://127.0.0.1:{free_port()}/healthz"
    args = ["run", "--standalone", "--all-namespaces", "-m", "llmfleet.operator.handlers", "--liveness", liveness]
    with KopfRunner([*args, *extra], timeout=30) as runner:
        runner.liveness_url = liveness
        yield runner
    assert runner.exit_code == 0, runner.output[-5000:]
    assert runner.exception is None
    assert_calls_covered_by_rbac(kube)


@pytest.fixture
def operator(kube) -> Iterator[Any]:
    with operator_running(kube) as runner:
        yield runner


def settle(kube: Kube, name: str, generation: int | None = None, timeout: float = 20.0) -> dict[str, Any]:
    """Wait until the operator has acted on `generation` and then wrote nothing for a second."""

    def observed() -> dict[str, Any] | None:
        obj = kube.get("InferenceService", name)
        want = generation if generation is not None else obj["metadata"]["generation"]
        return obj if (obj.get("status") or {}).get("observedGeneration") == want else None

    eventually(observed, timeout)
    eventually(lambda: kube.quiet(1.0) == [], timeout)
    return kube.get("InferenceService", name)


def inference_service(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "llmfleet.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": copy.deepcopy(spec),
    }


__all__ = ["INFERENCE_SERVICES", "NAMESPACE", "Kube", "eventually", "inference_service", "operator_running", "settle"]
