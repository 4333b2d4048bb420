"""The tuner's control law: metrics in, a decision out. Pure and deterministic (the clock is an
argument); the operator's daemon, the local fleet, the simulator and the tests all call
``Tuner.decide`` the same way.

Per pool and run: spec bounds win; stale data holds everything; the knob rules (knobs.py)
propose; replicas cover demand over per-replica capacity (capacity.py) with headroom, and the
owned latencies, projected at another pod count (projection.py), size the pool too; then HPA-
style stabilization, cooldowns and anti-flapping gate every move (memory.py). Every change and
every hold carries a reason that cites its numbers. The rules, and why each is as it is, are in
docs/tuner.md."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from llmfleet.operator.metrics.source import PoolMetrics
from llmfleet.operator.tuner.capacity import CapacityEstimator, PerReplica
from llmfleet.operator.tuner.decision import (
    INTEGER_KNOBS,
    KNOB_FIELDS,
    MAX_BATCH,
    OUT_OF_REACH,
    POOL_ORDER,
    REPLICAS,
    TIMEOUT,
    TOKEN_BUDGET,
    TOO_FEW,
    TOO_MANY,
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
from llmfleet.operator.tuner.forecast import Outlook, PoolForecast, level_noise
from llmfleet.operator.tuner.knobs import KnobRules
from llmfleet.operator.tuner.memory import Capacity, DecisionRecord, KeyHistory, TunerMemory, stabilize
from llmfleet.operator.tuner.per_request import Finished, offered, requests_per_s
from llmfleet.operator.tuner.projection import (
    Projection,
    decode_step_floor,
    first_token_floor,
    project,
    trusted_queue_s,
)
from llmfleet.operator.tuner.proposal import (
    Moved,
    Proposal,
    busy_kv_load,
    busy_surge,
    exhausted_knobs,
    fmt_ms,
    owned_latency_ratio,
    protecting_knobs,
    spent,
)
from llmfleet.operator.tuner.season import SeasonalRise, bin_seconds
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


# --- the law -----------------------------------------------------------------------------------


def _season_in_replicas(readings: list[tuple[SeasonalRise | None, float]]) -> tuple[float, float, int] | None:
    """Seasonal readings of a pool's series, each over its per-replica capacity, summed in
    replica-equivalents: (rise, spread, periods seen), or None where a series is not yet known."""
    read = [(r, cap) for r, cap in readings if r is not None]
    if not read or len(read) < len(readings):
        return None
    rise = sum(max(0.0, r.rise) / cap for r, cap in read)
    return rise, sum(r.spread / cap for r, cap in read), min(r.periods for r, _ in read)


def _bounds_limit(name: str, wanted: float, driver: str, low: int, high: int) -> ScalingLimit | None:
    """HPA's ScalingLimited reasons for a count the spec's bounds cut: above maxReplicas, or
    below minReplicas where some load wants a pod (an idle pool held at its minimum is no limit)."""
    wants = f"{name}: {_num(wanted)} replica{'s' * (wanted != 1)} wanted ({driver})"
    if wanted > high:
        return ScalingLimit(TOO_MANY, f"{wants}, held at maxReplicas {high}")
    if 1 <= wanted < low:
        return ScalingLimit(TOO_FEW, f"{wants}, held at minReplicas {low}")
    return None


def _prefill_past_ttft(name: str, slo: SLOTargets, floor: tuple[float, float] | None) -> str:
    """Where the p95 prompt's own prefill at these knobs (``floor``: its tokens and seconds,
    averaged over the scale-down window; projection.first_token_floor) passes the TTFT SLO, the
    numbers that say so, else '': at least 5% of first tokens then wait longer than the SLO
    however many pods there are, whether or not this window's p95 shows it."""
    if name == "decode" or floor is None:
        return ""
    tokens, alone = floor
    if alone * 1000.0 < slo.ttft_p95_ms:
        return ""
    held_to = "the TTFT SLO" if name == "colocated" else "the prefill pool's share of the TTFT SLO"
    return (
        f"a p95 prompt ({tokens:.0f} tokens) takes {fmt_ms(alone * 1000.0)} ms to prefill alone at these "
        f"knobs, past {held_to} {fmt_ms(slo.ttft_p95_ms)} ms"
    )


def _decode_past_itl(name: str, slo: SLOTargets, floor_s: float | None) -> str:
    """Where a decode step of one sequence (``floor_s``, averaged over the scale-down window;
    projection.decode_step_floor) takes longer than the ITL SLO, the numbers that say so, else '':
    a pod with a single request still leaves that gap between its tokens, so no pod count brings
    ITL's p95 within the SLO."""
    if name == "prefill" or floor_s is None or floor_s * 1000.0 < slo.itl_p95_ms:
        return ""
    return (
        f"a decode step of one sequence takes {fmt_ms(floor_s * 1000.0)} ms, past the ITL SLO "
        f"{fmt_ms(slo.itl_p95_ms)} ms"
    )


