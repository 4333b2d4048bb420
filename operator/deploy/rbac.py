"""Every API call the operator makes, as RBAC PolicyRules: the chart grants exactly these
(scripts/chart-sync.py writes charts/llm-fleet/files/rbac-rules.yaml from RBAC_RULES, and
tests/chart checks the rendered Roles against it). tests/operator records the calls the operator
really makes against the emulated API server and checks each one is covered here.

``scope`` is "namespaced" (a Role per watched namespace, or a ClusterRole when watching all) or
"cluster" (always a ClusterRole). kopf.dev rules are needed only with peering.
"""

from __future__ import annotations

from typing import Any


def _rule(group: str, resources: list[str], verbs: list[str], scope: str = "namespaced") -> dict[str, Any]:
    return {"apiGroups": [group], "resources": resources, "verbs": verbs, "scope": scope}


CHILD_VERBS = ["get", "list", "create", "patch", "delete"]

RBAC_RULES: list[dict[str, Any]] = [
    # kopf: watch InferenceServices; its bookkeeping (annotations, the finalizer its timers need).
    # The operator: get (when a child Deployment changes, read its owner) and status writes.
    _rule("llmfleet.io", ["inferenceservices"], ["get", "list", "watch", "patch"]),
    _rule("llmfleet.io", ["inferenceservices/status"], ["patch"]),
    # Children's ownerReferences set blockOwnerDeletion, which the OwnerReferencesPermissionEnforcement
    # admission plugin (on by default in OpenShift) allows only to who may update the owner's finalizers.
    _rule("llmfleet.io", ["inferenceservices/finalizers"], ["update"]),
    # The children (reconcile/apply.py): one labelled list per kind, get for a desired name missing from
    # the list, server-side apply (patch; create when the object is new), delete when no longer
    # desired. kopf also watches Deployments: readiness and deletions re-run the owner's pass.
    # kopf also watches the wake ConfigMaps a router stamps when it holds requests for a pool at zero.
    _rule("", ["configmaps"], [*CHILD_VERBS, "watch"]),
    _rule("", ["services"], CHILD_VERBS),
    _rule("apps", ["deployments"], [*CHILD_VERBS, "watch"]),
    # A pool whose replica spans nodes runs as a LeaderWorkerSet, watched like a Deployment (where
    # its CRD is installed: discovery tells, which needs no rule).
    _rule("leaderworkerset.x-k8s.io", ["leaderworkersets"], [*CHILD_VERBS, "watch"]),
    _rule("networking.k8s.io", ["networkpolicies"], CHILD_VERBS),
    _rule("policy", ["poddisruptionbudgets"], CHILD_VERBS),
    _rule("autoscaling", ["horizontalpodautoscalers"], CHILD_VERBS),
    _rule("monitoring.coreos.com", ["podmonitors"], CHILD_VERBS),
    # Every fleet's router reads the pools' EndpointSlices and stamps its wake ConfigMap (get, patch)
    # with its own account: the operator creates the account, a Role and its binding, and must
    # itself hold what the Role grants (RBAC refuses to create a Role granting more than its
    # creator has).
    _rule("", ["serviceaccounts"], CHILD_VERBS),
    _rule("rbac.authorization.k8s.io", ["roles", "rolebindings"], CHILD_VERBS),
    _rule("discovery.k8s.io", ["endpointslices"], ["get", "list", "watch"]),
    # reconcile/kv_secret.py: a disaggregated fleet's KV-transfer token where the spec names none. Create
    # only: the operator reads no Secret, its own included.
    _rule("", ["secrets"], ["create"]),
    # reconcile/scaledown.py: rank a pool's pods by in-flight work before the tuner scales it down;
    # daemon.py: the ready pods' IPs, to scrape their /metrics when no Prometheus is configured.
    _rule("", ["pods"], ["list", "patch"]),
    # kopf posts the operator's Events (core v1).
    _rule("", ["events"], ["create"]),
    # kopf: notice CRDs installed after start, and which watched namespaces exist.
    _rule("apiextensions.k8s.io", ["customresourcedefinitions"], ["list", "watch"], "cluster"),
    _rule("", ["namespaces"], ["list", "watch"], "cluster"),
    # kopf peering (--peering NAME): cluster-wide operators use a ClusterKopfPeering, namespaced
    # ones a KopfPeering per namespace; kopf lists, watches and patches them (keep-alives).
    _rule("kopf.dev", ["clusterkopfpeerings"], ["list", "watch", "patch"], "cluster"),
    _rule("kopf.dev", ["kopfpeerings"], ["list", "watch", "patch"]),
]


def allows(group: str, resource: str, verb: str) -> bool:
    """Is this call covered by RBAC_RULES?"""
    return any(
        group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"] for rule in RBAC_RULES
    )
