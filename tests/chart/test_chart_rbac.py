"""Least-privilege RBAC: the chart grants exactly the operator's own list of API calls
(llmfleet.operator.deploy.rbac.RBAC_RULES, via files/rbac-rules.yaml), nothing more and no wildcards,
cluster-wide or per watched namespace."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from tests.chart.conftest import CHART, RELEASE_NAMESPACE, VARIANTS, WATCHED, by_kind, rbac_rules_or_skip

RULES_FILE = CHART / "files" / "rbac-rules.yaml"
SYNC_HINT = "run `python scripts/chart-sync.py` to regenerate charts/llm-fleet/files/rbac-rules.yaml"
PEERING_GROUP = "kopf.dev"
RBAC_VARIANTS = [v for v in sorted(VARIANTS) if VARIANTS[v].get("rbac", {}).get("create", True)]


class Grant(NamedTuple):
    group: str
    resource: str
    verb: str
    names: tuple[str, ...]


def grants_of_rules(rules: list[dict[str, Any]]) -> set[Grant]:
    return {
        Grant(group, resource, verb, tuple(sorted(rule.get("resourceNames", []))))
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def grants_of_permissions(perms, scope: str | None = None, peering: bool = True) -> set[Grant]:
    return {
        Grant(p.group, p.resource, p.verb, p.resource_names)
        for p in perms
        if (scope is None or p.scope == scope) and (peering or p.group != PEERING_GROUP)
    }


def rules_file_permissions(chart_sync) -> set:
    sections = yaml.safe_load(RULES_FILE.read_text())
    rules = [{**rule, "scope": scope} for scope in ("namespaced", "cluster") for rule in sections.get(scope) or []]
    return chart_sync.permissions(rules)


def rbac_objects(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["apiVersion"].startswith("rbac.authorization.k8s.io/")]


def assert_grants_exactly(docs: list[dict[str, Any]], perms, values: dict[str, Any]) -> None:
    """The RBAC objects rendered with `values` grant exactly `perms` in the right places."""
    peering = values.get("peering", {}).get("enabled", False)
    namespaced = grants_of_permissions(perms, "namespaced", peering)
    cluster = grants_of_permissions(perms, "cluster", peering)
    cluster_roles = {d["metadata"]["name"]: d for d in by_kind(docs, "ClusterRole")}
    roles = by_kind(docs, "Role")
    if not values.get("watchNamespaces"):
        assert not roles, "watching all namespaces needs no Role"
        assert len(cluster_roles) == 1
        (role,) = cluster_roles.values()
        assert grants_of_rules(role["rules"]) == namespaced | cluster
    else:
        assert sorted(r["metadata"]["namespace"] for r in roles) == sorted(values["watchNamespaces"])
        for role in roles:
            extra = grants_of_rules(role["rules"]) - namespaced
            missing = namespaced - grants_of_rules(role["rules"])
            assert not extra and not missing, f"Role in {role['metadata']['namespace']}: {extra=} {missing=}"
        # given exact names, the operator makes no cluster-scoped call (tests/operator/test_namespaced.py)
        assert not cluster_roles and not by_kind(docs, "ClusterRoleBinding"), (
            "a namespaced install grants nothing cluster-wide"
        )


@pytest.mark.parametrize("variant", RBAC_VARIANTS)
def test_rendered_rbac_is_the_rules_file(render, chart_sync, variant: str) -> None:
    assert_grants_exactly(render(VARIANTS[variant]), rules_file_permissions(chart_sync), VARIANTS[variant])


def test_rules_file_is_generated_from_operator_rbac_rules(chart_sync) -> None:
    rules = rbac_rules_or_skip(chart_sync)
    assert RULES_FILE.read_text() == chart_sync.rules_file_text(rules), SYNC_HINT


@pytest.mark.parametrize("variant", RBAC_VARIANTS)
def test_rendered_rbac_covers_exactly_the_operators_api_calls(render, chart_sync, variant: str) -> None:
    perms = chart_sync.permissions(rbac_rules_or_skip(chart_sync))
    assert_grants_exactly(render(VARIANTS[variant]), perms, VARIANTS[variant])


def test_operator_rules_allow_kopf_peering(chart_sync) -> None:
    """The chart offers peering; kopf then lists, watches and patches its peering objects."""
    perms = chart_sync.permissions(rbac_rules_or_skip(chart_sync))
    for resource, scope in (("clusterkopfpeerings", "cluster"), ("kopfpeerings", "namespaced")):
        verbs = {p.verb for p in perms if p.group == PEERING_GROUP and p.resource == resource and p.scope == scope}
        assert {"list", "watch", "patch"} <= verbs, f"RBAC_RULES lacks {resource} for kopf peering: {verbs}"


@pytest.mark.parametrize("variant", RBAC_VARIANTS)
def test_the_operator_may_block_its_owners_deletion(render, variant: str) -> None:
    """Children carry ownerReferences with blockOwnerDeletion: true; with the
    OwnerReferencesPermissionEnforcement admission plugin (OpenShift's default) that takes update
    on the owner's finalizers, in every namespace the operator serves."""
    docs = render(VARIANTS[variant])
    roles = by_kind(docs, "Role") or by_kind(docs, "ClusterRole")
    for role in roles:
        assert Grant("llmfleet.io", "inferenceservices/finalizers", "update", ()) in grants_of_rules(role["rules"])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_no_wildcards_or_escalation(render, variant: str) -> None:
    for obj in rbac_objects(render(VARIANTS[variant])):
        for rule in obj.get("rules", []):
            assert "nonResourceURLs" not in rule, obj["metadata"]["name"]
            for key in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert not any("*" in item for item in rule.get(key, [])), (obj["metadata"]["name"], rule)
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), rule
            if "secrets" in rule["resources"]:  # the KV-transfer token it makes (kv_secret.py)
                assert rule["verbs"] == ["create"], "the operator reads no Secrets"


