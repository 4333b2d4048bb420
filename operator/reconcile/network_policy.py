"""Who may reach a fleet's servers, as NetworkPolicies, and how such a policy decides.

A server pod's API port takes requests from its own InferenceService's router pods, and a
prefill server's also from that fleet's decode servers (they fetch KV from it over the same
port: the KV-transfer token, not the network, limits them to the KV paths). The metrics port
(``/metrics``, ``/load``, the probes: nothing that generates) takes any pod of the namespaces the
operator is told Prometheus and the operator itself run in (every namespace by default). So no
client reaches a server past the router. The router pods have no policy: they are the client
endpoint. The kubelet's probes come from the node, which NetworkPolicies always admit.

``admits`` reads policies as a network plugin enforces them (the emulated API server in the tests
enforces none): whether a pod with some labels may reach another pod's named port.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def server_policy(
    meta: dict[str, Any],
    pod_selector: Mapping[str, str],
    api_peers: Iterable[Mapping[str, str]],
    metrics_namespaces: Mapping[str, str],
    group: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The policy of one pool's server pods (``pod_selector``): the API port ("http") from pods in
    the same namespace matching one of ``api_peers``, the metrics port ("metrics") from any pod of
    a namespace labelled ``metrics_namespaces`` (empty: every namespace). ``group``: the pods of a
    pool whose replicas span nodes, which reach each other on every port: torch.distributed's
    rendezvous on the master port, and the connections NCCL and Gloo open on ports they pick."""
    ingress: list[dict[str, Any]] = [
        {
            "from": [{"podSelector": {"matchLabels": dict(peer)}} for peer in api_peers],
            "ports": [{"protocol": "TCP", "port": "http"}],
        },
        {
            "from": [{"namespaceSelector": {"matchLabels": dict(metrics_namespaces)}}],
            "ports": [{"protocol": "TCP", "port": "metrics"}],
        },
    ]
    if group is not None:
        ingress.append({"from": [{"podSelector": {"matchLabels": dict(group)}}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta,
        "spec": {
            "podSelector": {"matchLabels": dict(pod_selector)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def _matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions) against labels; an empty one matches all."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        present = key in labels
        if operator == "In" and not (present and labels[key] in values):
            return False
        if operator == "NotIn" and present and labels[key] in values:
            return False
        if operator == "Exists" and not present:
            return False
        if operator == "DoesNotExist" and present:
            return False
    return True


def _peer_admits(
    peer: Mapping[str, Any], namespace_labels: Mapping[str, str], same_namespace: bool, pod: Mapping[str, str]
) -> bool:
    if "ipBlock" in peer:
        return False  # pods are judged by their labels here
    if "namespaceSelector" in peer:
        if not _matches(peer["namespaceSelector"], namespace_labels):
            return False
    elif not same_namespace:  # a podSelector alone: pods of the policy's own namespace
        return False
    return _matches(peer.get("podSelector") or {}, pod)


def admits(
    policies: Iterable[Mapping[str, Any]],
    target: Mapping[str, str],
    port: str,
    source: Mapping[str, str],
    *,
    source_namespace_labels: Mapping[str, str] | None = None,
    same_namespace: bool = True,
) -> bool:
    """May a pod labelled ``source`` reach the named ``port`` of a pod labelled ``target`` (in the
    policies' namespace)? Open when no policy selects the target for ingress; else when one of
    the selecting policies' rules admits the source on that port (a rule without ``ports`` admits
    every port, one without ``from`` every source)."""
    selecting = [
        p
        for p in policies
        if "Ingress" in p["spec"].get("policyTypes", ["Ingress"]) and _matches(p["spec"]["podSelector"], target)
    ]
    if not selecting:
        return True
    namespace_labels = source_namespace_labels or {}
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            ports = rule.get("ports")
            if ports is not None and not any(p.get("port") == port for p in ports):
                continue
            peers = rule.get("from")
            if peers is None or any(_peer_admits(peer, namespace_labels, same_namespace, source) for peer in peers):
                return True
    return False
