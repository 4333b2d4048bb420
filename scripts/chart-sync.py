#!/usr/bin/env python3
"""Keep the Helm chart's generated files in step with their sources:

  charts/llm-fleet/crds/inferenceservice.yaml  <- crds/inferenceservice.yaml (byte-identical copy)
  charts/llm-fleet/files/rbac-rules.yaml       <- llmfleet.operator.deploy.rbac.RBAC_RULES
  charts/llm-fleet/files/pod-security-rules.yaml <- llmfleet.operator.resource.pod_security.RULES

    python scripts/chart-sync.py          # write both
    python scripts/chart-sync.py --check  # exit 1 and say what differs (tests/chart runs this logic)

RBAC_RULES may be written as Kubernetes PolicyRule-like mappings (apiGroups/resources/verbs,
optional resourceNames and scope), as objects with such attributes, or as (group, resources, verbs)
tuples. The rules file splits them by scope, one rule per group and verb set, sorted, so the same
permissions always give the same file.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import yaml

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "llm-fleet"
CRD_SOURCE = REPO / "crds" / "inferenceservice.yaml"
CRD_COPY = CHART / "crds" / "inferenceservice.yaml"
RULES_FILE = CHART / "files" / "rbac-rules.yaml"
RULES_HEADER = (
    "# Generated from llmfleet.operator.deploy.rbac.RBAC_RULES by `python scripts/chart-sync.py`; do not edit.\n"
    "# templates/rbac.yaml grants exactly these (kopf.dev peering rules only when peering is enabled).\n"
)

POD_SECURITY_FILE = CHART / "files" / "pod-security-rules.yaml"
POD_SECURITY_HEADER = (
    "# Generated from llmfleet.operator.resource.pod_security.RULES by `python scripts/chart-sync.py`; do not edit.\n"
    "# templates/admission-policy.yaml refuses each rule whose key podSecurity.allow does not name.\n"
)

# Built-in cluster-scoped resources an operator might touch (Role objects cannot grant these).
CLUSTER_SCOPED = {
    "namespaces",
    "nodes",
    "persistentvolumes",
    "customresourcedefinitions",
    "apiservices",
    "clusterroles",
    "clusterrolebindings",
    "storageclasses",
    "priorityclasses",
    "ingressclasses",
    "runtimeclasses",
    "csidrivers",
    "csinodes",
    "volumeattachments",
    "certificatesigningrequests",
    "mutatingwebhookconfigurations",
    "validatingwebhookconfigurations",
    "validatingadmissionpolicies",
    "validatingadmissionpolicybindings",
    "tokenreviews",
    "subjectaccessreviews",
    "selfsubjectaccessreviews",
    "selfsubjectrulesreviews",
    "clusterkopfpeerings",
}


class Permission(NamedTuple):
    """One verb on one resource: the unit the RBAC tests compare."""

    scope: str  # "namespaced" | "cluster"
    group: str
    resource: str
    verb: str
    resource_names: tuple[str, ...] = ()


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def _pick(rule: Mapping[str, Any], *keys: str) -> Any:
    for key in keys:
        if key in rule:
            return rule[key]
    return None


def _rule_mapping(rule: Any) -> Mapping[str, Any]:
    if isinstance(rule, Mapping):
        return rule
    if hasattr(rule, "_asdict"):
        return rule._asdict()
    if isinstance(rule, tuple | list):
        keys = ("apiGroups", "resources", "verbs", "scope")
        return dict(zip(keys, rule, strict=False))
    if hasattr(rule, "__dict__"):
        return vars(rule)
    raise TypeError(f"cannot read an RBAC rule from {rule!r}")


def _scope_of(resource: str, explicit: Any) -> str:
    if isinstance(explicit, bool):
        return "cluster" if explicit else "namespaced"
    if explicit:
        text = str(explicit).lower()
        if text.startswith("cluster"):
            return "cluster"
        if text.startswith("namespace"):
            return "namespaced"
        raise ValueError(f"unknown RBAC scope {explicit!r}")
    return "cluster" if resource.split("/")[0] in CLUSTER_SCOPED else "namespaced"


def permissions(rules: Iterable[Any]) -> set[Permission]:
    """Every (scope, group, resource, verb, resourceNames) that the rules grant."""
    out: set[Permission] = set()
    for raw in rules:
        rule = _rule_mapping(raw)
        groups = _as_list(_pick(rule, "apiGroups", "api_groups", "apiGroup", "api_group", "groups", "group"))
        resources = _as_list(_pick(rule, "resources", "resource"))
        verbs = _as_list(_pick(rule, "verbs", "verb"))
        names = tuple(sorted(_as_list(_pick(rule, "resourceNames", "resource_names"))))
        explicit = _pick(rule, "scope", "clusterScoped", "cluster_scoped", "cluster")
        if not groups or not resources or not verbs:
            raise ValueError(f"RBAC rule needs apiGroups, resources and verbs: {raw!r}")
        for group in groups:
            for resource in resources:
                for verb in verbs:
                    out.add(Permission(_scope_of(resource, explicit), group, resource, verb, names))
    return out


def compact(perms: Iterable[Permission]) -> dict[str, list[dict[str, Any]]]:
    """Permissions as PolicyRules: per scope, one rule per (group, resourceNames, verb set)."""
    verbs_of: dict[tuple[str, str, tuple[str, ...], str], set[str]] = defaultdict(set)
    for p in perms:
        verbs_of[(p.scope, p.group, p.resource_names, p.resource)].add(p.verb)
    resources_of: dict[tuple[str, str, tuple[str, ...], tuple[str, ...]], list[str]] = defaultdict(list)
    for (scope, group, names, resource), verbs in verbs_of.items():
        resources_of[(scope, group, names, tuple(sorted(verbs)))].append(resource)
    out: dict[str, list[dict[str, Any]]] = {"namespaced": [], "cluster": []}
    for (scope, group, names, verbs), resources in sorted(resources_of.items()):
        rule: dict[str, Any] = {"apiGroups": [group], "resources": sorted(resources)}
        if names:
            rule["resourceNames"] = list(names)
        rule["verbs"] = list(verbs)
        out[scope].append(rule)
    return out


def rules_file_text(rules: Iterable[Any]) -> str:
    sections = compact(permissions(rules))
    return RULES_HEADER + yaml.safe_dump(sections, sort_keys=False, default_flow_style=None, width=110)


def load_rbac_rules() -> list[Any]:
    from llmfleet.operator.deploy.rbac import RBAC_RULES  # the operator's own list of API calls

    return list(RBAC_RULES)


def pod_security_file_text() -> str:
    from llmfleet.operator.resource.pod_security import RULES

    rules = [{"key": r.key, "expression": r.cel, "message": r.message()} for r in RULES]
    return POD_SECURITY_HEADER + yaml.safe_dump({"rules": rules}, sort_keys=False, width=100)


def expected_files() -> dict[Path, bytes]:
    return {
        CRD_COPY: CRD_SOURCE.read_bytes(),
        RULES_FILE: rules_file_text(load_rbac_rules()).encode(),
        POD_SECURITY_FILE: pod_security_file_text().encode(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report files that are out of date")
    args = parser.parse_args(argv)
    stale = []
    for path, content in expected_files().items():
        if path.exists() and path.read_bytes() == content:
            continue
        stale.append(path.relative_to(REPO))
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
    verb = "out of date" if args.check else "updated"
    for path in stale:
        print(f"chart-sync: {path} {verb}", file=sys.stderr)
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
