"""Pods sized by the owned latencies, projected at another pod count (projection.py): the fewest
a scale-down may leave, the fewest that bring a broken SLO back, whether a busy window would break
ITL at today's count, and what the forecast's load would do to latency there."""

from __future__ import annotations

import math
from dataclasses import replace

from llmfleet.operator.metrics.source import PoolMetrics
from llmfleet.operator.tuner.capacity import PerReplica
from llmfleet.operator.tuner.decision import MAX_BATCH, PoolInput, SLOTargets, TunerConfig
from llmfleet.operator.tuner.forecast import Outlook
from llmfleet.operator.tuner.projection import Projection, project
from llmfleet.operator.tuner.proposal import busy_kv_load, busy_surge, owned_latency_ratio


class LatencySizing:
    """The latency projection asked the replica law's questions, at the tuner's limits."""

    def __init__(self, config: TunerConfig) -> None:
        self.config = config

    def scale_down_floor(
        self,
        name: str,
        m: PoolMetrics,
        slo: SLOTargets,
        units: float,
        cur: int,
        target: int,
        capacity: PerReplica,
        removed_since: float | None = None,
    ) -> tuple[int, str]:
        """The fewest replicas, from ``target`` up to ``cur``, at which the owned latencies are
        projected (projection.py) within ``projected_latency_limit`` of their SLOs, and a
        note when that is more. Capacity estimated from throughput says nothing about latency (a
        pod can be well under its token throughput and still break a TTFT SLO): this asks the
        latency measured now whether fewer pods would hold. Nor does it say whether their
        sequences fit the fewer pods' KV caches: the busiest pod's usage, spread alike, must stay
        under ``kv_pressure``, or the scale-down would only preempt."""
        ratio = owned_latency_ratio(name, m, slo)
        pods = m.ready_pods or 0
        if ratio <= 0 or pods != cur or units <= 0:
            return target, ""  # nothing measured, the pods measured are not the pods counted, or no demand
        judged_s = m.judged_window_s
        if removed_since is not None and m.at - removed_since < judged_s:
            return cur, (
                f"; {cur} pods only {m.at - removed_since:.0f} s, and the {judged_s:.0f} s window still holds "
                "more: no lower until it has seen them"
            )
        c = self.config
        lowest, note = max(target, 1), ""  # a demand that rounds to zero replicas is judged at one
        kv = busy_kv_load(m, cur, c)
        kv_floor = math.floor(kv / c.kv_pressure) + 1
        if lowest < kv_floor:
            lowest = target = min(kv_floor, cur)
            note = f"; the KV cache would run {kv / max(target - 1, 1):.0%} full with fewer than {target} -> {target}"
            if lowest >= cur:
                return cur, note
        limit = self._limit(name, m, slo, units, cur, capacity)
        projected = self.latency_at(name, m, slo, units, cur, lowest, capacity)
        if projected.ratio <= limit:
            return target, note
        fewer = range(lowest + 1, cur)
        n = next((n for n in fewer if self.latency_at(name, m, slo, units, cur, n, capacity).ratio <= limit), cur)
        slots = None if capacity.steps is None else capacity.steps.slots
        at = f"at {lowest}" + ("" if slots is None else f" with {MAX_BATCH} {slots}")
        return n, note + (
            f"; {at} the owned latency is projected at {projected.ratio:.2f}x its SLO ({projected.how}; now "
            f"{ratio:.2f}x, utilization {units / cur:.2f} -> {units / lowest:.2f}; > {limit:.2f})"
            f" -> {n}"
        )

    def _limit(self, name: str, m: PoolMetrics, slo: SLOTargets, units: float, cur: int, capacity: PerReplica) -> float:
        """The most a scale-down may project its owned latency at: ``projected_latency_limit``, or
        where a busy window at today's count already projects past it, that projection plus the
        limit's own margin. Pods cannot lower a latency that is over the limit with all of them
        (a long prompt's own prefill, a small token budget): a count is then refused for the
        latency it adds, not for what no count removes, which held every pod at start-up."""
        c = self.config
        today = self.latency_at(name, m, slo, units, cur, cur, capacity).ratio
        return max(c.projected_latency_limit, today + 1.0 - c.projected_latency_limit)

    def restoring(
        self,
        name: str,
        m: PoolMetrics,
        slo: SLOTargets,
        units: float,
        cur: int,
        most: int,
        capacity: PerReplica,
        growth: float = 1.0,
        seen: float | None = None,
    ) -> int | None:
        """The fewest replicas above ``cur`` (up to ``most``) at which the owned latencies, over
        their SLOs now (or at today's load x ``growth``), are projected back within them
        (``scale_up_latency_limit``); None when none is (a prefill that alone takes longer than
        the SLO is not helped by pods) or nothing says how loaded the pods are. The latencies are
        projected from the ``seen`` pods their window held (``cur`` by default): right after a
        scale-up, read as today's count's, they ask for the pods that just came all over again."""
        if units <= 0 or cur <= 0 or (m.ready_pods or 0) != cur:
            return None
        limit, at = self.config.scale_up_latency_limit, cur if seen is None else seen
        return next(
            (
                n
                for n in range(cur + 1, most + 1)
                if self.latency_at(name, m, slo, units, at, n, capacity, busy=False, growth=growth).ratio <= limit
            ),
            None,
        )

    def busy_itl(
        self, name: str, m: PoolMetrics, slo: SLOTargets, units: float, cur: int, capacity: PerReplica
    ) -> Projection | None:
        """ITL projected over ``busy_itl_limit`` of its SLO in a busy window at today's count,
        where it holds now (within the SLO, judged at this count); else None. In a colocated
        pool the slow gaps are the steps that carry prompts beside the decodes, and ITL's p95
        turns from the decode steps' to the prompt steps' once their share passes 5%: the
        mean minute shows nothing until a busy one breaks. The load is the one the window
        measured, so its tail is read through the quantiles measured between p95 and p99
        (projection.itl_tail); only a projection well past the SLO counts, since the busiest
        window of the next few is not every one."""
        if name != "colocated" or capacity.steps is None or units <= 0 or not m.request_rate:
            return None
        if not 0 < owned_latency_ratio(name, m, slo) <= 1.0:
            return None
        itl_only = replace(slo, ttft_p95_ms=math.inf)
        busy = self.latency_at(name, m, itl_only, units, cur, cur, capacity, measured_tail=True)
        return busy if busy.ratio > self.config.busy_itl_limit else None

    def ahead(
        self,
        name: str,
        pool: PoolInput,
        slo: SLOTargets,
        units: float,
        outlook: Outlook,
        capacity: PerReplica,
        seen: float,
    ) -> tuple[int, str] | None:
        """Where the trend's load a pod start-up ahead would take an owned latency that holds
        now past its SLO at today's count: the fewest pods projected to hold it there, and why;
        None otherwise, and where no count would. Demand with headroom misses a latency that
        turns sharply with load (ITL's p95 once prompt steps pass 5% of the gaps), so the
        predicted load is also priced in latency, as Dynamo's planner does from its profiles;
        here from the latency measured now, as a scale-down is. Only a rise clear of
        ``forecast_latency_spreads`` of the level's spread counts: past the knee a little load
        is a pod."""
        m, cur, c = pool.metrics, pool.current.replicas, self.config
        if outlook.rise_units <= c.forecast_latency_spreads * outlook.noise_units:
            return None
        if units <= 0 or cur <= 0 or (m.ready_pods or 0) != cur or not 0 < owned_latency_ratio(name, m, slo) <= 1.0:
            return None
        growth = (units + outlook.rise_units) / units
        then = self.latency_at(name, m, slo, units, seen, cur, capacity, busy=False, growth=growth)
        if then.ratio <= c.scale_up_latency_limit:
            return None
        n = self.restoring(name, m, slo, units, cur, pool.limits.max_replicas, capacity, growth, seen)
        if n is None:
            return None  # no count holds it: pods would not help
        return n, f"at {cur} pods that load projects the owned latency at {then.ratio:.2f}x its SLO ({then.how}) -> {n}"

    def latency_at(
        self,
        name: str,
        m: PoolMetrics,
        slo: SLOTargets,
        units: float,
        cur: float,
        n: int,
        capacity: PerReplica,
        busy: bool = True,
        growth: float = 1.0,
        measured_tail: bool = False,
    ) -> Projection:
        """The owned latencies at ``n`` pods, measured at ``cur``, at today's load x ``growth``.
        A scale-down is judged at the load of a busy window (``busy``), so that a count chosen at
        the mean holds through its surges; a scale-up for an SLO broken now is not: the window
        that broke it already carries its surge. ``measured_tail``: ITL's tail read through the
        quantiles measured between p95 and p99 (projection.itl_tail)."""
        surge = (busy_surge(m, self.config) if busy else 1.0) * growth
        rho, k = units / cur, cur / n
        slos = slo.ttft_p95_ms, slo.itl_p95_ms
        return project(name, m, *slos, rho, k, capacity.steps, surge, pods=cur, measured_tail=measured_tail)
