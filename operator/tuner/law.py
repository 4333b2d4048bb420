"""The tuner's control law: metrics in, a decision out. Pure and deterministic (the clock is an
argument); the operator's daemon, the local fleet, the simulator and the tests all call
``Tuner.decide`` the same way.

Per pool and run: spec bounds win; stale data holds everything; the knob rules (knobs.py)
propose; the replica rules (replicas.py) cover demand over per-replica capacity (capacity.py)
with headroom, the forecast's rise (prediction.py) and the owned latencies projected at another
pod count (latency_sizing.py); counts that broke or held the SLOs outweigh the projection
(evidence.py); a disaggregated fleet splits its TTFT SLO between its pools (disaggregated.py);
then HPA-style stabilization, cooldowns and anti-flapping gate every move (here and memory.py).
Every change and every hold carries a reason that cites its numbers. The rules, and why each is
as it is, are in docs/tuner.md."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from llmfleet.operator.tuner.capacity import CapacityEstimator
from llmfleet.operator.tuner.decision import (
    INTEGER_KNOBS,
    KNOB_FIELDS,
    MAX_BATCH,
    POOL_ORDER,
    REPLICAS,
    TIMEOUT,
    TOKEN_BUDGET,
    Change,
    Decision,
    PoolInput,
    PoolLimits,
    PoolSettings,
    Range,
    ScalingLimit,
    SLOTargets,
    TunerConfig,
    plain,
)
from llmfleet.operator.tuner.decision import num as _num
from llmfleet.operator.tuner.disaggregated import Disaggregated
from llmfleet.operator.tuner.evidence import Evidence
from llmfleet.operator.tuner.forecast import PoolForecast
from llmfleet.operator.tuner.knobs import KnobRules
from llmfleet.operator.tuner.memory import DecisionRecord, KeyHistory, TunerMemory, stabilize
from llmfleet.operator.tuner.per_request import Finished, requests_per_s
from llmfleet.operator.tuner.prediction import Prediction
from llmfleet.operator.tuner.projection import decode_step_floor, first_token_floor
from llmfleet.operator.tuner.proposal import Moved, Proposal
from llmfleet.operator.tuner.replicas import ReplicaRules
from llmfleet.operator.tuner.spend import Spend

__all__ = [
    "INTEGER_KNOBS",
    "KNOB_FIELDS",
    "MAX_BATCH",
    "REPLICAS",
    "TIMEOUT",
    "TOKEN_BUDGET",
    "Change",
    "Decision",
    "PoolInput",
    "PoolLimits",
    "PoolSettings",
    "Range",
    "SLOTargets",
    "Tuner",
    "TunerConfig",
    "TunerMemory",
]


class Tuner:
    def __init__(self, config: TunerConfig | None = None) -> None:
        self.config = config or TunerConfig()
        self.knob_rules = KnobRules(self.config)
        self.estimator = CapacityEstimator(self.config)
        self.replica_rules = ReplicaRules(self.config, self.estimator)
        self.prediction = Prediction(self.config)
        self.evidence = Evidence(self.config)
        self.disaggregated = Disaggregated(self.config)

    def decide(
        self, pools: Mapping[str, PoolInput], slo: SLOTargets, memory: TunerMemory | None, now: float
    ) -> Decision:
        unknown = set(pools) - set(POOL_ORDER)
        if unknown:
            raise ValueError(f"unknown pools {sorted(unknown)}; the tuner knows {list(POOL_ORDER)}")
        names = [p for p in POOL_ORDER if p in pools]
        mem = (memory or TunerMemory()).model_copy(deep=True)
        settings = {name: pools[name].current for name in names}
        changes: list[Change] = []
        lines: list[str] = []

        for name in names:
            settings[name] = self._enforce_bounds(name, pools[name], mem, now, changes, lines)
        inputs = {name: pools[name].metrics.summary() for name in names}

        stale = [pools[n].metrics.reason or f"{n}: metrics stale" for n in names if pools[n].metrics.stale]
        if stale:
            hold_reason = "holding every knob and replica count: " + "; ".join(stale)
            lines.append(hold_reason)
            return self._finish(now, changes, lines, True, hold_reason, settings, mem, inputs)

        demand: dict[str, tuple[float, str]] = {}
        needed: dict[str, float] = {}
        limits: dict[str, ScalingLimit] = {}
        # a decode pool owns no TTFT but the share Disaggregated.ttft_budgets gives it
        pool_slo = {name: replace(slo, ttft_p95_ms=math.inf) if name == "decode" else slo for name in names}
        pool_slo |= self.disaggregated.ttft_budgets(pools, slo, lines)
        for name in names:
            targets = pool_slo[name]  # the SLOs as this pool is held to them
            pool = PoolInput(pools[name].metrics, settings[name], pools[name].limits, pools[name].devices)
            known = mem.capacity.get(name)  # the step costs at today's knobs, as earlier runs learned them
            steps = None if known is None else self.estimator.per_replica(name, known, pool.current).steps
            lone = mem.key(name, REPLICAS).decode_step_floor  # as the last run averaged it
            proposals = self.knob_rules.propose(name, pool, targets, steps, None if lone is None else lone[1])
            capacity, measurable = self.estimator.update(name, pool, targets, mem, lines, proposals)
            for knob, proposal in proposals.items():
                settings[name] = self._act(name, knob, settings[name], proposal, mem, now, changes, lines)
            per_replica = self.estimator.per_replica(name, capacity, settings[name])  # at the knobs this run leaves
            # pods the tuner moved, ready (or gone) since: the SLO window has yet to see the new count
            direction = mem.key(name, REPLICAS).last_direction
            added_since = capacity.pods_since if direction > 0 else None
            removed_since = capacity.pods_since if direction < 0 else None
            finished = mem.finished.setdefault(name, Finished())
            finished.observe(pool.metrics)
            requests_s = requests_per_s(pool.metrics, finished)
            forecast = mem.forecast.setdefault(name, PoolForecast())
            outlook = self.prediction.outlook(name, pool, per_replica, forecast, requests_s)
            seen = mem.capacity[name].window_pods(now, pool.metrics.judged_window_s)
            history, window_s = mem.key(name, REPLICAS), self.config.scale_down_stabilization_s
            floor = history.follow_first_token_floor(now, first_token_floor(pool.metrics, per_replica.steps), window_s)
            decode_floor = history.follow_decode_step_floor(now, decode_step_floor(per_replica.steps), window_s)
            moved = Moved(added_since, removed_since, outlook, seen, floor, decode_floor)
            replicas, units = self.replica_rules.propose(name, pool, targets, per_replica, proposals, moved, requests_s)
            replicas, units = self.replica_rules.with_the_slots_coming(
                name, pool, targets, capacity, settings[name], proposals, mem, now, (replicas, units), moved, requests_s
            )
            replicas = self.evidence.above_counts_that_broke(name, pool, replicas, mem, now)
            if units is not None:
                demand[name] = units
            before = settings[name]
            settings[name] = self._act(name, REPLICAS, before, replicas, mem, now, changes, lines)
            settings[name] = self._slots_with_the_pods(name, before, settings[name], replicas, mem, now, changes, lines)
            if settings[name].replicas > before.replicas:
                mem.forecast[name].scaled_up(now, settings[name].replicas)
            if measurable:
                self.estimator.latency_saturation(name, pool, targets, capacity, proposals, lines)
            inputs[name]["capacity"] = per_replica.summary()
            inputs[name]["neededReplicas"] = plain(replicas.needed)
            if outlook is not None:
                inputs[name]["forecast"] = outlook.summary()
            needed[name] = replicas.needed
            if replicas.limit is not None:
                limits[name] = replicas.limit
        self.disaggregated.ratio_bounds(pools, settings, mem, now, changes, lines)
        for name in names:
            spend = mem.spend.setdefault(name, Spend())
            spend.record(
                now, settings[name].replicas, needed.get(name, settings[name].replicas), self.config.cost_window_s
            )
            cost = spend.summary(now, self.config.cost_window_s, pools[name].devices)
            if cost is not None:
                inputs[name]["cost"] = cost
            if pools[name].devices > 1:
                inputs[name]["devicesPerReplica"] = pools[name].devices
        if "prefill" in demand and "decode" in demand:
            lines.append(
                f"P:D demand {demand['prefill'][0]:.2f}:{demand['decode'][0]:.2f} replica-equivalents "
                f"({demand['prefill'][1]} vs {demand['decode'][1]}) -> "
                f"{settings['prefill'].replicas}:{settings['decode'].replicas} replicas"
            )
        return self._finish(now, changes, lines, False, "", settings, mem, inputs, limits)

    # -- bounds ---------------------------------------------------------------------------------

    def _enforce_bounds(
        self, name: str, pool: PoolInput, mem: TunerMemory, now: float, changes: list[Change], lines: list[str]
    ) -> PoolSettings:
        current, limits = pool.current, pool.limits
        replicas = Range(limits.min_replicas, limits.max_replicas)
        checks = [(REPLICAS, replicas, "minReplicas/maxReplicas (at least 1 while tuned)")]
        checks += [(knob, limits.knob(knob), f"bounds.{knob}") for knob in KNOB_FIELDS if knob in current.knobs]
        for knob, allowed, source in checks:
            old = current.value(knob)
            if old in allowed:
                continue
            new = allowed.clamp(old)
            reason = (
                f"{name}: {knob} {_num(old)} is outside spec {source} [{_num(allowed.low)}, {_num(allowed.high)}]"
                f" -> {_num(new)} (spec bounds win)"
            )
            changes.append(Change(name, knob, old, new, reason))
            lines.append(reason)
            current = current.with_value(knob, new)
            mem.key(name, knob).moved(now, 1 if new > old else -1)  # cooldown and anti-flap count it too
        return current

    # -- the batch cap a scale-down counted on ---------------------------------------------------

    def _slots_with_the_pods(
        self,
        name: str,
        before: PoolSettings,
        after: PoolSettings,
        replicas: Proposal,
        mem: TunerMemory,
        now: float,
        changes: list[Change],
        lines: list[str],
    ) -> PoolSettings:
        """A scale-down that counted on a bigger batch cap raises the cap with it (no cooldown:
        the two are one move, stabilized as the scale-down)."""
        cap = after.knobs.get(MAX_BATCH)
        if replicas.slots is None or cap is None or after.replicas >= before.replicas or replicas.slots <= cap:
            return after
        mem.key(name, MAX_BATCH).moved(now, 1)
        earlier = next((c for c in changes if c.pool == name and c.knob == MAX_BATCH), None)
        old = cap if earlier is None else earlier.old
        if earlier is not None:
            changes.remove(earlier)  # one change per knob and run
        reason = (
            f"{name}: replicas {_num(before.replicas)} -> {_num(after.replicas)} counted on {MAX_BATCH} "
            f"{replicas.slots}, which comes with them -> {MAX_BATCH} {_num(old)} -> {replicas.slots}"
        )
        changes.append(Change(name, MAX_BATCH, old, float(replicas.slots), reason))
        lines.append(reason)
        return after.with_value(MAX_BATCH, float(replicas.slots))

    # -- stabilization, cooldown, anti-flap -----------------------------------------------------

    def _act(
        self,
        name: str,
        knob: str,
        current: PoolSettings,
        proposal: Proposal,
        mem: TunerMemory,
        now: float,
        changes: list[Change],
        lines: list[str],
    ) -> PoolSettings:
        old = current.value(knob)
        history = mem.key(name, knob)
        history.record(now, proposal.target, self.config.memory_horizon_s)
        if any(c.pool == name and c.knob == knob for c in changes):
            lines.append(f"{name}: {proposal.why}: {knob} stays {_num(old)}, just brought within spec bounds")
            return current
        rise, fall = self.config.windows(knob)
        if proposal.protective and knob != REPLICAS:  # a knob protecting an SLO does not wait for a relaxation's window
            rise, fall = (0.0, fall) if proposal.target > old else (rise, 0.0)
        window, stretch = fall, ""
        if knob == REPLICAS:
            fall, stretch = self._stretched(history, now, fall)
        new, held_by = stabilize(history, now, old, rise, fall)
        held_by += stretch if held_by and proposal.target < old else ""
        floored = False
        if knob == REPLICAS and proposal.judged:
            history.judged(now, proposal.needed, int(old), self.config.memory_horizon_s)
        if knob == REPLICAS and new < old:
            # the need judged at this count or fewer over the window, and this run's floor
            floors = (history.floor_within(now, fall, int(old)), proposal.floor)
            floor = max((f for f in floors if f is not None), default=None)
            if floor is not None and new < floor:
                new, floored = min(floor, old), True
                if new >= old:
                    new, held_by = old, f"the latency floor keeps {_num(floor)} (highest need over {fall:.0f} s)"
        if new == old:
            if proposal.target == old:
                lines.append(f"{name}: {proposal.why}: {knob} stays {_num(old)}")
            else:
                lines.append(f"{name}: {proposal.why}: {knob} {_num(old)} -> {_num(proposal.target)} held: {held_by}")
            return current
        # Both budget moves protect an SLO (down: ITL, up: TTFT): one reversing the other within the
        # window means the two trade off, which only replicas resolve, so no excess overrides it.
        gate, note = self._gate(history, now, new > old, proposal, overridable=knob != TOKEN_BUDGET)
        if gate:
            lines.append(f"{name}: {proposal.why}: {knob} {_num(old)} -> {_num(new)} held: {gate}")
            return current
        if knob == REPLICAS:
            history.moved_replicas(now, new - old, window, self.config.regret_min_fall, self.config.break_memory_s)
        else:
            history.moved(now, 1 if new > old else -1)
        how = proposal.how if new == proposal.target else f"stabilized over {_num(rise if new > old else fall)} s"
        driver = proposal.driver
        if floored:
            how, driver = "the latency floor", "floor"
        how += stretch if new < old else ""
        reason = f"{name}: {proposal.why} -> {knob} {_num(old)} -> {_num(new)}" + (f" ({how})" if how else "")
        reason += f"; driven by {driver}" if driver else ""
        reason += f"; {note}" if note else ""
        changes.append(Change(name, knob, old, new, reason, driver))
        lines.append(reason)
        return current.with_value(knob, new)

    def _stretched(self, history: KeyHistory, now: float, window_s: float) -> tuple[float, str]:
        """The scale-down window, stretched by the longest regret within ``break_memory_s`` (a
        scale-down of ``regret_min_fall`` or more undone within the window, memory.py): where the
        load comes back after quiet spells longer than the window, bursts shorter than a pod
        start-up meet the pods a scale-down let go, and the pods added come up after the burst.
        So the window covers the spells seen, as a longer scale-down window holds an HPA's pods.
        Also (window, note) for the reasons."""
        regret = history.regret_within(now, self.config.break_memory_s)
        if regret is None or window_s <= 0:
            return window_s, ""
        when, gap = regret
        note = (
            f", the {window_s:.0f} s window stretched by {gap:.0f} s: a scale-down was undone {gap:.0f} s after "
            f"it, {now - when:.0f} s ago"
        )
        return window_s + gap, note

    def _gate(
        self, history: KeyHistory, now: float, rising: bool, proposal: Proposal, overridable: bool = True
    ) -> tuple[str, str]:
        """(why the move is blocked, or ''; a note when an SLO overrides anti-flapping)."""
        c = self.config
        direction = 1 if rising else -1
        reverses = history.last_direction not in (0, direction)
        if not reverses and history.last_change_at is not None and now - history.last_change_at < c.cooldown_s:
            return f"cooldown, last changed {now - history.last_change_at:.0f} s ago (< {c.cooldown_s:.0f} s)", ""
        if history.reverses_within(now, direction, c.flap_window_s):
            flap = (
                f"reversing the {'rise' if history.last_direction > 0 else 'fall'} begun "
                f"{now - history.direction_since:.0f} s ago "
                f"(one direction change per {c.flap_window_s:.0f} s)"
            )
            if overridable and proposal.protective and proposal.severity >= c.override_ratio:
                return "", f"{flap} allowed: {proposal.severity:.2f}x over target (>= {c.override_ratio:g})"
            return flap, ""
        return "", ""

    def _finish(
        self,
        now: float,
        changes: list[Change],
        lines: list[str],
        hold: bool,
        hold_reason: str,
        settings: dict[str, PoolSettings],
        mem: TunerMemory,
        inputs: dict[str, dict[str, Any]],
        limits: dict[str, ScalingLimit] | None = None,
    ) -> Decision:
        mem.remember(DecisionRecord(at=now, hold=hold, changes=[str(c) for c in changes]))
        if not lines:
            lines.append("no pools to tune")
        return Decision(now, tuple(changes), tuple(lines), hold, hold_reason, settings, mem, inputs, limits or {})
