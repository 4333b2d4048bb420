"""reconcile/cluster.py: the retry rule, where credentials come from, a 401's fresh login, and
what a server-side apply sends; against the emulated API server where a request is involved."""

from __future__ import annotations

import time

import pytest
from kubernetes.client import Configuration
from kubernetes.config import ConfigException

from llmfleet.operator.reconcile import cluster
from llmfleet.operator.reconcile.cluster import (
    CONFIG_MAP,
    DISCONNECTED,
    FIELD_MANAGER,
    INFERENCE_SERVICE,
    MAX_RETRY_AFTER,
    POD_MONITOR,
    UNREACHABLE,
    ApiError,
    KubeClient,
    load_configuration,
    retry_delay,
)
from tests.operator.emulator import Fault, kubeconfig

BACKOFFS = (0.01, 0.02)


@pytest.fixture(autouse=True)
def short_backoffs(monkeypatch):
    monkeypatch.setattr(cluster, "RETRY_BACKOFFS", BACKOFFS)


def config_map(name: str, data: dict[str, str] | None = None) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": "ml"},
        "data": data or {"a": "1"},
    }


def calls(running, method: str, part: str) -> list:
    return [c for c in running.call(running.cluster.calls) if c.method == method and part in c.resource]


# -- the retry rule ----------------------------------------------------------------------------


def test_throttling_is_retried_for_any_request_after_the_servers_retry_after():
    throttled = ApiError(429, "TooManyRequests", "slow down", retry_after=3.0)
    assert retry_delay("POST", throttled, 0) == 3.0
    assert retry_delay("PATCH", ApiError(429, "TooManyRequests", ""), 1) == BACKOFFS[1]  # none given: ours
    assert retry_delay("GET", ApiError(429, "", "", retry_after=3600), 0) == MAX_RETRY_AFTER


def test_server_errors_are_retried_for_requests_that_may_land_twice():
    for method in ("GET", "PATCH", "PUT", "DELETE"):
        assert retry_delay(method, ApiError(500, "InternalError", ""), 0) == BACKOFFS[0]
        assert retry_delay(method, ApiError(503, DISCONNECTED, ""), 1) == BACKOFFS[1]
    assert retry_delay("GET", ApiError(503, "ServiceUnavailable", "", retry_after=1), 0) == 1
    # a POST that failed may have created its object: a retry would answer 409
    assert retry_delay("POST", ApiError(500, "InternalError", ""), 0) is None
    assert retry_delay("POST", ApiError(503, DISCONNECTED, ""), 0) is None
    assert retry_delay("POST", ApiError(503, UNREACHABLE, ""), 0) == BACKOFFS[0]  # never sent


def test_answers_are_not_retried_and_retries_run_out():
    for status in (400, 403, 404, 409, 422):
        assert retry_delay("GET", ApiError(status, "", ""), 0) is None
    assert retry_delay("GET", ApiError(500, "", ""), len(BACKOFFS)) is None


async def test_a_throttled_apply_waits_as_long_as_the_server_asks(running, client):
    running.call(lambda: running.cluster.faults.append(Fault("PATCH", "/configmaps/", 429, times=1, retry_after=1)))
    started = time.monotonic()
    await client.apply(config_map("throttled"))
    assert time.monotonic() - started >= 0.9  # Retry-After: 1, not the 0.01 s backoff
    assert len(calls(running, "PATCH", "configmaps")) == 2


async def test_a_failed_create_is_not_sent_twice(running, client):
    running.call(lambda: running.cluster.faults.append(Fault("POST", "/configmaps", 500, times=1)))
    with pytest.raises(ApiError) as err:
        await client.create(config_map("once"))
    assert err.value.status == 500 and err.value.retryable
    assert len(calls(running, "POST", "configmaps")) == 1
    await client.create(config_map("once"))  # the next pass's try


async def test_an_invalid_write_is_raised_at_once(running, client):
    running.call(lambda: running.cluster.faults.append(Fault("PATCH", "/configmaps/", 422, times=2)))
    with pytest.raises(ApiError) as err:
        await client.apply(config_map("invalid"))
    assert (err.value.status, err.value.reason, err.value.message) == (422, "InjectedFault", "injected by the test")
    assert len(calls(running, "PATCH", "configmaps")) == 1


async def test_an_api_server_that_is_not_there():
    client = KubeClient(lambda: Configuration(host="http://127.0.0.1:1"))
    try:
        with pytest.raises(ApiError) as err:
            await client.get(CONFIG_MAP, "ml", "any")
        assert err.value.status == 503 and err.value.reason == UNREACHABLE and err.value.retryable
        assert await client.serves(POD_MONITOR) is False
    finally:
        await client.close()