def _window_saw_the_added(m: PoolMetrics, added_since: float | None) -> bool:
    """Whether the window the latencies are judged over began after the pods the tuner last
    added were ready (or none were added): only then was it measured at today's count."""
    return added_since is None or m.at - added_since >= m.judged_window_s


class Tuner:
    def __init__(self, config: TunerConfig | None = None) -> None:
        self.config = config or TunerConfig()
        self.knob_rules = KnobRules(self.config)
        self.estimator = CapacityEstimator(self.config)

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
        # a decode pool owns no TTFT but the share _ttft_budgets gives it
        pool_slo = {name: replace(slo, ttft_p95_ms=math.inf) if name == "decode" else slo for name in names}
        pool_slo |= self._ttft_budgets(pools, slo, lines)
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
            outlook = self._forecast(name, pool, per_replica, forecast, requests_s)
            seen = mem.capacity[name].window_pods(now, pool.metrics.judged_window_s)
            history, window_s = mem.key(name, REPLICAS), self.config.scale_down_stabilization_s
            floor = history.follow_first_token_floor(now, first_token_floor(pool.metrics, per_replica.steps), window_s)
            decode_floor = history.follow_decode_step_floor(now, decode_step_floor(per_replica.steps), window_s)
            moved = Moved(added_since, removed_since, outlook, seen, floor, decode_floor)
            replicas, units = self._replica_proposal(name, pool, targets, per_replica, proposals, moved, requests_s)
            replicas, units = self._with_the_slots_coming(
                name, pool, targets, capacity, settings[name], proposals, mem, now, (replicas, units), moved, requests_s
            )
            replicas = self._above_counts_that_broke(name, pool, replicas, mem, now)
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
        self._ratio_bounds(pools, settings, mem, now, changes, lines)
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

    def _ttft_budgets(self, pools: Mapping[str, PoolInput], slo: SLOTargets, lines: list[str]) -> dict[str, SLOTargets]:
        """The TTFT targets of a disaggregated fleet's two pools, whose parts add up to what
        clients wait (the router relays the decode server's first token).

        The prefill pool is held to the SLO less what a decode server adds to every request: its
        TTFT p95, the KV fetch, the step in flight it joins after and its first step, less any
        wait for a batch slot beyond that step, which more prefill pods would not shorten. Two
        p95s added overstate the p95 of the sum where the slow prefills and the slow decode
        starts are not the same requests (in the simulator, 0.43 s against the clients' 0.40-0.41
        s), a margin on the safe side.

        That slot wait is the decode pool's: it is held to the SLO less the prefill pool's TTFT
        p50, where that leaves room for a wait beyond what it adds to every request. The median,
        not the p95: a start slow for want of a slot mostly meets a typical prefill, and the p95
        held the decode pool to a sum its clients' p95 did not reach (a pod added for nothing).
        Demand alone does not size the pool for the wait: its slots can fill in a busy window at
        a mean load its pods serve with headroom to spare, and only its latency projection
        (Erlang C over its slots) sees that. Where the prefill pool's TTFT leaves no such room,
        the excess is the prefill pool's to clear, and decode owns no TTFT. Nothing changes
        without a known decode TTFT."""
        if "prefill" not in pools or "decode" not in pools:
            return {}
        decode = pools["decode"].metrics
        ttft = decode.ttft.p95
        if ttft is None:
            return {}
        slot_wait = max(0.0, (trusted_queue_s(decode) or 0.0) - (decode.mean_step_seconds or 0.0))
        added = ttft - min(slot_wait, ttft)
        floor = slo.ttft_p95_ms * self.config.prefill_ttft_min_share
        budget = max(floor, slo.ttft_p95_ms - added * 1000.0)
        lines.append(
            f"prefill: TTFT held to {fmt_ms(budget)} ms: the SLO {fmt_ms(slo.ttft_p95_ms)} ms less the "
            f"{fmt_ms(added * 1000.0)} ms a decode server adds (its TTFT p95 {fmt_ms(ttft * 1000.0)} ms"
            + (f" less {fmt_ms(slot_wait * 1000.0)} ms of waiting for a batch slot" if slot_wait else "")
            + ")"
            + (f", at least {self.config.prefill_ttft_min_share:.0%} of the SLO" if budget == floor else "")
        )
        budgets = {"prefill": replace(slo, ttft_p95_ms=budget)}
        prefill = pools["prefill"].metrics.ttft.p50
        if prefill is None:
            return budgets
        left = slo.ttft_p95_ms - prefill * 1000.0
        if left <= added * 1000.0:
            lines.append(
                f"decode: owns no TTFT: the prefill pool's TTFT p50 {fmt_ms(prefill * 1000.0)} ms leaves "
                f"{fmt_ms(max(left, 0.0))} ms of the SLO, no more than the {fmt_ms(added * 1000.0)} ms a decode "
                "server adds to every request"
            )
            return budgets
        lines.append(
            f"decode: TTFT held to {fmt_ms(left)} ms: the SLO less the prefill pool's TTFT p50 "
            f"{fmt_ms(prefill * 1000.0)} ms (a wait for a batch slot is decode's to clear)"
        )
        return budgets | {"decode": replace(slo, ttft_p95_ms=left)}

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

    # -- replicas -------------------------------------------------------------------------------

    def _replica_proposal(
        self,
        name: str,
        pool: PoolInput,
        slo: SLOTargets,
        capacity: PerReplica,
        knobs: Mapping[str, Proposal],
        moved: Moved,
        requests_s: float | None = None,
    ) -> tuple[Proposal, tuple[float, str] | None]:
        """The replica count demand, the trend and the owned latencies ask for, the queue priced
        at the tokens of ``requests_s`` requests/s (per_request.py). A scale-down's
        target is demand alone (stabilized over its window, as HPA's recommendations are), and
        the latency projection's floor, judged at this run's count, rides beside it (``floor``):
        a floor judged at an earlier, larger count must not hold the pool a window per step (_act
        takes the highest need judged at this count or fewer within the window)."""
        c, m, cur = self.config, pool.metrics, float(pool.current.replicas)
        added_since, removed_since, outlook, seen, *_ = moved
        seen = cur if seen is None else seen  # the pods the owned latencies were measured with
        judged = owned_latency_ratio(name, m, slo) > 0 and (m.ready_pods or 0) == cur
        if removed_since is not None and m.at - removed_since < m.judged_window_s:
            judged = False  # the window still holds more pods than there are: nothing judged at this count yet
        parts: list[tuple[float | None, float, str]] = []
        if name in ("colocated", "prefill"):
            parts.append((m.uncached_prompt_tokens_per_s(), capacity.prompt_tps, "prompt"))
        if name in ("colocated", "decode"):
            parts.append((m.generation_tokens_per_s, capacity.generation_tps, "generation"))
        unknown = [label for rate, _, label in parts if rate is None]
        if unknown:
            fields = {"prompt": "prompt_tokens_per_s", "generation": "generation_tokens_per_s"}
            why = "; ".join(m.why_missing(fields[label]) for label in unknown)
            return Proposal(cur, f"demand unknown ({why})"), None
        units = sum(rate / cap for rate, cap, _ in parts)  # type: ignore[operator]
        served = units
        detail = " + ".join(f"{label} {rate:.0f} tok/s / {cap:.0f} per replica" for rate, cap, label in parts)
        for extra in (self._growth_units(m, parts, requests_s), self._backlog_units(m, parts, requests_s)):
            if extra is not None:
                units += extra[0]
                detail += f" {'-' if extra[0] < 0 else '+'} {extra[1]}"
        if capacity.basis:
            detail += f"; per replica {capacity.basis}"
        if not math.isfinite(units):  # e.g. a near-zero request rate under a queue: no usable estimate
            return Proposal(cur, f"demand not finite ({detail}): replicas hold"), None
        raw = math.ceil(units / (1.0 - c.headroom) - 1e-9)
        driver = "queue" if raw > math.ceil(served / (1.0 - c.headroom) - 1e-9) else "demand"
        why = f"demand {units:.2f} replicas ({detail}) / (1 - headroom {c.headroom:g}) = {raw}"
        if outlook is not None and outlook.rise_units > 0:
            ahead = math.ceil((units + outlook.rise_units) / (1.0 - c.headroom) - 1e-9)
            if ahead > raw:
                raw, driver = ahead, outlook.driver
                why += f"; {outlook.why} -> {ahead} a pod start-up ahead"
            latency_ahead = self._latency_ahead(name, pool, slo, units, outlook, capacity, seen)
            if latency_ahead is not None and latency_ahead[0] > max(raw, cur):
                raw, driver = latency_ahead[0], outlook.driver
                why += f"; {outlook.why}: {latency_ahead[1]}"
        if outlook is not None and outlook.peak_units > 0 and raw < cur:
            kept = min(int(cur), math.ceil((units + outlook.peak_units) / (1.0 - c.headroom) - 1e-9))
            if kept > raw:
                raw, driver = kept, "season"
                why += f"; {outlook.peak_why}: fewer pods now would be wanted back within the window -> {kept}"
        if name in ("prefill", "decode") and raw < cur and c.ratio_hysteresis > 0:
            # the P:D ratio moves only for a pool's demand clearly below its count, not at its edge
            held = min(int(cur), math.ceil(units / (1.0 - c.headroom) + c.ratio_hysteresis - 1e-9))
            if held > raw:
                why += f"; less than {c.ratio_hysteresis:g} replica under {raw}: the P:D ratio holds -> {held}"
                raw = held

        latency = owned_latency_ratio(name, m, slo)
        judged_s = m.slo_window_s or m.window_s
        held = False
        if raw <= cur and judged and _window_saw_the_added(m, added_since):
            busy = self._busy_itl(name, m, slo, units, int(cur), capacity)
            if busy is not None:
                raw, driver = int(cur) + 1, "busy window"
                why += f"; a busy window projects ITL at {busy.ratio:.2f}x its SLO ({busy.how}) -> {raw}"
            held = busy is None and 0 < latency <= c.hold_latency_ratio and units > 0
        out_of_reach: ScalingLimit | None = None
        past = _prefill_past_ttft(name, slo, moved.first_token_floor)
        itl_past = _decode_past_itl(name, slo, moved.decode_step_floor)
        if past:  # a spec's matter, however TTFT reads now
            out_of_reach = ScalingLimit(
                OUT_OF_REACH,
                f"{name}: {past}, so no replica count meets it; raise slo.ttftP95Ms past it, "
                "or serve shorter prompts or a faster model",
            )
        elif itl_past:
            out_of_reach = ScalingLimit(
                OUT_OF_REACH,
                f"{name}: {itl_past}, so no replica count meets it; raise slo.itlP95Ms past it, "
                "or serve a faster model",
            )
        # pods are sized for the latencies they can move: an ITL no count meets is left out
        reachable = replace(slo, itl_p95_ms=math.inf) if itl_past else slo
        exhausted = exhausted_knobs(pool, knobs)
        if exhausted:
            pods = m.ready_pods or 0
            waiting = (m.waiting or 0.0) / max(pods, 1)
            # the batch cut down to its floor: the ITL left is the steps' own, not a shared pod's
            itl_only = (
                set(exhausted) == {MAX_BATCH} and pool.current.knobs[MAX_BATCH] <= pool.limits.knob(MAX_BATCH).low
            )
            used = spent(pool, knobs, exhausted)
            if pods < cur:  # none fewer either: the pods still starting are what the SLO waits for
                raw = max(raw, int(cur))
                why += f"; SLO violated with {used}, but {pods} of {_num(cur)} pods ready: waiting for them"
            elif units <= 0:
                why += f"; SLO violated with {used} over a window whose traffic has ended: no replica for that"
            elif m.slo_window_s and latency <= 1.0:
                why += (
                    f"; SLO violated over {m.window_s:.0f} s with {used}, but met over its "
                    f"{m.slo_window_s:.0f} s window ({latency:.2f}x): no replica for that"
                )
            elif latency < c.override_ratio and added_since is not None and m.at - added_since < judged_s:
                why += (
                    f"; SLO violated with {used} ({latency:.2f}x), but {pods} pods are ready only "
                    f"{m.at - added_since:.0f} s and the {judged_s:.0f} s window still holds the time before: "
                    "no replica for that yet"
                )
            elif drained := self._drained_ttft_excess(name, pool, slo):
                why += f"; SLO violated with {used}, but {drained}: no replica for that"
            elif itl_past and owned_latency_ratio(name, m, reachable) <= 1.0:
                why += f"; SLO violated with {used}, but {itl_past}: no replica count meets it"
            elif beyond := self._ttft_beyond_pods(name, m, reachable, past):
                why += f"; SLO violated with {used}, but {beyond}: no replica count meets it"
            elif itl_only and waiting < c.queue_per_pod:
                why += (
                    f"; ITL over SLO at the minimum {MAX_BATCH} with no queue ({waiting:.1f} waiting per pod):"
                    " more replicas would not lower it"
                )
                out_of_reach = out_of_reach or ScalingLimit(
                    OUT_OF_REACH,
                    f"{name}: ITL p95 {fmt_ms((m.judged_itl.p95 or 0.0) * 1000.0)} ms is over its SLO "
                    f"{fmt_ms(slo.itl_p95_ms)} ms at the lowest {MAX_BATCH} with no queue, which more replicas "
                    "would not lower; raise slo.itlP95Ms, or serve a faster model",
                )
            else:
                needed = self._latency_replicas(name, m, reachable, units, int(cur), pool.limits.max_replicas, capacity)
                if needed is not None and needed > max(raw, cur):
                    raw, driver = needed, "latency"
                    why += f"; SLO violated with {used} -> {needed}, where the owned latency projects within it"
                elif raw <= cur:
                    raw, driver = int(cur) + 1, "latency"
                    why += f"; SLO violated with {used} -> one more replica"
        floor = None
        protecting = protecting_knobs(pool, knobs)
        if raw < cur and latency > 1.0 and protecting and units > 0:
            # what the knob does has yet to show; a scale-down now would be undone once it has
            why += f"; SLO violated ({latency:.2f}x) while {', '.join(protecting)} moves to protect it: replicas hold"
            raw = int(cur)
        if raw < cur:
            floor, note = self._projected_scale_down(name, m, reachable, units, int(cur), raw, capacity, removed_since)
            why += note
        low, high = pool.limits.min_replicas, pool.limits.max_replicas
        limit = out_of_reach or _bounds_limit(name, max(raw, floor or 0), driver, low, high)
        target = min(max(raw, low), high)
        if target != raw:
            why += f", within [{low}, {high}] -> {target}"
            driver = "bounds"
        if floor is not None:
            floor = min(max(floor, low), high)
            floor = None if floor <= target else float(floor)
        over = units / cur if cur > 0 else (math.inf if units > 0 else 0.0)
        proposal = Proposal(
            float(target),
            why,
            protective=target > cur,
            severity=max(latency, over),
            floor=floor,
            driver=driver,
            judged=judged,
            load=m.request_rate,
            broke=driver in ("latency", "busy window") and self._broke_at_this_count(m, added_since),
            held=held,
            limit=limit,
        )
        return proposal, (units, detail)

    def _broke_at_this_count(self, m: PoolMetrics, added_since: float | None) -> bool:
        """Whether an SLO broken with every knob spent says this many pods cannot hold it: no queue
        (not a backlog, which more pods clear and then leave) and no fewer pods within the window
        it was judged over (more only make the evidence stronger)."""
        queue = (m.waiting or 0.0) / max(m.ready_pods or 0, 1)
        return queue < self.config.queue_per_pod and _window_saw_the_added(m, added_since)

    def _drained_ttft_excess(self, name: str, pool: PoolInput, slo: SLOTargets) -> str:
        """Why an owned-latency excess is only the first tokens of a backlog the pods have already
        cleared (knobs.py's test, the one that holds the token budget), or '': pods added now
        would serve none of those requests sooner. Not where ITL is over its SLO too."""
        m = pool.metrics
        if name != "prefill" and (m.judged_itl.p95 or 0.0) * 1000.0 > slo.itl_p95_ms:
            return ""
        return self.knob_rules.drained_backlog(pool, slo)

    @staticmethod
    def _ttft_beyond_pods(name: str, m: PoolMetrics, slo: SLOTargets, past: str) -> str:
        """``past`` (why the p95 prompt's own prefill at these knobs passes the TTFT SLO,
        _prefill_past_ttft) where the owned TTFT is over that SLO now, or '': every first token
        waits for its own prompt, so no pod count brings the p95 within the SLO, and pods added
        for it stand idle. Not where ITL is over its SLO too, which pods can bring back."""
        ttft = m.judged_ttft.p95
        if not past or ttft is None or ttft * 1000.0 <= slo.ttft_p95_ms:
            return ""
        if name == "colocated" and (m.judged_itl.p95 or 0.0) * 1000.0 > slo.itl_p95_ms:
            return ""
        return past

    def _forecast(
        self, name: str, pool: PoolInput, capacity: PerReplica, state: PoolForecast, requests_s: float | None
    ) -> Outlook | None:
        """Feed this run's rates to the pool's trends (and its season's profile) and say what they
        add over one pod start-up and one interval: the trend's rise, or the season's where that
        is larger. A rise counts only where it stands out of its noise (the trend's: the spread
        its smoothed level keeps, forecast.level_noise; the season's: how far its bins stray from
        period to period), only while no queue is draining (the queue terms speak for a ramp
        already here, and a draining backlog lifts served rates), and the trend's never more than
        ``forecast_max_rise`` of today's demand (the season's goes no further than the periods
        before it went)."""
        c, m = self.config, pool.metrics
        rates = {
            "request_rate": m.request_rate,
            "prompt_tokens_per_s": m.uncached_prompt_tokens_per_s(),
            "generation_tokens_per_s": m.generation_tokens_per_s,
        }
        state.ready(m.at, m.ready_pods or 0)
        state.observe(m.at, rates, c.forecast_alpha, c.forecast_beta)
        if not c.predictive:
            return None
        horizon = (state.startup_s if state.startup_s is not None else c.startup_guess_s) + c.interval_s
        series = []
        if name in ("colocated", "prefill"):
            series.append(("prompt_tokens_per_s", capacity.prompt_tps))
        if name in ("colocated", "decode"):
            series.append(("generation_tokens_per_s", capacity.generation_tps))
        # a rate measured over a window shows a rise a window after it came, and so does the profile
        ahead = horizon + m.window_s
        # served rates under a queue are the pods' capacity, not the load: the profile learns the
        # load from them and the queue's growth (offered), and the forecast leaves it to the queue
        # terms (below)
        queued = (m.waiting or 0.0) / max(m.ready_pods or 0, 1) >= c.queue_per_pod
        load = offered(m, rates, requests_s) if queued else rates
        seasonal = self._seasonal(state, m.at, ahead, {s: (load[s], cap) for s, cap in series})
        peak, peak_why = (0.0, "") if queued else self._seasonal_peak(state, m.at, c.flap_window_s + ahead, series)
        held = [(state.series[s], cap, rates[s]) for s, cap in series if s in state.series and cap > 0]
        if not held or any(rate is None for _, _, rate in held):
            return None
        now_units = sum(rate / cap for _, cap, rate in held)  # type: ignore[operator]
        rise = sum(max(0.0, h.rise(horizon)) / cap for h, cap, _ in held)
        noise = sum(h.error / cap for h, cap, _ in held) * level_noise(c.forecast_alpha)
        trends = {s: state.series[s].trend for s in (*(x for x, _ in series), "request_rate") if s in state.series}
        source = "startup measured" if state.startup_s is not None else "startup guessed"
        why, term = f"trend +{rise:.2f} replicas over {horizon:.0f} s ({source}; noise {noise:.2f})", "trend"
        # the season's rise clears its spreads and, as the trend's does, the level's noise
        if seasonal is not None:
            ahead_rise, spread, periods = seasonal
            if ahead_rise > max(c.season_spreads * spread, noise) and (rise <= noise or ahead_rise > rise):
                why = (
                    f"the {c.season_s:.0f} s season's profile +{ahead_rise:.2f} replicas over {horizon:.0f} s and "
                    f"the {m.window_s:.0f} s rate window ({source}; seen over {periods} periods, spread {spread:.2f}); "
                    f"{why}"
                )
                rise, noise, term = ahead_rise, max(spread, noise), "season"
        if rise <= noise or rise <= 0:
            return Outlook(horizon, 0.0, noise, trends, why + ": within the noise", term, peak, peak_why)
        if queued or (m.waiting_growth_per_s or 0.0) < 0:
            return Outlook(horizon, 0.0, noise, trends, why + ": a queue speaks for the load instead", term)
        # the season rises no further than the periods it has seen went; a trend, unbounded, is capped
        capped = rise if term == "season" else min(rise, c.forecast_max_rise * now_units)
        if capped < rise:
            why += f", at most {c.forecast_max_rise:g}x today's {now_units:.2f}"
        return Outlook(horizon, capped, noise, trends, why, term, peak, peak_why)

    def _seasonal_peak(
        self, state: PoolForecast, now: float, within: float, series: list[tuple[str, float]]
    ) -> tuple[float, str]:
        """The season's highest rise within ``within`` ahead, in replica-equivalents, where it clears
        ``season_spreads`` of the largest spread among the bins it compared; (0, '') where not."""
        c = self.config
        if c.season_s <= 0 or state.season is None:
            return 0.0, ""
        read = _season_in_replicas([(state.season.peak(s, now, within), cap) for s, cap in series if cap > 0])
        if read is None or read[0] <= c.season_spreads * read[1]:
            return 0.0, ""
        return read[0], f"the {c.season_s:.0f} s season's profile rises +{read[0]:.2f} replicas within {within:.0f} s"

    def _seasonal(
        self, state: PoolForecast, now: float, horizon: float, series: dict[str, tuple[float | None, float]]
    ) -> tuple[float, float, int] | None:
        """Add this run's rates to the pool's season and read its rise over the horizon, in
        replica-equivalents: (rise, spread, periods seen), or None where the season is off or not
        yet known for every series."""
        c = self.config
        if c.season_s <= 0:
            return None
        season = state.seasonal(c.season_s, bin_seconds(c.season_s, c.interval_s))
        season.observe(now, {s: rate for s, (rate, _) in series.items()})
        return _season_in_replicas([(season.rise(s, now, horizon), cap) for s, (_, cap) in series.items() if cap > 0])

    def _with_the_slots_coming(
        self,
        name: str,
        pool: PoolInput,
        slo: SLOTargets,
        capacity: Capacity,
        leaves: PoolSettings,
        knobs: Mapping[str, Proposal],
        mem: TunerMemory,
        now: float,
        proposal: tuple[Proposal, tuple[float, str] | None],
        moved: Moved,
        requests_s: float | None = None,
    ) -> tuple[Proposal, tuple[float, str] | None]:
        """The replica proposal at the batch cap this run recommends, where that is more than the
        cap it leaves and lets fewer pods go: pods and slots are one decision. The cap's own
        relaxation window holds the cap a while, and a scale-down judged at today's cap would
        keep pods only for want of slots (and decode throughput) that are coming. The proposal
        then counts on them, and a scale-down that goes brings them (_slots_with_the_pods); one
        whose window saw recommendations without them keeps the pods, since it takes the highest.
        Never where the cap fell within the anti-flap window, and never to weaken a rise."""
        batch, cap = knobs.get(MAX_BATCH), leaves.knobs.get(MAX_BATCH)
        if batch is None or cap is None or batch.target <= cap:
            return proposal
        if mem.key(name, MAX_BATCH).reverses_within(now, 1, self.config.flap_window_s):
            return proposal
        then = leaves.with_value(MAX_BATCH, batch.target)
        at_then = self.estimator.per_replica(name, capacity, then)
        alt, units = self._replica_proposal(name, pool, slo, at_then, knobs, moved, requests_s)
        if alt.needed >= min(proposal[0].needed, pool.current.replicas):
            return proposal
        return replace(alt, slots=int(batch.target)), units

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

    def _projected_scale_down(
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
        limit = self._scale_down_limit(name, m, slo, units, cur, capacity)
        projected = self._project(name, m, slo, units, cur, lowest, capacity)
        if projected.ratio <= limit:
            return target, note
        fewer = range(lowest + 1, cur)
        n = next((n for n in fewer if self._project(name, m, slo, units, cur, n, capacity).ratio <= limit), cur)
        slots = None if capacity.steps is None else capacity.steps.slots
        at = f"at {lowest}" + ("" if slots is None else f" with {MAX_BATCH} {slots}")
        return n, note + (
            f"; {at} the owned latency is projected at {projected.ratio:.2f}x its SLO ({projected.how}; now "
            f"{ratio:.2f}x, utilization {units / cur:.2f} -> {units / lowest:.2f}; > {limit:.2f})"
            f" -> {n}"
        )

    def _scale_down_limit(
        self, name: str, m: PoolMetrics, slo: SLOTargets, units: float, cur: int, capacity: PerReplica
    ) -> float:
        """The most a scale-down may project its owned latency at: ``projected_latency_limit``, or
        where a busy window at today's count already projects past it, that projection plus the
        limit's own margin. Pods cannot lower a latency that is over the limit with all of them
        (a long prompt's own prefill, a small token budget): a count is then refused for the
        latency it adds, not for what no count removes, which held every pod at start-up."""
        c = self.config
        today = self._project(name, m, slo, units, cur, cur, capacity).ratio
        return max(c.projected_latency_limit, today + 1.0 - c.projected_latency_limit)

    def _latency_replicas(
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
                if self._project(name, m, slo, units, at, n, capacity, busy=False, growth=growth).ratio <= limit
            ),
            None,
        )

    def _busy_itl(
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
        busy = self._project(name, m, itl_only, units, cur, cur, capacity, measured_tail=True)
        return busy if busy.ratio > self.config.busy_itl_limit else None

    def _latency_ahead(
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
        then = self._project(name, m, slo, units, seen, cur, capacity, busy=False, growth=growth)
        if then.ratio <= c.scale_up_latency_limit:
            return None
        n = self._latency_replicas(name, m, slo, units, cur, pool.limits.max_replicas, capacity, growth, seen)
        if n is None:
            return None  # no count holds it: pods would not help
        return n, f"at {cur} pods that load projects the owned latency at {then.ratio:.2f}x its SLO ({then.how}) -> {n}"

    def _project(
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

    def _growth_units(
        self, m: PoolMetrics, parts: list[tuple[float | None, float, str]], requests_s: float | None
    ) -> tuple[float, str] | None:
        """Replica-equivalents of the arrivals the pool is not keeping up with: served throughput
        stops growing once a pool saturates, while a queue that grows by g requests/s says the
        arrival rate is g above it. Counting them scales a step up in one move, before the
        backlog they build gets long (a pod takes a while to start). A queue that shrinks says
        the reverse: part of what was served was the backlog, which the backlog term already
        prices, so the arrivals are that much below it (never below none). Only a queue that
        moved by at least one request over the window counts; smaller slopes are noise. A
        request weighs the window's tokens over ``requests_s`` (per_request.py)."""
        growth = m.waiting_growth_per_s
        if growth is None or abs(growth) * m.window_s < 1.0 or not requests_s:
            return None
        units = sum(growth * (rate or 0.0) / requests_s / cap for rate, cap, _ in parts)
        if growth < 0:
            units = max(units, -sum((rate or 0.0) / cap for rate, cap, _ in parts))
            return units, f"queue draining {-growth:.2f} req/s = {-units:.2f}"
        return units, f"queue growing {growth:.2f} req/s = {units:.2f}"

    def _backlog_units(
        self, m: PoolMetrics, parts: list[tuple[float | None, float, str]], requests_s: float | None
    ) -> tuple[float, str] | None:
        """Replica-equivalents to drain the queue within ``backlog_drain_s``: served throughput
        under-counts demand once requests wait, so the waiting requests' tokens are added (a
        request weighing the window's tokens over ``requests_s``)."""
        c = self.config
        if not m.waiting or m.waiting < 1 or not requests_s:
            return None
        units = 0.0
        for rate, cap, _ in parts:
            if rate is not None:
                units += m.waiting * (rate / requests_s) / cap / c.backlog_drain_s
        return units, f"backlog {m.waiting:.0f} waiting drained in {c.backlog_drain_s:.0f} s = {units:.2f}"

    def _ratio_bounds(
        self,
        pools: Mapping[str, PoolInput],
        settings: dict[str, PoolSettings],
        mem: TunerMemory,
        now: float,
        changes: list[Change],
        lines: list[str],
    ) -> None:
        """Keep prefill:decode replicas within the spec's ratio bounds by raising the pool that
        falls short (within its maxReplicas): raising never costs an SLO, cutting might."""
        bounds = self.config.prefill_decode_ratio
        if bounds is None or "prefill" not in settings or "decode" not in settings:
            return
        low, high = bounds
        p, d = settings["prefill"].replicas, settings["decode"].replicas
        if p < low * d - 1e-9:
            name, want, ratio = "prefill", math.ceil(low * d - 1e-9), f"< min {low:g}"
        elif p > high * d + 1e-9:
            name, want, ratio = "decode", math.ceil(p / high - 1e-9), f"> max {high:g}"
        else:
            return
        old = settings[name].replicas
        new = min(want, pools[name].limits.max_replicas)
        if new <= old:
            lines.append(f"P:D {p}:{d} {ratio}, but {name} is at its maxReplicas {old}")
            return
        earlier = next((c for c in changes if c.pool == name and c.knob == REPLICAS), None)
        if earlier is not None:
            changes.remove(earlier)  # one change per knob and run
        start = old if earlier is None else earlier.old
        reason = f"{name}: P:D {p}:{d} is {ratio} (spec prefillDecodeRatio) -> replicas {_num(start)} -> {new}"
        mem.key(name, REPLICAS).moved(now, 1 if new > start else -1)
        changes.append(Change(name, REPLICAS, start, float(new), reason, "ratio"))
        lines.append(reason)
        settings[name] = settings[name].with_value(REPLICAS, new)

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

    def _above_counts_that_broke(
        self, name: str, pool: PoolInput, proposal: Proposal, mem: TunerMemory, now: float
    ) -> Proposal:
        """The proposal, its latency floor lowered to a count that held this load
        (_below_projection_where_held), then floored one above the most pods at which the owned
        SLO broke with every knob spent (or a busy window projected ITL far past it, _busy_itl),
        within ``break_memory_s`` and at a load level that today's, with headroom, still reaches. A
        projection extrapolates from the pods there are; a break measured fewer: long prompts
        whose steps stall the decodes of a busy minute, which the p95 at more pods never shows,
        break a count again at the same load. Levels (requests/s smoothed over the
        scale-down window), not windows, are compared: the minute that broke was a busy one, and
        a quiet one says nothing of the next. Requests, not replica-equivalents: a break revises
        the capacity a replica-equivalent stands for."""
        if proposal.load is None:
            return proposal
        c, cur = self.config, pool.current.replicas
        history = mem.key(name, REPLICAS)
        level = history.follow_load(now, proposal.load, c.scale_down_stabilization_s)
        if proposal.broke:
            history.broke(now, int(cur), level, c.break_memory_s)
        if proposal.held:
            history.held(now, int(cur), proposal.load, c.break_memory_s)
        proposal = self._below_projection_where_held(proposal, history, now, level)
        sized_for = level / (1.0 - c.headroom)
        binding = history.broken_within(now, c.break_memory_s, sized_for)
        if binding is None:
            return proposal
        when, pods, then = binding
        floor = min(pods + 1, int(cur))  # a break at today's count or more keeps today's: fewer break sooner
        if proposal.needed >= floor:
            return proposal
        why = (
            f"; {pods} pods fell short of the SLO {now - when:.0f} s ago at {then:.2f} requests/s, within the "
            f"{sized_for:.2f} today's {level:.2f} is sized for (headroom {c.headroom:g}) -> {floor}"
        )
        return replace(proposal, floor=float(floor), why=proposal.why + why)

    def _below_projection_where_held(
        self, proposal: Proposal, history: KeyHistory, now: float, level: float
    ) -> Proposal:
        """The latency projection's floor, lowered to the fewest pods (not below demand) at which the
        owned SLOs held, well within, over a window measured at that count, within
        ``break_memory_s`` and at a load level no lower than today's: evidence outweighs a
        projection. Also the floor that waits for the window to see the pods after a step down:
        a hold was measured at its own count, not read from a window that held more."""
        if proposal.floor is None or proposal.floor <= proposal.target:
            return proposal
        hold = history.held_within(now, self.config.break_memory_s, level, below=int(proposal.floor))
        if hold is None:
            return proposal
        when, pods, then = hold
        floor = max(float(pods), proposal.target)
        why = (
            f"; but {pods} pods held the SLOs {now - when:.0f} s ago at {then:.2f} requests/s, no less than "
            f"today's {level:.2f} -> {_num(floor)}"
        )
        return replace(proposal, floor=floor, why=proposal.why + why)

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