@pytest.mark.parametrize("variant", RBAC_VARIANTS)
def test_bindings_tie_the_service_account_to_its_roles(render, variant: str) -> None:
    docs = render(VARIANTS[variant])
    account = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["serviceAccountName"]
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in by_kind(docs, "Role")}
    roles |= {(d["kind"], None, d["metadata"]["name"]) for d in by_kind(docs, "ClusterRole")}
    bound = set()
    for binding in by_kind(docs, "RoleBinding") + by_kind(docs, "ClusterRoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": RELEASE_NAMESPACE}]
        ref = binding["roleRef"]
        namespace = binding["metadata"].get("namespace") if ref["kind"] == "Role" else None
        assert (ref["kind"], namespace, ref["name"]) in roles, binding["metadata"]["name"]
        bound.add((ref["kind"], namespace, ref["name"]))
    assert bound == roles, "every role is bound"
    if VARIANTS[variant].get("watchNamespaces") == WATCHED:
        assert {b["metadata"]["namespace"] for b in by_kind(docs, "RoleBinding")} == set(WATCHED)


# -- scripts/chart-sync.py reads the rule formats RBAC_RULES may use -------------------------------


@dataclass
class RuleObject:
    api_groups: list[str]
    resources: list[str]
    verbs: list[str]


def test_rule_formats_and_scope(chart_sync) -> None:
    perms = chart_sync.permissions(
        [
            {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", "patch"]},
            ("", "events", ["create"]),
            RuleObject(["apiextensions.k8s.io"], ["customresourcedefinitions"], ["list"]),
            {"api_groups": "kopf.dev", "resources": "clusterkopfpeerings", "verbs": "patch"},
            {"apiGroups": ["x.io"], "resources": ["widgets"], "verbs": ["get"], "scope": "Cluster"},
            {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["a"], "verbs": ["get"]},
        ]
    )
    scopes = {(p.resource, p.verb): p.scope for p in perms}
    assert scopes == {
        ("deployments", "get"): "namespaced",
        ("deployments", "patch"): "namespaced",
        ("events", "create"): "namespaced",
        ("customresourcedefinitions", "list"): "cluster",
        ("clusterkopfpeerings", "patch"): "cluster",
        ("widgets", "get"): "cluster",
        ("configmaps", "get"): "namespaced",
    }
    assert next(p for p in perms if p.resource == "configmaps").resource_names == ("a",)
    with pytest.raises(ValueError):
        chart_sync.permissions([{"apiGroups": [""], "resources": ["pods"]}])


names = st.sampled_from(["", "apps", "policy", "llmfleet.io", "kopf.dev", "apiextensions.k8s.io"])
resources = st.sampled_from(["pods", "services", "deployments", "inferenceservices/status", "namespaces"])
verbs = st.sampled_from(["get", "list", "watch", "create", "patch", "update", "delete"])
rules = st.lists(
    st.fixed_dictionaries(
        {
            "apiGroups": st.lists(names, min_size=1, max_size=2),
            "resources": st.lists(resources, min_size=1, max_size=3),
            "verbs": st.lists(verbs, min_size=1, max_size=4),
        }
    ),
    max_size=6,
)


@given(rules)
def test_compact_rules_grant_the_same_permissions(chart_sync, rule_list) -> None:
    perms = chart_sync.permissions(rule_list)
    sections = chart_sync.compact(perms)
    again = [{**rule, "scope": scope} for scope, section in sections.items() for rule in section]
    assert chart_sync.permissions(again) == perms
    assert chart_sync.rules_file_text(rule_list) == chart_sync.rules_file_text(list(reversed(rule_list)))
