"""Scale to zero, and the pools at zero.

A pool whose spec allows no replicas (``minReplicas: 0``) goes to zero once it has been idle (no
request finished, ran or waited over a whole metric window) for
``spec.autotune.scaleToZeroAfterSeconds``. In a disaggregated fleet its pools go together: all
idle, or none goes. A pool at zero has no pods to measure, so the law (law.py, which keeps a pool
it tunes at one replica or more) does not see it; it comes back when a request reaches the router
(which holds it and asks for servers: the operator's wake handler, the local fleet and the
simulator bring the pool to one replica at once), or at a tuner run that finds another pool of the
fleet busy (a request the router sent on without it: a decode server computing prompts itself).
Pure, like the law: the clock is an argument.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from llmfleet.operator.metrics.source import PoolMetrics
from llmfleet.operator.resource.spec import InferenceServiceSpec
from llmfleet.operator.tuner.decision import REPLICAS, Change, Decision, PoolSettings


def idle(metrics: PoolMetrics | None) -> bool:
    """No request finished, ran or waited over the snapshot's window: each a measured zero (a
    value the source could not read is not idle)."""
    if metrics is None or metrics.stale:
        return False
    return metrics.request_rate == 0 and metrics.running == 0 and metrics.waiting == 0


def pools_at_zero(spec: InferenceServiceSpec, replicas: Mapping[str, int]) -> list[str]:
    """The pools that run no replica now: the law leaves them out."""
    return [pool for pool in spec.active_pools if replicas.get(pool, 1) == 0]


def scale_to_zero(
    decision: Decision,
    spec: InferenceServiceSpec,
    metrics: Mapping[str, PoolMetrics],
    current: Mapping[str, PoolSettings],
    now: float,
) -> Decision:
    """The law's decision with the pools at zero kept there (or brought back for a busy fleet),
    and the idle pools that may scale to zero sent there once idle long enough. Idleness is
    remembered in ``decision.memory.idle_since``."""
    memory = decision.memory
    after = float(spec.autotune.scale_to_zero_after_seconds)
    settings = dict(decision.settings)
    changes = list(decision.changes)
    zero = pools_at_zero(spec, {p: s.replicas for p, s in current.items()})
    lines = [line for line in decision.reasons if not (zero and line == "no pools to tune")]
    tuned = [p for p in spec.active_pools if p not in zero]
    busy = [p for p in tuned if not idle(metrics.get(p))]
    for pool in zero:
        memory.idle_since.pop(pool, None)
        if busy:
            back = max(1, spec.pool(pool).min_replicas)
            reason = (
                f"{pool}: at zero while {', '.join(busy)} serves requests -> replicas 0 -> {back} "
                "(a request went on without it)"
            )
            changes.append(Change(pool, REPLICAS, 0.0, float(back), reason))
            lines.append(reason)
            settings[pool] = PoolSettings(back, current[pool].knobs)
        else:
            lines.append(f"{pool}: at zero replicas (idle); the router holds the next request and wakes it")
            settings[pool] = current[pool]
    may_go = [p for p in tuned if spec.pool(p).min_replicas == 0]
    for pool in tuned:
        if pool not in may_go or not idle(metrics.get(pool)):
            memory.idle_since.pop(pool, None)
    if may_go and not busy and not decision.hold and len(may_go) == len(tuned):
        for pool in may_go:
            since = memory.idle_since.setdefault(pool, now)
            was = settings[pool].replicas
            if now - since < after:
                lines.append(
                    f"{pool}: idle for {now - since:.0f} s; at zero after {after:.0f} s (scaleToZeroAfterSeconds)"
                )
                continue
            reason = (
                f"{pool}: idle for {now - since:.0f} s (no request arrived, ran or waited; scaleToZeroAfterSeconds "
                f"{after:.0f}) -> replicas {was} -> 0; the router holds the next request and wakes it"
            )
            changes = [c for c in changes if not (c.pool == pool and c.knob == REPLICAS)]
            changes.append(Change(pool, REPLICAS, float(current[pool].replicas), 0.0, reason))
            lines.append(reason)
            settings[pool] = PoolSettings(0, settings[pool].knobs)
            memory.key(pool, REPLICAS).moved(now, -1)
    return replace(decision, changes=tuple(changes), reasons=tuple(lines), settings=settings, memory=memory)
