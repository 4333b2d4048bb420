"""InferenceService status: conditions and per-pool state, computed purely from what the operator
saw, plus the minimal merge patch that brings the live status there (None when nothing changed).

Conditions follow the Kubernetes convention (type, status, reason, message, lastTransitionTime,
observedGeneration); lastTransitionTime moves only when the status value flips.
The operator owns Ready, Progressing and Degraded. The tuner owns TunerActive; the operator only
sets it while autotuning is disabled or before the tuner has said anything.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from llmfleet.operator.reconcile.apply import is_subset
from llmfleet.operator.reconcile.pod_trouble import PodTrouble
from llmfleet.operator.resource.conditions import (
    PROGRESSING,
    READY,
    Condition,
)

# Knobs reported per pool (and shown by `kubectl get llmis`).
REPORTED_KNOBS = {
    "maxBatchSize": "max_batch_size",
    "batchTimeoutMs": "batch_timeout_ms",
    "maxNumBatchedTokens": "max_num_batched_tokens",
}


def now() -> str:
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class PoolState:
    """One pool's Deployment, or LeaderWorkerSet (its replicas are groups), as the operator wants
    it and as the API server reports it."""

    name: str
    replicas: int  # desired
    ready: int
    updated: int
    current: int  # pods that exist, old and new
    up_to_date: bool  # the Deployment controller has seen the latest spec
    # What the Deployment controller says stops it: pods it cannot create (a ResourceQuota, a
    # LimitRange: no pod exists to report it) or a rollout past its deadline
    failure: PodTrouble | None = None

    @classmethod
    def of(cls, name: str, replicas: int, deployment: dict[str, Any] | None) -> PoolState:
        status = (deployment or {}).get("status") or {}
        generation = ((deployment or {}).get("metadata") or {}).get("generation")
        groups = (deployment or {}).get("kind") == "LeaderWorkerSet"
        observed = status.get("observedGeneration")
        if groups and observed is None:  # older LWS controllers report none: their counts are all there is
            observed = generation
        seen = deployment is not None and (generation is None or observed == generation)
        return cls(
            name=name,
            replicas=replicas,
            ready=int(status.get("readyReplicas") or 0),
            updated=int(status.get("updatedReplicas") or 0),
            current=int(status.get("replicas") or 0),
            up_to_date=seen,
            failure=None if groups else _deployment_failure(name, status),
        )

    @property
    def rolled_out(self) -> bool:
        return (
            self.up_to_date
            and self.updated >= self.replicas
            and self.ready >= self.replicas
            and self.current <= self.replicas
        )


def serving_conditions(
    pools: list[PoolState],
    applied: str | None,
    trouble: PodTrouble | None = None,
    handover: str | None = None,
    wakes: bool = False,
) -> list[Condition]:
    """Ready and Progressing from the Deployments; `applied` names what this pass just wrote,
    `trouble` why pods are stuck, and `handover` which old pool serves while a mode switch waits
    for the new ones (handover.py): the service answers meanwhile, so Ready stays True. `wakes`:
    a pool at zero comes back at a request (wake.py), so while the routers are ready the service
    answers, after a cold start: Ready stays True, reason ScaledToZero.

    Ready means the service answers: every pool has a ready pod (as KServe's Ready follows its
    predictor's availability). A scale-up waiting for pods keeps it True ("Serving", with the
    counts), so `kubectl wait` and health checks do not flap with the tuner; the wait shows in
    Progressing, which turns False with the kubelet's, scheduler's or Deployment controller's
    reason when it is stuck."""
    why = trouble or next((p.failure for p in pools if p.failure is not None), None)
    stuck = f"; {why.message}" if why else ""
    if handover is not None:
        ready = Condition(READY, "True", "SwitchingMode", f"{handover}; {_counts(pools)}{stuck}")
    elif any(p.replicas == 0 for p in pools):
        zero = ", ".join(p.name for p in pools if p.replicas == 0)
        routers = next((p for p in pools if p.name == "router" and p.ready > 0), None)
        if wakes and routers is not None:
            message = f"{zero} at zero replicas: the routers hold the next request and wake it; {_counts(pools)}"
            ready = Condition(READY, "True", "ScaledToZero", message)
        else:
            ready = Condition(READY, "False", "ScaledToZero", f"no replicas in {zero}")
    elif all(p.ready >= p.replicas for p in pools):
        ready = Condition(READY, "True", "AllPoolsReady", _counts(pools))
    elif all(p.ready > 0 for p in pools):
        ready = Condition(READY, "True", "Serving", _counts(pools) + stuck)
    elif why is not None:
        ready = Condition(READY, "False", why.reason, f"{_counts(pools)}; {why.message}")
    else:
        ready = Condition(READY, "False", "PoolsNotReady", _counts(pools))
    if applied:
        progressing = Condition(PROGRESSING, "True", "Applied", applied)
    elif why is not None:  # stuck: pods that cannot start, or that the Deployment cannot create
        progressing = Condition(PROGRESSING, "False", why.reason, why.message)
    elif handover is not None:
        progressing = Condition(PROGRESSING, "True", "SwitchingMode", handover)
    elif any(not p.rolled_out for p in pools):
        moving = [p for p in pools if not p.rolled_out]
        progressing = Condition(PROGRESSING, "True", "RollingOut", _counts(moving))
    else:
        progressing = Condition(PROGRESSING, "False", "Converged", "every pool runs the desired spec")
    return [ready, progressing]


_STUCK = {("ReplicaFailure", "True"), ("Progressing", "False")}  # (type, status) of a Deployment condition


def _deployment_failure(pool: str, status: dict[str, Any]) -> PodTrouble | None:
    for condition in status.get("conditions") or []:
        if (condition.get("type"), condition.get("status")) in _STUCK:
            reason = condition.get("reason") or condition["type"]
            return PodTrouble(reason, f"{pool} Deployment: {condition.get('message') or reason}")
    return None


def _counts(pools: list[PoolState]) -> str:
    return ", ".join(f"{p.name} {p.ready}/{p.replicas} ready" for p in pools)


def ready_summary(pools: list[PoolState]) -> str:
    return f"{sum(p.ready for p in pools)}/{sum(p.replicas for p in pools)}"


def status_patch(current: dict[str, Any] | None, desired: dict[str, Any]) -> dict[str, Any] | None:
    """A JSON merge patch for the status fields in `desired`, or None if the status already says so.
    Pools that disappeared (a mode switch) are removed with explicit nulls."""
    current = current or {}
    patch = dict(desired)
    if "pools" in desired:
        gone = set(current.get("pools") or {}) - set(desired["pools"] or {})
        if gone:
            patch["pools"] = {**desired["pools"], **dict.fromkeys(sorted(gone))}
    unchanged = not any(v is None for v in (patch.get("pools") or {}).values()) and all(
        key in current and _same(value, current[key]) for key, value in desired.items()
    )
    return None if unchanged else patch


def replacing(current: Any, desired: Any) -> Any:
    """The merge-patch value that makes ``current`` exactly ``desired``: a merge patch keeps what
    it does not mention, so keys ``desired`` lacks (at any depth) are sent as nulls."""
    if not isinstance(current, dict) or not isinstance(desired, dict):
        return desired
    return {
        **dict.fromkeys(set(current) - set(desired)),
        **{k: replacing(current.get(k), v) for k, v in desired.items()},
    }


def merge_patched(current: Any, patch: Any) -> Any:
    """``current`` after a JSON merge patch (RFC 7386), as the API server applies it."""
    if not isinstance(patch, dict):
        return patch
    out = dict(current) if isinstance(current, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patched(out.get(key), value)
    return out


def _same(want: Any, have: Any) -> bool:
    # Conditions and other lists must match exactly; maps may hold more (fields others own).
    if isinstance(want, list):
        return want == have
    return is_subset(want, have)
