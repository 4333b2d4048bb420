"""A mode switch (colocated <-> disaggregated) without an outage.

The new mode's pools are created next to the old mode's, and clients stay on the old entry pool
until every new pool has a ready pod: the client Service keeps selecting the old entry, and the
old pools are not pruned. The pass that finds the new pools ready moves the Service and prunes
them, as a Deployment rollout keeps its old ReplicaSet until the new one is available. Should
the new pools never come up, the old ones keep serving, and the status says why.

Nothing is held when the old entry has no ready pod: there is no traffic to keep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .reconcile import POOL_LABEL, Owner, pool_object_name
from .spec import InferenceServiceSpec


@dataclass(frozen=True)
class Handover:
    serving: str  # the old entry pool, which the client Service keeps selecting
    waiting: tuple[str, ...]  # the new pools without a ready pod yet

    @property
    def message(self) -> str:
        return f"mode switch: clients stay on the {self.serving} pool until {', '.join(self.waiting)} have a ready pod"


def pending_handover(owner: Owner, spec: InferenceServiceSpec, live: dict[str, dict[str, Any]]) -> Handover | None:
    """The handover in progress, from the owner's live children ("Kind/name" -> object), or None."""
    endpoint = live.get(f"Service/{owner.name}")
    serving = ((endpoint or {}).get("spec") or {}).get("selector", {}).get(POOL_LABEL)
    if serving is None or serving == spec.entry_pool or not _ready(live, owner, serving):
        return None
    waiting = tuple(p for p in spec.deployed_pools if not _ready(live, owner, p))
    return Handover(serving, waiting) if waiting else None


def _ready(live: dict[str, dict[str, Any]], owner: Owner, pool: str) -> bool:
    deployment = live.get(f"Deployment/{pool_object_name(owner, pool)}")
    return int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0) > 0
