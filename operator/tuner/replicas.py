"""The replica count a pool asks for: demand over measured per-replica capacity (capacity.py)
with headroom, the queue's growth and backlog, the forecast's rise, and the owned latencies
(latency_sizing.py) where demand misses them; with the limits no pod count passes (a prompt
whose own prefill outlasts TTFT's SLO, a lone decode step past ITL's) and HPA's ScalingLimited
reasons. Stabilization and the evidence of counts that broke or held come after (law.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

from llmfleet.operator.metrics.source import PoolMetrics
from llmfleet.operator.tuner.budget_rule import BudgetRule
from llmfleet.operator.tuner.capacity import CapacityEstimator, PerReplica
from llmfleet.operator.tuner.decision import (
    MAX_BATCH,
    OUT_OF_REACH,
    TOO_FEW,
    TOO_MANY,
    PoolInput,
    PoolSettings,
    ScalingLimit,
    SLOTargets,
    TunerConfig,
)
from llmfleet.operator.tuner.decision import num as _num
from llmfleet.operator.tuner.latency_sizing import LatencySizing
from llmfleet.operator.tuner.memory import Capacity, TunerMemory
from llmfleet.operator.tuner.proposal import (
    Moved,
    Proposal,
    exhausted_knobs,
    fmt_ms,
    owned_latency_ratio,
    protecting_knobs,
    spent,
)


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


class ReplicaRules:
    """The replica proposal per pool and run, as KnobRules (knobs.py) proposes the knobs."""

    def __init__(self, config: TunerConfig, estimator: CapacityEstimator) -> None:
        self.config = config
        self.estimator = estimator
        self.sizing = LatencySizing(config)
        self.budget_rule = BudgetRule(config)  # its drained-backlog test, the one that holds the budget

    def propose(
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
        a floor judged at an earlier, larger count must not hold the pool a window per step
        (Tuner._act takes the highest need judged at this count or fewer within the window)."""
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
            latency_ahead = self.sizing.ahead(name, pool, slo, units, outlook, capacity, seen)
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
            busy = self.sizing.busy_itl(name, m, slo, units, int(cur), capacity)
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
                needed = self.sizing.restoring(name, m, reachable, units, int(cur), pool.limits.max_replicas, capacity)
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
            floor, note = self.sizing.scale_down_floor(
                name, m, reachable, units, int(cur), raw, capacity, removed_since
            )
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
        cleared (budget_rule.py's test, the one that holds the token budget), or '': pods added now
        would serve none of those requests sooner. Not where ITL is over its SLO too."""
        m = pool.metrics
        if name != "prefill" and (m.judged_itl.p95 or 0.0) * 1000.0 > slo.itl_p95_ms:
            return ""
        return self.budget_rule.drained_backlog(pool, slo)

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

    def with_the_slots_coming(
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
        alt, units = self.propose(name, pool, slo, at_then, knobs, moved, requests_s)
        if alt.needed >= min(proposal[0].needed, pool.current.replicas):
            return proposal
        return replace(alt, slots=int(batch.target)), units

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
