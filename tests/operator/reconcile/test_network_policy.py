"""Who may reach the servers: the rendered NetworkPolicies, read as a network plugin enforces them
(``admits``), against the labels of the pods the Deployments make. The emulated API server
enforces no policy; these tests are the check that the policies say what the docs promise."""

from __future__ import annotations

import pytest
import yaml

from llmfleet.operator.reconcile.desired import Owner, desired_objects
from llmfleet.operator.reconcile.network_policy import admits
from llmfleet.operator.resource.spec import parse_spec

EXAMPLES = ["local", "colocated-chat", "disaggregated-long-prompt", "local-disaggregated"]
A_CLIENT = {"app": "some-client"}


def rendered(repo_root, example: str, metrics_peers: dict[str, str] | None = None):
    doc = yaml.safe_load((repo_root / "examples" / f"{example}.yaml").read_text())
    owner = Owner(doc["metadata"]["name"], "ml", "uid")
    return desired_objects(owner, parse_spec(doc["spec"]), metrics_peers=metrics_peers)


def pod_labels(objects) -> dict[str, dict[str, str]]:
    """Each pool's pod labels, as its Deployment's template gives them."""
    return {
        o["metadata"]["labels"]["llmfleet.io/pool"]: o["spec"]["template"]["metadata"]["labels"]
        for o in objects
        if o["kind"] == "Deployment"
    }


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("example", EXAMPLES)
def test_clients_reach_the_servers_only_through_the_routers(repo_root, example):
    objects = rendered(repo_root, example)
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    pods = pod_labels(objects)
    servers = {pool: labels for pool, labels in pods.items() if pool != "router"}
    name = next(o for o in objects if o["kind"] == "Service" and "clusterIP" not in o["spec"])["metadata"]["name"]
    client_service = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == name)
    # the client Service's endpoints are the routers, no server
    assert [pool for pool, labels in pods.items() if selects(client_service["spec"]["selector"], labels)] == ["router"]
    # every server pool is guarded; the routers are the open endpoint
    assert {p["metadata"]["name"].removeprefix(f"{name}-") for p in policies} == set(servers)
    assert admits(policies, pods["router"], "http", A_CLIENT)
    other_router = {**pods["router"], "llmfleet.io/inference-service": "another"}
    for pool, labels in servers.items():
        assert admits(policies, labels, "http", pods["router"]), pool
        assert not admits(policies, labels, "http", A_CLIENT), pool
        assert not admits(policies, labels, "http", other_router), pool  # another fleet's router
        assert not admits(policies, labels, "http", A_CLIENT, same_namespace=False), pool
        # scrapers: the metrics port, and nothing else, from anywhere by default
        assert admits(policies, labels, "metrics", {"app": "prometheus"}, same_namespace=False), pool
        for peer, peer_labels in servers.items():  # server to server: only a decode server's KV fetch
            may = pool == "prefill" and peer == "decode"
            assert admits(policies, labels, "http", peer_labels) == may, (peer, pool)


def test_the_metrics_port_opens_to_the_namespaces_the_operator_is_told(repo_root):
    objects = rendered(repo_root, "local", {"kubernetes.io/metadata.name": "monitoring"})
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    server = pod_labels(objects)["colocated"]
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    monitoring = {"kubernetes.io/metadata.name": "monitoring"}
    assert admits(policies, server, "metrics", prometheus, source_namespace_labels=monitoring, same_namespace=False)
    elsewhere = {"kubernetes.io/metadata.name": "default"}
    assert not admits(policies, server, "metrics", prometheus, source_namespace_labels=elsewhere, same_namespace=False)
    assert not admits(policies, server, "http", prometheus, source_namespace_labels=monitoring, same_namespace=False)


def test_admits_reads_policies_as_a_network_plugin_does():
    target = {"app": "db"}
    deny_all = {"spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}
    assert admits([], target, "http", A_CLIENT)  # no policy selects it: open
    assert not admits([deny_all], target, "http", A_CLIENT)
    any_source = {"spec": {"podSelector": {"matchLabels": target}, "ingress": [{"ports": [{"port": "http"}]}]}}
    assert admits([deny_all, any_source], target, "http", A_CLIENT)  # policies add up
    assert not admits([deny_all, any_source], target, "metrics", A_CLIENT)
    expression = {"matchExpressions": [{"key": "tier", "operator": "In", "values": ["web"]}]}
    web_only = {"spec": {"podSelector": {}, "ingress": [{"from": [{"podSelector": expression}]}]}}
    assert admits([web_only], target, "any", {"tier": "web"}) and not admits([web_only], target, "any", {"tier": "x"})
    egress_only = {"spec": {"podSelector": {}, "policyTypes": ["Egress"]}}
    assert admits([egress_only], target, "http", A_CLIENT)
