"""Status conditions as Kubernetes writes them (type, status, reason, message, lastTransitionTime,
observedGeneration): lastTransitionTime moves only when the status flips. The operator owns
Ready, Progressing and Degraded; the tuner owns TunerActive and ScalingLimited (HPA's name: True
while a pool runs other than the replicas its SLOs ask for)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
TUNER_ACTIVE = "TunerActive"
SCALING_LIMITED = "ScalingLimited"
CONDITION_ORDER = (READY, PROGRESSING, DEGRADED, TUNER_ACTIVE, SCALING_LIMITED)
MESSAGE_MAX = 2048  # characters of a condition's message: status must stay small whatever fed it


@dataclass(frozen=True)
class Condition:
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str = ""


def merge_conditions(
    previous: list[dict[str, Any]], updates: list[Condition], generation: int | None, at: str
) -> list[dict[str, Any]]:
    """The previous conditions with `updates` applied; others (e.g. the tuner's) kept as they are."""
    by_type = {c.get("type"): dict(c) for c in previous or [] if c.get("type")}
    for update in updates:
        old = by_type.get(update.type, {})
        new = {
            "type": update.type,
            "status": update.status,
            "reason": update.reason,
            "message": cut(update.message, MESSAGE_MAX),
            "lastTransitionTime": old.get("lastTransitionTime", at) if old.get("status") == update.status else at,
        }
        if generation is not None:
            new["observedGeneration"] = generation
        by_type[update.type] = new
    ordered = [by_type.pop(t) for t in CONDITION_ORDER if t in by_type]
    return ordered + [by_type[t] for t in sorted(by_type)]


def condition_of(status: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    return next((c for c in (status or {}).get("conditions") or [] if c.get("type") == type_), None)


def cut(text: str, limit: int) -> str:
    """At most ``limit`` characters of ``text``, for a message in status: a cut one ends in "..."."""
    return text if len(text) <= limit else text[: limit - 3] + "..."
