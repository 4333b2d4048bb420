"""Waking pools at zero, and the cold start that follows, in status.

A router that holds requests for a pool with no server stamps its fleet's wake ConfigMap
(server/wire/wake.py). The operator answers at once, not at the tuner's next run: each pool the
tuner has at zero goes back to its floor of one (``status.tuner.replicas``, the same path the
tuner's own decisions take; spec bounds still win in reconcile), and ``status.wake`` records the
request. As each woken pool gets a ready pod, a pass records the time from the request in
``status.pools.<pool>.lastColdStartSeconds``. ``status.wake.requestedAt`` stays: a stamp no newer
(the last one, seen again when the operator restarts) wakes nothing.

A spec that cannot be served (or applied) does not stop a wake: the pools the tuner had at zero
go to one in ``status.tuner``, and the degraded pass, which applies nothing, scales their live
workloads itself (converge.py), as whatever ran before keeps serving.
"""

from __future__ import annotations

import datetime
from typing import Any

from llmfleet.operator.reconcile.status import PoolState
from llmfleet.operator.resource.spec import InferenceServiceSpec
from llmfleet.operator.resource.tuner_state import TunerState, pools_to_wake
from llmfleet.server.wire.wake import parse_wake_stamp


def _tuner_acts(spec: InferenceServiceSpec) -> bool:
    """The tuner's replicas run: it is on and acting (an observing tuner's status.tuner holds no
    replicas, and reconcile reads none there)."""
    return spec.autotune.enabled and spec.autotune.mode == "act"


def wakes_from_zero(spec: InferenceServiceSpec) -> bool:
    """A pool of this spec may be at zero and come back at a request: the tuner runs it, and it
    allows no replicas."""
    return _tuner_acts(spec) and any(spec.pool(p).min_replicas == 0 for p in spec.active_pools)


def wake_patch(spec: InferenceServiceSpec | None, status: dict[str, Any], stamp: str) -> dict[str, Any] | None:
    """The status merge patch that wakes the pools at zero for a request stamped ``stamp``; None
    when the stamp is no newer than the last one handled, or no pool is at zero (woken already,
    or the tuner is off or observing: the spec's replicas stand). ``spec`` None: the spec cannot
    be read, and the pools the tuner has at zero go to one."""
    requested = parse_wake_stamp(stamp)
    handled = parse_wake_stamp((status.get("wake") or {}).get("requestedAt"))
    if requested is None or (handled is not None and requested <= handled):
        return None
    tuner = TunerState.from_status(status)
    if spec is None:
        wake = {pool: 1 for pool, replicas in tuner.replicas.items() if replicas == 0}
    elif _tuner_acts(spec):
        wake = pools_to_wake(spec, tuner)
    else:
        return None
    if not wake:
        return None
    return {"tuner": {"replicas": wake}, "wake": {"requestedAt": stamp, "pools": sorted(wake)}}


def unapplied_wakes(status: dict[str, Any], replicas: dict[str, int]) -> dict[str, int]:
    """Pools a wake asked for that still run no replica (``replicas``: each live workload's), and
    the replicas ``status.tuner`` holds for them: what a pass that applies nothing scales itself."""
    tuner = TunerState.from_status(status)
    waiting = (status.get("wake") or {}).get("pools") or []
    return {pool: tuner.replicas[pool] for pool in waiting if replicas.get(pool) == 0 and tuner.replicas.get(pool)}


def cold_starts(
    current: dict[str, Any], pool_status: dict[str, Any], pools: list[PoolState], now: datetime.datetime | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``pool_status`` with each pool's ``lastColdStartSeconds`` (kept, or measured now for a woken
    pool that has a ready pod), and the ``wake`` status key's new value (nothing when absent)."""
    now = now or datetime.datetime.now(datetime.UTC)
    previous = current.get("pools") or {}
    for pool, entry in pool_status.items():
        if "lastColdStartSeconds" in (previous.get(pool) or {}):
            entry["lastColdStartSeconds"] = previous[pool]["lastColdStartSeconds"]
    wake = current.get("wake")
    if not wake:
        return pool_status, {}
    requested = parse_wake_stamp(wake.get("requestedAt"))
    waiting = list(wake.get("pools") or [])
    ready = {p.name for p in pools if p.ready > 0}
    for pool in [p for p in waiting if p in ready]:
        waiting.remove(pool)
        if requested is not None and pool in pool_status:
            pool_status[pool]["lastColdStartSeconds"] = round((now - requested).total_seconds(), 1)
    return pool_status, {"wake": {**wake, "pools": waiting}}