# -- what a request sends -----------------------------------------------------------------------


async def test_server_side_apply_sends_its_field_manager_and_forces(running, client):
    await client.apply(config_map("dry"), dry_run=True)
    assert await client.get(CONFIG_MAP, "ml", "dry") is None  # a dry run stores nothing
    applied = await client.apply(config_map("applied", {"b": "2"}))
    assert applied["data"] == {"b": "2"} and applied["metadata"]["uid"]
    dry, real = calls(running, "PATCH", "configmaps")
    for call in (dry, real):
        assert call.content_type == "application/apply-patch+yaml"
        assert call.user_agent == FIELD_MANAGER
        assert call.params["fieldManager"] == FIELD_MANAGER and call.params["force"] == "true"
    assert dry.params["dryRun"] == "All" and "dryRun" not in real.params


async def test_lists_select_by_label_and_say_what_they_hold(running, client):
    for name, team in (("a", "x"), ("b", "y")):
        await client.create(config_map(name) | {"metadata": {"name": name, "namespace": "ml", "labels": {"t": team}}})
    (item,) = await client.list(CONFIG_MAP, "ml", {"t": "y"})
    assert (item["apiVersion"], item["kind"], item["metadata"]["name"]) == ("v1", "ConfigMap", "b")


async def test_discovery_says_which_kinds_are_served(client):
    assert await client.serves(INFERENCE_SERVICE) and await client.serves(CONFIG_MAP)
    assert not await client.serves(POD_MONITOR)  # the emulator runs without the Prometheus operator


# -- credentials ----------------------------------------------------------------------------------


@pytest.fixture
def pod(tmp_path, monkeypatch):
    """What a pod's service account looks like to the client."""
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    (tmp_path / "token").write_text("pod-token")
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    monkeypatch.setattr("kubernetes.config.incluster_config.SERVICE_TOKEN_FILENAME", str(tmp_path / "token"))
    monkeypatch.setattr("kubernetes.config.incluster_config.SERVICE_CERT_FILENAME", str(tmp_path / "ca.crt"))


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty home, and no $KUBECONFIG."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    return tmp_path / "home"


def write_kubeconfig(path, url: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(kubeconfig(url))
    return path


def test_in_a_pod_the_service_account(pod, home):
    write_kubeconfig(home / ".kube" / "config", "http://from-home:1")
    configuration = load_configuration()
    assert configuration.host == "https://10.0.0.1:443"
    assert configuration.get_api_key_with_prefix("BearerToken") == "bearer pod-token"


def test_an_explicit_kubeconfig_wins_over_the_service_account(pod, home, tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kubeconfig", "http://explicit:1")))
    configuration = load_configuration()
    assert configuration.host == "http://explicit:1"
    assert configuration.get_api_key_with_prefix("BearerToken") == "Bearer test-token"


def test_outside_a_pod_the_kubeconfig_at_home(home):
    with pytest.raises(ConfigException, match="neither a service account nor a kubeconfig"):
        load_configuration()
    write_kubeconfig(home / ".kube" / "config", "http://from-home:1")
    assert load_configuration().host == "http://from-home:1"


def test_a_kubeconfig_that_is_not_there_is_named(home, tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError) as err:
        load_configuration()
    assert err.value.filename == str(tmp_path / "missing")


def test_kopf_logs_in_with_the_same_credentials(pod, home):
    from llmfleet.operator.handlers import connection_info

    info = connection_info(load_configuration())
    assert (info.server, info.scheme, info.token) == ("https://10.0.0.1:443", "bearer", "pod-token")
    assert info.ca_path.endswith("ca.crt") and not info.insecure


async def test_an_expired_token_logs_in_again_once(running, tmp_path, monkeypatch):
    """The first load has no token (the emulator takes it); after a 401 the kubeconfig's counts."""
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kubeconfig", running.url)))
    loads = []

    def load() -> Configuration:
        loads.append(len(loads))
        return Configuration(host=running.url) if len(loads) == 1 else load_configuration()

    client = KubeClient(load)
    try:
        running.call(lambda: running.cluster.faults.append(Fault("PATCH", "/configmaps/", 401, times=1)))
        await client.apply(config_map("after-login"))
        auth = [r.headers.get("Authorization") for r in running.call(lambda: list(running.cluster._requests))]
        assert auth == [None, "Bearer test-token"] and len(loads) == 2

        running.call(lambda: running.cluster.faults.append(Fault("PATCH", "/configmaps/", 401, times=2)))
        with pytest.raises(ApiError) as err:  # still refused with fresh credentials: the answer stands
            await client.apply(config_map("refused"))
        assert err.value.status == 401 and len(loads) == 3
    finally:
        await client.close()
