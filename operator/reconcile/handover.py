"""A mode switch (colocated <-> disaggregated) without an outage.

The routers front every mode, and the client Service always selects them; what a switch moves is
the pools the routers relay to. The new mode's pools are created next to the old mode's, and the
routers keep relaying to the old pools (``router_mode``: their Deployment is rendered in the old
mode, annotated with it) until every new pool has a ready pod. Then the routers roll to the new
mode, and only once that rollout is done are the old pools pruned: a router still relaying to
them must not find them draining. Should the new pools never come up, the old ones keep serving,
and the status says why.

A fleet from before the routers fronted colocated pools has its client Service on the colocated
pool: it stays there (``serving``) until the routers and the spec's pools have ready pods, as
before any switch.

Nothing is held when the old pools have no ready pod as the switch begins: there is no traffic
to keep. Once begun, the switch is recorded (``status.handoverPool``: the pool that served) and
held through a readiness blip of that pool or a deleted client Service. A switch turned back
before it is over is a switch of its own, from the pools the routers relay to by then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmfleet.operator.reconcile.desired import (
    MODE_ANNOTATION,
    POOL_LABEL,
    ROUTED_POOLS,
    Owner,
    live_workload,
    pool_object_name,
)
from llmfleet.operator.resource.spec import InferenceServiceSpec

ROUTER = "router"


@dataclass(frozen=True)
class Handover:
    serving: str  # the pool the client Service selects: the routers, or an old entry pool
    router_mode: str  # the pools the routers relay to meanwhile
    waiting: tuple[str, ...]  # what the switch waits for: new pools without a ready pod, or the routers' rollout
    record: str  # status.handoverPool: the pool that served when the switch began

    @property
    def message(self) -> str:
        if self.serving != ROUTER:
            return (
                f"mode switch: clients stay on the {self.serving} pool until {', '.join(self.waiting)} have a ready pod"
            )
        if self.waiting == (ROUTER,):
            return f"mode switch: the {self.record} pool stays until the routers relay to the new pools"
        return (
            f"mode switch: the routers relay to the {self.record} pool until {', '.join(self.waiting)} have a ready pod"
        )


def pending_handover(
    owner: Owner, spec: InferenceServiceSpec, live: dict[str, dict[str, Any]], recorded: str | None = None
) -> Handover | None:
    """The handover in progress, from the owner's live children ("Kind/name" -> object) and the
    pool an earlier pass recorded as serving (``recorded``), or None."""
    endpoint = live.get(f"Service/{owner.name}")
    selected = ((endpoint or {}).get("spec") or {}).get("selector", {}).get(POOL_LABEL)
    if selected is not None and selected != ROUTER:
        return _to_the_routers(owner, spec, live, selected, recorded)
    return _between_modes(owner, spec, live, recorded)


def _to_the_routers(
    owner: Owner, spec: InferenceServiceSpec, live: dict[str, dict[str, Any]], selected: str, recorded: str | None
) -> Handover | None:
    """The client Service still selects an engine pool: it moves to the routers once they and
    the spec's pools are ready."""
    begun = recorded == selected and live_workload(live, owner, selected) is not None
    if not (_ready(live, owner, selected) or begun):
        return None
    waiting = tuple(p for p in spec.deployed_pools if not _ready(live, owner, p))
    return Handover(selected, spec.mode, waiting, selected) if waiting else None


def _between_modes(
    owner: Owner, spec: InferenceServiceSpec, live: dict[str, dict[str, Any]], recorded: str | None
) -> Handover | None:
    """The routers relay to another mode's pools than the spec's: they keep doing so until the new
    pools are ready, then roll to the new mode; the old pools stay until that rollout is done."""
    router = live.get(f"Deployment/{pool_object_name(owner, ROUTER)}")
    relaying = ((router or {}).get("metadata", {}).get("annotations") or {}).get(MODE_ANNOTATION)
    old_pool = recorded if recorded in _serving_pools() else None
    if old_pool in ROUTED_POOLS[spec.mode]:  # a switch turned back: the old side is where the routers relay
        old_pool = None
    if relaying not in (None, spec.mode) and old_pool is None:
        old_pool = ROUTED_POOLS[relaying][-1]
        if not _ready(live, owner, old_pool):
            return None  # nothing served before: no traffic to keep
    if old_pool is None or old_pool in ROUTED_POOLS[spec.mode]:
        return None
    if live_workload(live, owner, old_pool) is None:
        return None
    old_mode = next(mode for mode, pools in ROUTED_POOLS.items() if old_pool in pools)
    waiting = tuple(p for p in spec.active_pools if not _ready(live, owner, p))
    if waiting:
        return Handover(ROUTER, old_mode, waiting, old_pool)
    if relaying == spec.mode and _rolled_out(router):
        return None
    return Handover(ROUTER, spec.mode, (ROUTER,), old_pool)


def _serving_pools() -> tuple[str, ...]:
    """The pool each mode cannot serve without: what a switch records as serving."""
    return tuple(pools[-1] for pools in ROUTED_POOLS.values())


def _ready(live: dict[str, dict[str, Any]], owner: Owner, pool: str) -> bool:
    """The pool's Deployment (or LeaderWorkerSet: a whole group) has a ready replica."""
    workload = live_workload(live, owner, pool)
    return int(((workload or {}).get("status") or {}).get("readyReplicas") or 0) > 0


def _rolled_out(deployment: dict[str, Any] | None) -> bool:
    """The Deployment controller has seen its latest spec and every replica runs it, ready."""
    if deployment is None:
        return False
    status = deployment.get("status") or {}
    replicas = int(deployment["spec"].get("replicas", 1))
    return (
        status.get("observedGeneration") == deployment["metadata"].get("generation")
        and int(status.get("updatedReplicas") or 0) >= replicas
        and int(status.get("readyReplicas") or 0) >= replicas
        and int(status.get("replicas") or 0) <= replicas
    )
