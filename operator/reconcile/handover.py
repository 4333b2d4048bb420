"""A mode switch (colocated <-> disaggregated) without an outage.

The new mode's pools are created next to the old mode's, and clients stay on the old entry pool
until every new pool has a ready pod: the client Service keeps selecting the old entry, and the
old pools are not pruned. The pass that finds the new pools ready moves the Service and prunes
them, as a Deployment rollout keeps its old ReplicaSet until the new one is available. Should
the new pools never come up, the old ones keep serving, and the status says why.

Nothing is held when the old entry has no ready pod as the switch begins: there is no traffic to
keep. Once begun, the switch is recorded (``status.handoverPool``) and held through a readiness
blip of the old entry pool or a deleted client Service: pruning the pool that serves for want of
a ready pod for one pass would be an outage until the new pools load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmfleet.operator.reconcile.desired import POOL_LABEL, Owner, pool_object_name
from llmfleet.operator.resource.spec import InferenceServiceSpec


@dataclass(frozen=True)
class Handover:
    serving: str  # the old entry pool, which the client Service keeps selecting
    waiting: tuple[str, ...]  # the new pools without a ready pod yet

    @property
    def message(self) -> str:
        return f"mode switch: clients stay on the {self.serving} pool until {', '.join(self.waiting)} have a ready pod"


def pending_handover(
    owner: Owner, spec: InferenceServiceSpec, live: dict[str, dict[str, Any]], recorded: str | None = None
) -> Handover | None:
    """The handover in progress, from the owner's live children ("Kind/name" -> object) and the
    pool an earlier pass recorded as serving (``recorded``), or None."""
    endpoint = live.get(f"Service/{owner.name}")
    selected = ((endpoint or {}).get("spec") or {}).get("selector", {}).get(POOL_LABEL)
    if selected is not None and selected != spec.entry_pool and _ready(live, owner, selected):
        serving = selected
    elif recorded not in (None, spec.entry_pool) and f"Deployment/{pool_object_name(owner, recorded)}" in live:
        serving = recorded  # begun: a blip of the old pool or a deleted Service does not end it
    else:
        return None
    waiting = tuple(p for p in spec.deployed_pools if not _ready(live, owner, p))
    return Handover(serving, waiting) if waiting else None


def _ready(live: dict[str, dict[str, Any]], owner: Owner, pool: str) -> bool:
    deployment = live.get(f"Deployment/{pool_object_name(owner, pool)}")
    return int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0) > 0
