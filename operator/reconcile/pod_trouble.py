"""Why a pool's pods are not ready, read from the pods: the Deployment only counts them.

A pod that cannot start for a reason that will not pass by waiting (a missing Secret or key, an
image that cannot be pulled, a container that keeps crashing, no node with room for it) puts
that reason and the kubelet's or scheduler's own words into the Ready condition, so that
``kubectl get llmis`` says what `kubectl describe pod` would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Waiting reasons the kubelet reports for a container that is stuck, not merely starting
STUCK = (
    "CreateContainerConfigError",  # a missing Secret, ConfigMap or key
    "CreateContainerError",
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "CrashLoopBackOff",
    "RunContainerError",
)


@dataclass(frozen=True)
class PodTrouble:
    reason: str  # the kubelet's waiting reason, Unschedulable, or the Deployment controller's (status.py)
    message: str


def pod_trouble(pool: str, pods: list[dict[str, Any]]) -> PodTrouble | None:
    """Why ``pool``'s pods are stuck: the first stuck pod's reason (by name), and how many more
    are stuck; None while its pods are only on their way."""
    by_name = sorted(pods, key=lambda p: p["metadata"]["name"])
    stuck = [trouble for trouble in (_stuck(pool, pod) for pod in by_name) if trouble is not None]
    if not stuck:
        return None
    first = stuck[0]
    more = len(stuck) - 1
    if more:
        first = PodTrouble(first.reason, f"{first.message} (and {more} more {pool} pod{'s' if more > 1 else ''} stuck)")
    return first


def _stuck(pool: str, pod: dict[str, Any]) -> PodTrouble | None:
    if pod["metadata"].get("deletionTimestamp"):
        return None  # draining: its trouble is over
    name, status = pod["metadata"]["name"], pod.get("status") or {}
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("reason") == "Unschedulable":
            return PodTrouble("Unschedulable", f"{pool} pod {name}: {condition.get('message') or 'unschedulable'}")
    containers = (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or [])
    for container in containers:
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in STUCK:
            said = _last_words(container)  # e.g. the download's one-line error, where it crashed
            text = f"{container.get('name')} failed: {said}" if said else waiting.get("message") or waiting["reason"]
            return PodTrouble(waiting["reason"], f"{pool} pod {name}: {text}")
    return None


def _last_words(container: dict[str, Any]) -> str | None:
    """The last line a crashed container left (its termination message, or with the policy
    FallbackToLogsOnError its log's tail): what a `kubectl logs` would show first."""
    message = (((container.get("lastState") or {}).get("terminated") or {}).get("message") or "").strip()
    return message.splitlines()[-1] if message else None
