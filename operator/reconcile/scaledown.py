"""Scale down gracefully: before the tuner lowers a pool's replicas, rank its pods by the work
they hold, so the ReplicaSet controller removes the idlest ones first.

Kubernetes deletes the pods with the lowest ``controller.kubernetes.io/pod-deletion-cost`` first
(beta since 1.22, on by default). Each pod's cost becomes its in-flight requests
(``llmfleet_requests_in_flight``); pods without a number get cost 0 (the default, or "0" over an
earlier scale-down's cost) and go first (no metrics usually means not serving). The pods that do
go drain on SIGTERM (preStop, then ``--drain-timeout``), so no stream is cut either way.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmfleet.operator.reconcile.cluster import POD, ApiError, KubeClient
from llmfleet.operator.reconcile.desired import Owner, selector

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


async def rank_pods_for_scale_down(
    client: KubeClient, owner: Owner, pool: str, in_flight: Mapping[str, float]
) -> list[str]:
    """Annotate the pool's pods with their in-flight work as deletion cost; returns those changed."""
    changed = []
    for pod in await client.list(POD, owner.namespace, selector(owner, pool)):
        name = pod["metadata"]["name"]
        annotations = pod["metadata"].get("annotations") or {}
        if pod["metadata"].get("deletionTimestamp"):
            continue
        if name in in_flight:
            cost = str(max(0, round(in_flight[name])))
        elif DELETION_COST in annotations:
            cost = "0"  # no number now: an earlier scale-down's cost must not keep it over idle pods
        else:
            continue  # no annotation is cost 0 already
        if annotations.get(DELETION_COST) != cost:
            patch = {"metadata": {"annotations": {DELETION_COST: cost}}}
            try:
                await client.patch_merge(POD, owner.namespace, name, patch)
            except ApiError as exc:
                if exc.status == 404:  # gone since the list (a rollout, an eviction): nothing to rank
                    continue
                raise
            changed.append(name)
    return changed
