"""The baseline: a HorizontalPodAutoscaler on queue length, with fixed engine knobs.

What people run today with vLLM on Kubernetes: an HPA (autoscaling/v2) on a Pods metric,
``vllm:num_requests_waiting`` with an ``AverageValue`` target. Per pool, every sync period:

- ``desired = ceil(ready pods x mean waiting per pod / target)`` = ``ceil(waiting / target)``,
  unchanged while the ratio is within the 10% tolerance;
- scale-up is limited to max(4 pods, +100%) per period (HPA's default scale-up policy);
- scale-down takes the highest recommendation of the stabilization window (the spec's
  ``scaleDownStabilizationSeconds``; HPA's default is 300 s), scale-up the lowest of its window;
- within ``[minReplicas, maxReplicas]``. The knobs never move.

The metric is the pool's mean waiting over the last sync period, as a Prometheus adapter's
``avg_over_time`` would serve it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmfleet.sim.fleet import ControlRecord, Fleet


@dataclass(frozen=True)
class HPAConfig:
    target_waiting_per_pod: float = 2.0
    tolerance: float = 0.1
    sync_period_s: float | None = None  # None: the spec's autotune interval
    scale_up_stabilization_s: float | None = None  # None: the spec's
    scale_down_stabilization_s: float | None = None  # None: the spec's


class QueueLengthHPA:
    name = "hpa"

    def __init__(self, fleet: Fleet, config: HPAConfig | None = None) -> None:
        self.fleet = fleet
        self.config = config or HPAConfig()
        autotune = fleet.spec.autotune
        c = self.config
        self.interval_s = float(c.sync_period_s or autotune.interval_seconds)
        up = c.scale_up_stabilization_s
        down = c.scale_down_stabilization_s
        self.up_window = float(autotune.scale_up_stabilization_seconds if up is None else up)
        self.down_window = float(autotune.scale_down_stabilization_seconds if down is None else down)
        self.history: dict[str, list[tuple[float, int]]] = {}

    def recommend(self, pool: str, now: float) -> tuple[int, str]:
        """(desired replicas before stabilization, why)."""
        c = self.config
        current = self.fleet.pools[pool].replicas
        metrics = self.fleet.metric_source.measure(self.fleet.pool_ref(pool), self.interval_s)
        if metrics.stale or metrics.waiting is None or not metrics.ready_pods:
            return current, f"no metric ({metrics.reason or 'waiting unknown'}): keep {current}"
        per_pod = metrics.waiting / metrics.ready_pods
        ratio = per_pod / c.target_waiting_per_pod
        if abs(ratio - 1.0) <= c.tolerance:
            return current, f"waiting {per_pod:.2f}/pod within tolerance of target {c.target_waiting_per_pod:g}"
        desired = math.ceil(metrics.ready_pods * ratio - 1e-9)
        desired = min(desired, max(current + 4, 2 * current))
        return desired, f"waiting {per_pod:.2f}/pod vs target {c.target_waiting_per_pod:g} on {metrics.ready_pods} pods"

    def control(self, now: float) -> None:
        spec = self.fleet.spec
        for pool in spec.active_pools:
            desired, why = self.recommend(pool, now)
            history = self.history.setdefault(pool, [])
            history.append((now, desired))
            keep = max(self.up_window, self.down_window) + self.interval_s
            history[:] = [(t, d) for t, d in history if now - t <= keep]
            current = self.fleet.pools[pool].replicas
            rise = min(d for t, d in history if now - t <= self.up_window)
            fall = max(d for t, d in history if now - t <= self.down_window)
            target = rise if rise > current else fall if fall < current else current
            limits = spec.pool(pool)
            target = max(limits.min_replicas, min(limits.max_replicas, target))
            if target != current:
                self.fleet.scale(pool, target)
                change = {"pool": pool, "knob": "replicas", "from": current, "to": target, "reason": why}
                self.fleet.decisions.append(ControlRecord(now, self.name, [change], reason=why))
