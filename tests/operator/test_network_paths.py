"""Every InferenceService, colocated or disaggregated, as the real operator leaves it in the
emulated API server: routers, pools, Services and NetworkPolicies, such that traffic through the
client Service reaches the servers only through the routers. The emulator enforces no policy: the
objects read back are evaluated as a network plugin would (network_policy.admits)."""

from __future__ import annotations

import pytest

from llmfleet.operator.reconcile.network_policy import admits
from tests.operator.conftest import eventually, inference_service, settle
from tests.operator.test_handlers import TINY

SPECS = {
    "colocated": TINY,
    "disaggregated": {**TINY, "mode": "disaggregated", "pools": {"prefill": {}, "decode": {}}},
}


@pytest.mark.parametrize("mode", sorted(SPECS))
def test_traffic_through_the_service_reaches_the_servers_only_through_the_routers(kube, operator, mode):
    kube.create(inference_service("tiny", SPECS[mode]))
    pools = ["colocated"] if mode == "colocated" else ["prefill", "decode"]
    eventually(lambda: set(kube.list("NetworkPolicy")) == {f"tiny-{p}" for p in pools})
    settle(kube, "tiny", 1)
    deployments = kube.list("Deployment")
    assert set(deployments) == {*(f"tiny-{p}" for p in pools), "tiny-router"}
    assert set(kube.list("Service")) == {"tiny", *(f"tiny-{p}" for p in pools)}
    assert set(kube.list("Role")) == {"tiny-router"}  # the servers' own account has no Role
    assert set(kube.list("ServiceAccount")) == {"tiny-router", "tiny-server"}
    pods = {name.removeprefix("tiny-"): d["spec"]["template"]["metadata"]["labels"] for name, d in deployments.items()}
    policies = list(kube.list("NetworkPolicy").values())

    selector = kube.get("Service", "tiny")["spec"]["selector"]
    behind_the_service = [pool for pool, labels in pods.items() if selector.items() <= labels.items()]
    assert behind_the_service == ["router"]
    client = {"app": "curl"}
    assert admits(policies, pods["router"], "http", client)  # clients reach the routers
    for pool in pools:
        assert admits(policies, pods[pool], "http", pods["router"])  # the routers reach the servers
        assert not admits(policies, pods[pool], "http", client)  # nobody else does
        assert not admits(policies, pods[pool], "http", client, same_namespace=False)
        assert admits(policies, pods[pool], "metrics", {"app": "prometheus"}, same_namespace=False)
    if mode == "disaggregated":  # a decode server fetches KV from a prefill server, not the reverse
        assert admits(policies, pods["prefill"], "http", pods["decode"])
        assert not admits(policies, pods["decode"], "http", pods["prefill"])
    role = kube.get("Role", "tiny-router")
    wake = next(rule for rule in role["rules"] if rule["resources"] == ["configmaps"])
    assert wake == {
        "apiGroups": [""],
        "resources": ["configmaps"],
        "resourceNames": ["tiny-wake"],
        "verbs": ["get", "patch"],
    }
