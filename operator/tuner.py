"""The tuner's control law: metrics in, a decision out. Pure and deterministic (the clock is an
argument); the kopf timer, the simulator and the tests all call ``Tuner.decide`` the same way.

Per pool, every run (pools: ``colocated`` does everything; in disaggregated mode ``prefill``
owns TTFT and ``decode`` owns ITL):

- **Spec bounds win.** A current value outside its spec range (a manual edit, a narrowed spec)
  is first brought inside it. Nothing the tuner proposes ever leaves the range.
- **Stale or missing data holds everything.** If any pool's snapshot is stale (no pod
  reporting, samples too old, source down), nothing moves and ``hold_reason`` says why. A single
  quantile resting on too few requests holds only the knobs that read it.
- **maxBatchSize, AIMD against the ITL SLO** (colocated, decode). ITL p95 > SLO: multiplicative
  decrease, x0.75 of the batch that actually ran (``min(current, observed mean batch)``, as TCP
  decreases from the flight size), unless TTFT is over its SLO too with requests waiting: a
  smaller batch would only move the excess onto TTFT, so the batch holds and replicas come.
  ITL p95 < 0.8 SLO and the batch is the limit (mean batch >= 90% of the cap, or requests
  waiting): additive increase, +4; or, at a busy window's load, requests would wait for a slot
  (latency_projection.slots_for) with the pods there are, or with the fewest pods whose time
  would allow it (and whose KV caches would hold the sequences): straight to that many slots, in
  steps of 4, so that the scale-down can follow. Not while the KV cache is under pressure (usage
  >= 95% or preemptions), since a bigger batch would only preempt.
  **Slot-bound TTFT** (colocated): queue >= 50% of a TTFT p95 >= 0.5 SLO, ITL < 0.8 SLO, steps
  that leave the token budget unfilled and a cap the batch reaches at times (mean + 3 sd, the
  spread of an M/G/inf occupancy): prompts wait for a batch slot, so +4 at once (protective, no
  relaxation window) and the window's exhaustion does not add a replica this run.
- **batchTimeoutMs (the prefill coalescing window) against TTFT and queue time** (colocated,
  prefill). TTFT p95 > SLO, or queue time >= 50% of TTFT while TTFT >= 0.5 SLO: halve it (below
  1 ms: its minimum). TTFT p95 plus one step still < 0.5 SLO and ITL < 0.8 SLO: +5 ms (more
  coalescing), but only while prompts arrive often enough to coalesce (at least 0.2 more per
  pod expected within the window): a window that holds nothing back only adds latency. Short
  prompts (chat) make queueing the bulk of TTFT, so their window shrinks. A queue p95 above the
  TTFT p95 (possible only through coarse histogram buckets) is not read as a queue share.
- **maxNumBatchedTokens, the step's token budget** (colocated, prefill). ITL over SLO with
  prefill-heavy steps (tokens per step >= 2x running sequences): x0.75, never below the batch
  size, instead of shrinking the batch. TTFT over SLO while prefill-bound (queue < 50% of TTFT)
  with long prompts or full steps, and ITL to spare: x2. TTFT met but the tighter SLO (>= 0.5x,
  and above ITL's share), ITL < 0.8 SLO, and a budget that cannot take two mean prompts beside a
  full batch: x2 as a relaxing move, which undoes the cuts an ITL excess made once. Neither the
  batch nor the budget shrinks for ITL while TTFT is over its SLO too with requests waiting.
- **Replicas cover demand**: ``ceil(demand / (1 - headroom))`` replica-equivalents, where demand
  is prompt tokens/s over per-replica prefill capacity (prefill), generated tokens/s over
  per-replica decode capacity (decode), or both summed (colocated). The prefill:decode ratio
  follows from the two, as in NVIDIA Dynamo's planner. Where pods report step times, capacity
  comes from the step-time plane (step_model.py: overhead + per sequence + per prompt token,
  fitted online, the same at any knobs), projected at the batch cap and token budget this run
  leaves: decode steps of B sequences serve B / (overhead + per_seq x B) tok/s. A queue then
  proves nothing about capacity (a batching window or a batch cap makes one too). Elsewhere
  capacities start from a default guess and follow an EWMA of the observed throughput per
  replica whenever a pool is saturated (a queue of at least one request per pod); the first
  such measurement replaces the guess outright (a guess can be off several-fold), and only
  knobs that held through the window and will hold are measured. Either way a pool outrunning
  its estimate raises it at once; without step times, a pool that violates an owned SLO with
  its protecting knob at its limit is saturated for latency: its per-pod load becomes the
  estimate's upper bound at once (capacity at the SLO, which for short chat or long RAG prompts
  is well below raw throughput). Per-pod rates are only measured once
  the ready pod count has held for a whole metric window. Demand is
  served throughput, so a saturated pool (served/capacity ~ pods) still grows by the headroom;
  a queue that grows by g requests/s adds g requests/s of demand (arrivals above what is served),
  and the waiting requests' tokens count too, as demand to drain within ``backlog_drain_s`` (60).
  **Latency** sizes the pool too, judged over the SLO's window (``slo.windowSeconds``, the
  knobs react to the shorter metric window): an owned SLO violated there with its knob at its
  limit scales to the fewest pods its latency projects back within it, else one more (for ITL,
  only with a queue: otherwise more replicas would not help; not while another knob protects the
  same SLO this run). It aims at the SLO itself, not below it: the window that broke the SLO
  reads high, as the next minute's p95 regresses toward the mean. Pods the tuner added that
  became ready within the SLO's window have not shown in it yet: until they have, an excess
  under 1.2x adds none (in chat, 40 s after 4 -> 5, with the fifth pod ready for 10 s, the tuner
  went on to 7).
  A scale-down goes only as low as the owned latencies project within their SLOs at the load of
  a busy window (arrivals 2 sd above the mean: a count chosen at the mean holds through its
  surges), so a pool near its TTFT SLO keeps its pods even when throughput says fewer would do,
  and only as low as the busiest pod's KV usage, spread alike, stays under 95%. The projection
  (latency_projection.py) takes steps to lengthen with the share of a pod's time their work
  fills and adds the wait for a batch slot (Erlang C); without step times, M/M/1 on the demand.
  **Pods and slots are one decision**: where the batch cap's recommendation is above the cap
  (held by its relaxation window), the replica count is also judged at that cap, and a
  scale-down that needs it goes with it, raising the cap in the same run. Then
  ``[minReplicas, maxReplicas]``.
  A pool at zero replicas reports nothing, so it holds: keep ``minReplicas >= 1`` on tuned pools.
- **Stabilization, as HPA ``behavior``.** Every run records each quantity's recommendation. A
  move happens only if every recommendation of its window agrees (rise: the lowest, fall: the
  highest), and a non-zero window must be covered first. Replicas rise over
  ``scaleUpStabilizationSeconds`` and fall over ``scaleDownStabilizationSeconds``; the knobs'
  SLO-protecting moves (batch down, window down, budget either way) are immediate and their
  relaxing moves (batch up, window up, budget up with TTFT met) wait
  ``knob_relax_stabilization_s``.
- **Cooldown and anti-flapping.** A quantity that changed does not move again the same way for
  ``cooldown_s``, so the metric window sees the new setting first. It reverses direction at most
  once per ``flap_window_s`` (the scale-down stabilization window), unless the reversal protects
  an SLO that is at least ``override_ratio`` (1.2) times over (or, for replicas, demand 1.2x what
  the pool can serve); never for the token budget, whose two directions protect the two SLOs
  (their trading it back and forth is a lack of capacity). Spec-bound corrections count as moves
  for both.

Every change and every hold comes with a reason that cites its numbers, e.g.
``decode: ITL p95 142 ms > SLO 100 ms -> maxBatchSize 32 -> 24 (x0.75)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from .latency_projection import Projection, StepCosts, project, slots_for, surge, trusted_queue_s
from .metrics_source import PoolMetrics
from .tuner_memory import Capacity, DecisionRecord, KeyHistory, TunerMemory, stabilize
from .tuner_model import (
    INTEGER_KNOBS,
    KNOB_FIELDS,
    MAX_BATCH,
    POOL_KNOBS,
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
    SLOTargets,
    TunerConfig,
)
from .tuner_model import num as _num

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


@dataclass(frozen=True)
class Proposal:
    """One rule's recommendation for one quantity, before stabilization, cooldown and anti-flap."""

    target: float
    why: str  # the condition, with its numbers
    how: str = ""  # the step taken, e.g. "x0.75"
    protective: bool = False  # moves to protect an SLO (may override anti-flap when badly violated)
    severity: float = 0.0  # p95 / SLO (or demand / capacity) of what it protects
    exhausted: bool = False  # the SLO is violated and this knob is already at its limit
    protects: str = ""  # the SLO a protective or exhausted proposal is about: "ttft" or "itl"
    slots: int | None = None  # replicas: the batch cap a scale-down counts on, where above the current one


@dataclass(frozen=True)
class PerReplica:
    """Tokens/s one replica of a pool serves at given knobs, and how that was worked out."""

    prompt_tps: float
    generation_tps: float
    basis: str = ""  # the step plane at those knobs; empty for the stored estimate
    steps: StepCosts | None = None  # for the latency projection; None without step times or a batch cap

    def summary(self) -> dict[str, Any]:
        return {"promptTokensPerS": round(self.prompt_tps, 1), "generationTokensPerS": round(self.generation_tps, 1),
                **({"basis": self.basis} if self.basis else {})}  # fmt: skip


class Tuner:
    def __init__(self, config: TunerConfig | None = None) -> None:
        self.config = config or TunerConfig()

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
        for name in names:
            pool = PoolInput(pools[name].metrics, settings[name], pools[name].limits)
            proposals = self._knob_proposals(name, pool, slo, mem)
            capacity, measurable = self._update_capacity(name, pool, slo, mem, lines, proposals)
            for knob, proposal in proposals.items():
                settings[name] = self._act(name, knob, settings[name], proposal, mem, now, changes, lines)
            per_replica = self._per_replica(name, capacity, settings[name])  # at the knobs this run leaves
            # pods the tuner added, ready since: the SLO window has yet to see them (fewer pods, not)
            added_since = capacity.pods_since if mem.key(name, REPLICAS).last_direction > 0 else None
            replicas, units = self._replica_proposal(name, pool, slo, per_replica, proposals, added_since)
            replicas, units = self._with_the_slots_coming(name, pool, slo, capacity, settings[name], proposals,
                                                          mem, now, (replicas, units), added_since)  # fmt: skip
            if units is not None:
                demand[name] = units
            before = settings[name]
            settings[name] = self._act(name, REPLICAS, before, replicas, mem, now, changes, lines)
            settings[name] = self._slots_with_the_pods(name, before, settings[name], replicas, mem, now, changes, lines)
            if measurable:
                self._latency_saturation(name, pool, slo, capacity, proposals, lines)
            inputs[name]["capacity"] = per_replica.summary()
        if "prefill" in demand and "decode" in demand:
            lines.append(
                f"P:D demand {demand['prefill'][0]:.2f}:{demand['decode'][0]:.2f} replica-equivalents "
                f"({demand['prefill'][1]} vs {demand['decode'][1]}) -> "
                f"{settings['prefill'].replicas}:{settings['decode'].replicas} replicas"
            )
        return self._finish(now, changes, lines, False, "", settings, mem, inputs)

    # -- bounds ---------------------------------------------------------------------------------

    def _enforce_bounds(
        self, name: str, pool: PoolInput, mem: TunerMemory, now: float, changes: list[Change], lines: list[str]
    ) -> PoolSettings:
        current, limits = pool.current, pool.limits
        replicas = Range(limits.min_replicas, limits.max_replicas)
        checks = [(REPLICAS, replicas, "minReplicas/maxReplicas")]
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

    # -- knobs ----------------------------------------------------------------------------------

    def _knob_proposals(self, name: str, pool: PoolInput, slo: SLOTargets, mem: TunerMemory) -> dict[str, Proposal]:
        proposals: dict[str, Proposal] = {}
        for knob in POOL_KNOBS[name]:
            if knob not in pool.current.knobs:
                continue
            if knob == TOKEN_BUDGET:
                proposals[knob] = self._budget_rule(name, pool, slo)
            elif knob == MAX_BATCH:
                capacity = mem.capacity.get(name)
                steps = None if capacity is None else self._per_replica(name, capacity, pool.current).steps
                proposals[knob] = self._batch_rule(name, pool, slo, proposals.get(TOKEN_BUDGET), steps)
            else:
                proposals[knob] = self._timeout_rule(name, pool, slo)
        return proposals

    def _batch_rule(
        self, name: str, pool: PoolInput, slo: SLOTargets, budget: Proposal | None, steps: StepCosts | None
    ) -> Proposal:
        c, m = self.config, pool.metrics
        cur, allowed = pool.current.knobs[MAX_BATCH], pool.limits.knob(MAX_BATCH)
        itl, target_ms = _ms(m.itl.p95), slo.itl_p95_ms
        if itl is None:
            return Proposal(cur, f"ITL p95 unknown ({m.why_missing('itl')})")
        if itl > target_ms:
            why = f"ITL p95 {_fmt_ms(itl)} ms > SLO {_fmt_ms(target_ms)} ms"
            if budget is not None and budget.target < pool.current.knobs[TOKEN_BUDGET]:
                return Proposal(cur, f"{why}, but prefill chunks dominate the steps: {TOKEN_BUDGET} shrinks instead")
            crowded = self._ttft_over_with_a_queue(name, pool, slo)
            if crowded:
                return Proposal(cur, f"{why}, but {crowded}: a smaller batch would move the excess onto TTFT",
                                severity=itl / target_ms, exhausted=True, protects="itl")  # fmt: skip
            base = cur if m.mean_batch_size is None else min(cur, float(math.ceil(m.mean_batch_size)))
            new = allowed.clamp(math.floor(base * c.batch_decrease_factor))
            if new >= cur:
                return Proposal(cur, f"{why} with {MAX_BATCH} at its minimum {_num(allowed.low)}",
                                severity=itl / target_ms, exhausted=True, protects="itl")  # fmt: skip
            how = f"x{c.batch_decrease_factor:g}" + (f" of the observed batch {_num(base)}" if base < cur else "")
            return Proposal(new, why, how, protective=True, severity=itl / target_ms, protects="itl")
        slots = self._slot_bound_ttft(pool, slo, budget) if name == "colocated" else None
        if slots is not None:
            return slots
        if itl >= c.itl_low_water * target_ms:
            return Proposal(cur, f"ITL p95 {_fmt_ms(itl)} ms within {c.itl_low_water:g}-1x SLO {_fmt_ms(target_ms)} ms")
        why = f"ITL p95 {_fmt_ms(itl)} ms < {c.itl_low_water:g} x SLO {_fmt_ms(target_ms)} ms"
        if (m.kv_usage_max or 0.0) >= c.kv_pressure or (m.preemptions_per_s or 0.0) > 0:
            return Proposal(
                cur,
                f"{why}, but the KV cache is under pressure (max usage {_pct(m.kv_usage_max)}, "
                f"{m.preemptions_per_s or 0:.2f} preemptions/s)",
            )
        pods = max(m.ready_pods or 1, 1)
        full = m.mean_batch_size is not None and m.mean_batch_size >= c.batch_full_fraction * cur
        queued = m.waiting is not None and m.waiting / pods >= c.queue_per_pod
        # Slots a busy window would fill, with these pods or the fewest their time allows, cost
        # TTFT or keep the pods (the scale-down's projection counts the wait for a slot).
        slots, pods_then = self._slots_needed(name, pool, slo, steps)
        if not (full or queued or slots):
            return Proposal(
                cur,
                f"{why}, but the batch is not the limit (mean batch {_opt(m.mean_batch_size)} of {_num(cur)}, "
                f"{_opt(None if m.waiting is None else m.waiting / pods)} waiting per pod)",
            )
        step = c.batch_increase_step
        if not (full or queued):  # straight to the slots needed, in whole steps
            step *= max(1, math.ceil((slots - cur) / c.batch_increase_step))
        new = allowed.clamp(cur + step)
        if new <= cur:
            return Proposal(cur, f"{why} with {MAX_BATCH} at its maximum {_num(allowed.high)}")
        if full:
            evidence = f"the batch is full (mean {m.mean_batch_size:.1f} of {_num(cur)})"
        elif queued:
            evidence = f"{m.waiting / pods:.1f} requests wait per pod"  # type: ignore[operator]
        else:
            evidence = f"at a busy window's load {pods_then} would need {slots} slots for a request to rarely wait"
        return Proposal(new, f"{why} and {evidence}", f"+{_num(new - cur)}")

    def _ttft_over_with_a_queue(self, name: str, pool: PoolInput, slo: SLOTargets) -> str:
        """Why a colocated pool's ITL excess is no reason to shrink a knob (TTFT over its SLO as
        well, with requests waiting: the pool lacks capacity, which only replicas add), or ''."""
        m = pool.metrics
        ttft, pods = _ms(m.ttft.p95), max(m.ready_pods or 1, 1)
        if name != "colocated" or ttft is None or ttft <= slo.ttft_p95_ms:
            return ""
        waiting = (m.waiting or 0.0) / pods
        if waiting < self.config.queue_per_pod:
            return ""
        return f"TTFT p95 {_fmt_ms(ttft)} ms is over its SLO too with {waiting:.1f} requests waiting per pod"

    def _slots_needed(self, name: str, pool: PoolInput, slo: SLOTargets, steps: StepCosts | None) -> tuple[int, str]:
        """The batch slots that keep a request's wait for one rare at the load of a busy window
        (latency_projection.slots_for), with the pods there are or with the fewest pods whose time
        would allow it (the latency projects within the SLOs with slots to spare, and the KV cache
        holds the sequences); when that is more than the cap: (slots, for what), else (0, '').
        Pods and slots are one decision: a scale-down projected at today's cap would find the
        slots short and keep pods that a bigger cap lets go, and a cap does not cost anything
        until it binds."""
        c, m, cur = self.config, pool.metrics, pool.current.knobs[MAX_BATCH]
        pods = m.ready_pods or 0
        if steps is None or pods <= 0 or pods != pool.current.replicas:
            return 0, ""
        busy = self._surge(m)
        unbounded = replace(steps, slots=None)
        candidates = [(busy, f"its {pods} pods")]
        for n in range(pods - 1, max(pool.limits.min_replicas, 1) - 1, -1):
            k = pods / n * busy
            if (m.kv_usage_max or 0.0) * k >= c.kv_pressure:
                break
            if project(name, m, slo.ttft_p95_ms, slo.itl_p95_ms, 0.0, k, unbounded).ratio > c.projected_latency_limit:
                break
            candidates.append((k, f"{n} pods"))
        needed, what = max(((slots_for(m, steps, k) or 0), what) for k, what in candidates)
        return (needed, what) if needed > cur else (0, "")

    def _slot_bound_ttft(self, pool: PoolInput, slo: SLOTargets, budget: Proposal | None) -> Proposal | None:
        """TTFT spent queueing for a batch slot while ITL has room: a bigger batch protects TTFT
        (immediately, like the window's shrink), before any replica is added. Requests wait for
        admission when every slot is taken or the step's token budget is spent; steps that do not
        fill the budget leave the slots as the limit. None when this does not apply."""
        c, m = self.config, pool.metrics
        cur, allowed = pool.current.knobs[MAX_BATCH], pool.limits.knob(MAX_BATCH)
        ttft, queue, itl = _ms(m.ttft.p95), _queue_ms(m), _ms(m.itl.p95)
        if ttft is None or queue is None or itl is None or ttft <= 0:
            return None
        target_ms = slo.ttft_p95_ms
        if queue / ttft < c.queue_dominant_fraction or ttft < c.ttft_low_water * target_ms:
            return None
        if itl >= c.itl_low_water * slo.itl_p95_ms:
            return None  # no ITL to spend on a bigger batch
        if (m.kv_usage_max or 0.0) >= c.kv_pressure or (m.preemptions_per_s or 0.0) > 0:
            return None
        budget_now = pool.current.knobs.get(TOKEN_BUDGET)
        steps = m.mean_step_tokens
        if budget is not None and budget.target != budget_now:
            return None  # the token budget moves this run: one lever at a time
        if budget_now is not None and (steps is None or steps >= c.batch_full_fraction * budget_now):
            return None  # the budget, not the slots, may be what holds prompts back
        running = m.mean_batch_size
        if running is None or _cap_out_of_reach(running, cur):
            return None  # the cap is (almost) never reached: slots are not what requests wait for
        new = allowed.clamp(cur + c.batch_increase_step)
        if new <= cur:
            return None
        why = (
            f"queue p95 {_fmt_ms(queue)} ms is {queue / ttft:.0%} of TTFT p95 {_fmt_ms(ttft)} ms "
            f"(>= {c.ttft_low_water:g} x SLO {_fmt_ms(target_ms)} ms) with ITL p95 {_fmt_ms(itl)} ms "
            f"< {c.itl_low_water:g} x SLO {_fmt_ms(slo.itl_p95_ms)} ms"
            + f", mean batch {running:.1f} of {_num(cur)} (+3 sd reaches it)"
            + ("" if steps is None else f" and steps under the budget ({steps:.0f} tokens)")
            + ": prompts wait for a batch slot"
        )
        return Proposal(new, why, f"+{_num(new - cur)}", protective=True, severity=ttft / target_ms, protects="ttft")

    def _exhausted(self, pool: PoolInput, knobs: Mapping[str, Proposal]) -> list[str]:
        """Knobs that cannot restore a violated SLO (at their limit, or short of the excess) that no
        other knob is protecting this run."""
        moving = {
            p.protects
            for k, p in knobs.items()
            if p.protective and not p.exhausted and p.target != pool.current.value(k)
        }
        return [k for k, p in knobs.items() if p.exhausted and p.protects not in moving]

    def _timeout_rule(self, name: str, pool: PoolInput, slo: SLOTargets) -> Proposal:
        c, m = self.config, pool.metrics
        cur, allowed = pool.current.knobs[TIMEOUT], pool.limits.knob(TIMEOUT)
        ttft, target_ms = _ms(m.ttft.p95), slo.ttft_p95_ms
        if ttft is None:
            return Proposal(cur, f"TTFT p95 unknown ({m.why_missing('ttft')})")
        queue = _queue_ms(m)
        share = queue / ttft if queue is not None and ttft > 0 else None
        over = ttft > target_ms
        queue_bound = share is not None and share >= c.queue_dominant_fraction and ttft >= c.ttft_low_water * target_ms
        if over or queue_bound:
            why = (
                f"TTFT p95 {_fmt_ms(ttft)} ms > SLO {_fmt_ms(target_ms)} ms"
                if over
                else f"queue p95 {_fmt_ms(queue)} ms is {share:.0%} of TTFT p95 {_fmt_ms(ttft)} ms "  # type: ignore[arg-type]
                f"(>= {c.ttft_low_water:g} x SLO {_fmt_ms(target_ms)} ms)"
            )
            shrunk = cur * c.timeout_shrink_factor
            new = allowed.clamp(allowed.low if shrunk < c.timeout_snap_ms else round(shrunk, 1))
            if new >= cur:
                return Proposal(cur, f"{why} with {TIMEOUT} at its minimum {_num(allowed.low)}",
                                severity=ttft / target_ms, exhausted=over, protects="ttft")  # fmt: skip
            # A window adds at most its length to a TTFT: when the excess is longer, shrinking it
            # helps but cannot restore the SLO alone, so it does not stand in for replicas.
            short = over and cur < ttft - target_ms
            if short:
                why += f", more than the whole {_num(cur)} ms window"
            return Proposal(new, why, f"x{c.timeout_shrink_factor:g}", protective=True, severity=ttft / target_ms,
                            exhausted=short, protects="ttft")  # fmt: skip
        step = c.timeout_step_ms
        if ttft + step >= c.ttft_low_water * target_ms:
            return Proposal(
                cur,
                f"TTFT p95 {_fmt_ms(ttft)} ms leaves no room for +{_num(step)} ms under "
                f"{c.ttft_low_water:g} x SLO {_fmt_ms(target_ms)} ms",
            )
        why = f"TTFT p95 {_fmt_ms(ttft)} ms + {_num(step)} ms < {c.ttft_low_water:g} x SLO {_fmt_ms(target_ms)} ms"
        if name != "prefill":  # a prefill pool has no ITL of its own
            itl = _ms(m.itl.p95)
            if itl is None or itl >= c.itl_low_water * slo.itl_p95_ms:
                shown = "unknown" if itl is None else f"{_fmt_ms(itl)} ms"
                return Proposal(
                    cur, f"{why}, but ITL p95 {shown} is not < {c.itl_low_water:g} x SLO {_fmt_ms(slo.itl_p95_ms)} ms"
                )
            why += f" and ITL p95 {_fmt_ms(itl)} ms < {c.itl_low_water:g} x SLO {_fmt_ms(slo.itl_p95_ms)} ms"
        pods = max(m.ready_pods or 1, 1)
        expected = None if m.request_rate is None else m.request_rate / pods * (cur + step) / 1000.0
        if expected is None or expected < c.window_coalesce_min:
            shown = "unknown" if expected is None else f"{expected:.2f}"
            return Proposal(
                cur,
                f"{why}, but a {_num(round(cur + step, 1))} ms window would coalesce {shown} more prompts per pod "
                f"(< {c.window_coalesce_min:g}): it would only add latency",
            )
        new = allowed.clamp(round(cur + step, 1))
        if new <= cur:
            return Proposal(cur, f"{why} with {TIMEOUT} at its maximum {_num(allowed.high)}")
        return Proposal(new, why, f"+{_num(round(new - cur, 1))} ms")

    def _budget_rule(self, name: str, pool: PoolInput, slo: SLOTargets) -> Proposal:
        c, m = self.config, pool.metrics
        cur, allowed = pool.current.knobs[TOKEN_BUDGET], pool.limits.knob(TOKEN_BUDGET)
        ttft, itl = _ms(m.ttft.p95), _ms(m.itl.p95) if name != "prefill" else None
        steps, batch = m.mean_step_tokens, m.mean_batch_size
        if itl is not None and itl > slo.itl_p95_ms and steps and batch and steps >= c.prefill_heavy_ratio * batch:
            why = (
                f"ITL p95 {_fmt_ms(itl)} ms > SLO {_fmt_ms(slo.itl_p95_ms)} ms with prefill-heavy steps "
                f"({steps:.0f} tokens per step for {batch:.1f} sequences)"
            )
            crowded = self._ttft_over_with_a_queue(name, pool, slo)
            if crowded:
                return Proposal(cur, f"{why}, but {crowded}: a smaller budget would move the excess onto TTFT")
            floor_ = allowed.clamp(max(allowed.low, pool.current.knobs.get(MAX_BATCH, allowed.low)))
            new = max(floor_, allowed.clamp(math.floor(cur * c.budget_decrease_factor)))
            if new >= cur:
                return Proposal(cur, f"{why} with {TOKEN_BUDGET} at its floor {_num(floor_)}")
            return Proposal(new, why, f"x{c.budget_decrease_factor:g}", protective=True,
                            severity=itl / slo.itl_p95_ms, protects="itl")  # fmt: skip
        if ttft is None:
            return Proposal(cur, f"TTFT p95 unknown ({m.why_missing('ttft')})")
        if ttft <= slo.ttft_p95_ms:
            held = Proposal(cur, f"TTFT p95 {_fmt_ms(ttft)} ms <= SLO {_fmt_ms(slo.ttft_p95_ms)} ms")
            return self._budget_relaxation(name, pool, slo, ttft, itl) or held
        why = f"TTFT p95 {_fmt_ms(ttft)} ms > SLO {_fmt_ms(slo.ttft_p95_ms)} ms"
        queue = _queue_ms(m)
        prompt = m.mean_prompt_tokens()
        # A prompt longer than the budget takes several steps; steps that fill the budget leave the
        # next prompts waiting for one; and where prompts queue while neither the window nor the
        # slots hold them back, a budget too small for two prompts beside a full batch makes the
        # second of two arrivals wait a step. A queue in front of a small budget is the budget's
        # doing, so it does not rule the budget out.
        pair = None if prompt is None else 2 * prompt + pool.current.knobs.get(MAX_BATCH, 0.0)
        if prompt is not None and prompt > cur:
            evidence = f"mean prompt {prompt:.0f} tokens > budget {_num(cur)}"
        elif steps is not None and steps >= 0.9 * cur:
            evidence = f"steps fill the budget ({steps:.0f} of {_num(cur)} tokens)"
        elif (
            pair is not None
            and pair > cur
            and queue is not None
            and queue >= c.queue_dominant_fraction * ttft
            and self._window_and_slots_clear(pool)
        ):
            evidence = (
                f"prompts queue (queue p95 {_fmt_ms(queue)} ms) with {TIMEOUT} at its minimum and batch slots "
                f"free, and two mean prompts and a full batch ({pair:.0f} tokens) overflow the budget"
            )
        else:
            return Proposal(cur, f"{why}, but prompts fit the budget (mean prompt {_opt(prompt)} tokens, "
                                 f"queue p95 {_opt(queue)} ms)")  # fmt: skip
        if itl is not None and itl >= c.itl_low_water * slo.itl_p95_ms:
            return Proposal(cur, f"{why} and {evidence}, but ITL p95 {_fmt_ms(itl)} ms has no room")
        if name != "prefill" and itl is None:
            return Proposal(cur, f"{why} and {evidence}, but ITL p95 is unknown ({m.why_missing('itl')})")
        new = allowed.clamp(math.floor(cur * c.budget_increase_factor))
        if new <= cur:
            return Proposal(cur, f"{why} and {evidence} with {TOKEN_BUDGET} at its maximum {_num(allowed.high)}")
        return Proposal(
            new,
            f"{why} and {evidence}",
            f"x{c.budget_increase_factor:g}",
            protective=True,
            severity=ttft / slo.ttft_p95_ms,
            protects="ttft",
        )

    def _budget_relaxation(
        self, name: str, pool: PoolInput, slo: SLOTargets, ttft: float, itl: float | None
    ) -> Proposal | None:
        """x2 (a relaxing move: it waits its stabilization window) while TTFT is met but is the
        tighter SLO, ITL has room, and the budget cannot take two mean prompts beside a full
        batch: a prompt that does not fit waits a whole step, which a short-prompt TTFT feels. It
        undoes the cuts an ITL excess made once (a cold start's queue, say) when ITL no longer
        needs them, so the pool need not buy the TTFT back with replicas. None otherwise."""
        c, m = self.config, pool.metrics
        cur, allowed = pool.current.knobs[TOKEN_BUDGET], pool.limits.knob(TOKEN_BUDGET)
        prompt = m.mean_prompt_tokens()
        tight = ttft / slo.ttft_p95_ms
        if prompt is None or tight < c.ttft_low_water:
            return None
        if name != "prefill" and (itl is None or itl >= c.itl_low_water * slo.itl_p95_ms or
                                  itl / slo.itl_p95_ms > tight):  # fmt: skip
            return None
        pair = 2 * prompt + pool.current.knobs.get(MAX_BATCH, 0.0)
        new = allowed.clamp(math.floor(cur * c.budget_increase_factor))
        if pair <= cur or new <= cur:
            return None
        room = "" if itl is None else f", ITL p95 {_fmt_ms(itl)} ms has room"
        why = (f"TTFT p95 {_fmt_ms(ttft)} ms is {tight:.0%} of its SLO{room}, and two mean prompts and a full batch "
               f"({pair:.0f} tokens) overflow the budget")  # fmt: skip
        return Proposal(new, why, f"x{c.budget_increase_factor:g}")

    def _window_and_slots_clear(self, pool: PoolInput) -> bool:
        """The batching window is at its minimum and the batch cap is out of reach (the mean
        batch + 3 sd under it): neither holds a waiting prompt back."""
        cur = pool.current.knobs
        window_low = TIMEOUT not in cur or cur[TIMEOUT] <= pool.limits.knob(TIMEOUT).low
        running = pool.metrics.mean_batch_size
        slots_free = MAX_BATCH not in cur or (running is not None and _cap_out_of_reach(running, cur[MAX_BATCH]))
        return window_low and slots_free

    # -- replicas -------------------------------------------------------------------------------

    def _replica_proposal(
        self,
        name: str,
        pool: PoolInput,
        slo: SLOTargets,
        capacity: PerReplica,
        knobs: Mapping[str, Proposal],
        added_since: float | None,
    ) -> tuple[Proposal, tuple[float, str] | None]:
        c, m, cur = self.config, pool.metrics, float(pool.current.replicas)
        parts: list[tuple[float | None, float, str]] = []
        if name in ("colocated", "prefill"):
            parts.append((m.prompt_tokens_per_s, capacity.prompt_tps, "prompt"))
        if name in ("colocated", "decode"):
            parts.append((m.generation_tokens_per_s, capacity.generation_tps, "generation"))
        unknown = [label for rate, _, label in parts if rate is None]
        if unknown:
            fields = {"prompt": "prompt_tokens_per_s", "generation": "generation_tokens_per_s"}
            why = "; ".join(m.why_missing(fields[label]) for label in unknown)
            return Proposal(cur, f"demand unknown ({why})"), None
        units = sum(rate / cap for rate, cap, _ in parts)  # type: ignore[operator]
        detail = " + ".join(f"{label} {rate:.0f} tok/s / {cap:.0f} per replica" for rate, cap, label in parts)
        for extra in (self._growth_units(m, parts), self._backlog_units(m, parts)):
            if extra is not None:
                units += extra[0]
                detail += f" + {extra[1]}"
        if capacity.basis:
            detail += f"; per replica {capacity.basis}"
        if not math.isfinite(units):  # e.g. a near-zero request rate under a queue: no usable estimate
            return Proposal(cur, f"demand not finite ({detail}): replicas hold"), None
        raw = math.ceil(units / (1.0 - c.headroom) - 1e-9)
        why = f"demand {units:.2f} replicas ({detail}) / (1 - headroom {c.headroom:g}) = {raw}"

        latency = self._owned_latency_ratio(name, m, slo)
        judged_s = m.slo_window_s or m.window_s
        exhausted = self._exhausted(pool, knobs)
        if exhausted:
            pods = m.ready_pods or 0
            waiting = (m.waiting or 0.0) / max(pods, 1)
            itl_only = all(k == MAX_BATCH for k in exhausted)
            if pods < cur:
                why += (
                    f"; SLO violated with {self._spent(pool, knobs, exhausted)}, but {pods} of {_num(cur)} pods ready"
                )
            elif m.slo_window_s and latency <= 1.0:
                why += (f"; SLO violated over {m.window_s:.0f} s with {self._spent(pool, knobs, exhausted)}, but met "
                        f"over its {m.slo_window_s:.0f} s window ({latency:.2f}x): no replica for that")  # fmt: skip
            elif latency < c.override_ratio and added_since is not None and m.at - added_since < judged_s:
                why += (f"; SLO violated with {self._spent(pool, knobs, exhausted)} ({latency:.2f}x), but {pods} pods "
                        f"are ready only {m.at - added_since:.0f} s and the {judged_s:.0f} s window still holds the "
                        "time before: no replica for that yet")  # fmt: skip
            elif itl_only and waiting < c.queue_per_pod:
                why += (f"; ITL over SLO at the minimum {MAX_BATCH} with no queue ({waiting:.1f} waiting per pod):"
                        " more replicas would not lower it")  # fmt: skip
            else:
                spent = self._spent(pool, knobs, exhausted)
                needed = self._latency_replicas(name, m, slo, units, int(cur), pool.limits.max_replicas, capacity)
                if needed is not None and needed > max(raw, cur):
                    raw = needed
                    why += f"; SLO violated with {spent} -> {needed}, where the owned latency projects within it"
                elif raw <= cur:
                    raw = int(cur) + 1
                    why += f"; SLO violated with {spent} -> one more replica"
        if raw < cur:
            raw, note = self._projected_scale_down(name, m, slo, units, int(cur), raw, capacity)
            why += note
        target = pool.limits.min_replicas if raw < pool.limits.min_replicas else raw
        target = min(target, pool.limits.max_replicas)
        if target != raw:
            why += f", within [{pool.limits.min_replicas}, {pool.limits.max_replicas}] -> {target}"
        over = units / cur if cur > 0 else math.inf
        proposal = Proposal(float(target), why, protective=target > cur, severity=max(latency, over))
        return proposal, (units, detail)

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
        added_since: float | None,
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
        at_then = self._per_replica(name, capacity, then)
        alt, units = self._replica_proposal(name, pool, slo, at_then, knobs, added_since)
        if alt.target >= min(proposal[0].target, pool.current.replicas):
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
        self, name: str, m: PoolMetrics, slo: SLOTargets, units: float, cur: int, target: int, capacity: PerReplica
    ) -> tuple[int, str]:
        """The fewest replicas, from ``target`` up to ``cur``, at which the owned latencies are
        projected (latency_projection.py) within ``projected_latency_limit`` of their SLOs, and a
        note when that is more. Capacity estimated from throughput says nothing about latency (a
        pod can be well under its token throughput and still break a TTFT SLO): this asks the
        latency measured now whether fewer pods would hold. Nor does it say whether their
        sequences fit the fewer pods' KV caches: the busiest pod's usage, spread alike, must stay
        under ``kv_pressure``, or the scale-down would only preempt."""
        ratio = self._owned_latency_ratio(name, m, slo)
        pods = m.ready_pods or 0
        if ratio <= 0 or pods != cur or units <= 0:
            return target, ""  # nothing measured, the pods measured are not the pods counted, or no demand
        c = self.config
        lowest, note = max(target, 1), ""  # a demand that rounds to zero replicas is judged at one
        kv = (m.kv_usage_max or 0.0) * cur * self._surge(m)  # the busiest pod's KV usage, in pods' worth
        kv_floor = math.floor(kv / c.kv_pressure) + 1
        if lowest < kv_floor:
            lowest = target = min(kv_floor, cur)
            note = f"; the KV cache would run {kv / max(target - 1, 1):.0%} full with fewer than {target} -> {target}"
            if lowest >= cur:
                return cur, note
        projected = self._project(name, m, slo, units, cur, lowest, capacity)
        if projected.ratio <= c.projected_latency_limit:
            return target, note
        fewer = range(lowest + 1, cur)
        n = next((n for n in fewer if self._project(name, m, slo, units, cur, n, capacity).ratio
                  <= c.projected_latency_limit), cur)  # fmt: skip
        slots = None if capacity.steps is None else capacity.steps.slots
        at = f"at {lowest}" + ("" if slots is None else f" with {MAX_BATCH} {slots}")
        return n, note + (
            f"; {at} the owned latency is projected at {projected.ratio:.2f}x its SLO ({projected.how}; now "
            f"{ratio:.2f}x, utilization {units / cur:.2f} -> {units / lowest:.2f}; > {c.projected_latency_limit:g})"
            f" -> {n}"
        )

    def _latency_replicas(
        self, name: str, m: PoolMetrics, slo: SLOTargets, units: float, cur: int, most: int, capacity: PerReplica
    ) -> int | None:
        """The fewest replicas above ``cur`` (up to ``most``) at which the owned latencies, over
        their SLOs now, are projected back within them (``scale_up_latency_limit``); None when
        none is (a prefill that alone takes longer than the SLO is not helped by pods) or nothing
        says how loaded the pods are."""
        if units <= 0 or cur <= 0 or (m.ready_pods or 0) != cur:
            return None
        limit = self.config.scale_up_latency_limit
        return next((n for n in range(cur + 1, most + 1)
                     if self._project(name, m, slo, units, cur, n, capacity, busy=False).ratio <= limit),
                    None)  # fmt: skip

    def _project(
        self,
        name: str,
        m: PoolMetrics,
        slo: SLOTargets,
        units: float,
        cur: int,
        n: int,
        capacity: PerReplica,
        busy: bool = True,
    ) -> Projection:
        """The owned latencies at ``n`` pods. A scale-down is judged at the load of a busy window
        (``busy``), so that a count chosen at the mean holds through its surges; a scale-up for an
        SLO broken now is not: the window that broke it already carries its surge."""
        k = cur / n * (self._surge(m) if busy else 1.0)
        return project(name, m, slo.ttft_p95_ms, slo.itl_p95_ms, units / cur, k, capacity.steps)

    def _surge(self, m: PoolMetrics) -> float:
        """The load factor of a busy window as long as the one the latencies are judged over."""
        return surge(m.request_rate, m.slo_window_s or m.latency_window_s or m.window_s, self.config.surge_sd)

    @staticmethod
    def _spent(pool: PoolInput, knobs: Mapping[str, Proposal], exhausted: list[str]) -> str:
        """'batchTimeoutMs at its limit' or '... short of the excess', for each knob that cannot
        restore its SLO."""
        return ", ".join(
            f"{k} at its limit" if knobs[k].target == pool.current.value(k) else f"{k} short of the excess"
            for k in exhausted
        )

    def _growth_units(self, m: PoolMetrics, parts: list[tuple[float | None, float, str]]) -> tuple[float, str] | None:
        """Replica-equivalents of the arrivals the pool is not keeping up with: served throughput
        stops growing once a pool saturates, while a queue that grows by g requests/s says the
        arrival rate is g above it. Counting them scales a step up in one move, before the
        backlog they build gets long (a pod takes a while to start). Only a queue that grew by at
        least one request over the window counts; smaller slopes are noise."""
        growth = m.waiting_growth_per_s
        if growth is None or growth * m.window_s < 1.0 or not m.request_rate:
            return None
        per_request = {"prompt": m.prompt_tokens_per_s, "generation": m.generation_tokens_per_s}
        units = sum(growth * (per_request[label] or 0.0) / m.request_rate / cap for _, cap, label in parts)
        return units, f"queue growing {growth:.2f} req/s = {units:.2f}"

    def _backlog_units(self, m: PoolMetrics, parts: list[tuple[float | None, float, str]]) -> tuple[float, str] | None:
        """Replica-equivalents to drain the queue within ``backlog_drain_s``: served throughput
        under-counts demand once requests wait, so the waiting requests' tokens are added."""
        c = self.config
        if not m.waiting or m.waiting < 1 or not m.request_rate:
            return None
        per_request = {"prompt": m.prompt_tokens_per_s, "generation": m.generation_tokens_per_s}
        units = 0.0
        for _, cap, label in parts:
            tokens = per_request[label]
            if tokens is not None:
                units += m.waiting * (tokens / m.request_rate) / cap / c.backlog_drain_s
        return units, f"backlog {m.waiting:.0f} waiting drained in {c.backlog_drain_s:.0f} s = {units:.2f}"

    def _owned_latency_ratio(self, name: str, m: PoolMetrics, slo: SLOTargets) -> float:
        """The owned latencies over their SLOs, as judged over the SLO's window (replicas follow
        these; the knobs react to the shorter metric window)."""
        ratios = [0.0]
        ttft, itl = m.judged_ttft.p95, m.judged_itl.p95
        if name in ("colocated", "prefill") and ttft is not None:
            ratios.append(ttft * 1000.0 / slo.ttft_p95_ms)
        if name in ("colocated", "decode") and itl is not None:
            ratios.append(itl * 1000.0 / slo.itl_p95_ms)
        return max(ratios)

    def _update_capacity(
        self,
        name: str,
        pool: PoolInput,
        slo: SLOTargets,
        mem: TunerMemory,
        lines: list[str],
        knobs: Mapping[str, Proposal],
    ) -> tuple[Capacity, bool]:
        """Per-replica throughput: EWMA of what a saturated pool does; an unsaturated pool that
        already outruns the estimate raises it at once (its throughput is a lower bound).

        Per-pod rates are the window's throughput over the pods ready now, so they are only
        measured once the ready count has held for a whole window: right after a new pod joins
        they would under-count (the window's tokens came from fewer pods), right after one left,
        over-count. Returns the capacity and whether this snapshot could measure it."""
        c, m = self.config, pool.metrics
        capacity = mem.capacity.setdefault(name, Capacity(prompt_tps=c.prefill_capacity_tps,
                                                          generation_tps=c.decode_capacity_tps))  # fmt: skip
        pods = m.ready_pods or 0
        if pods <= 0 or (capacity.updated_at is not None and m.at <= capacity.updated_at):
            return capacity, False
        step = (m.mean_batch_size, m.mean_step_tokens, m.mean_step_seconds)
        if all(v is not None for v in step):  # the plane is knob-free: every window counts
            capacity.steps.observe(m.at, *step)  # type: ignore[arg-type]
        if capacity.pods != pods:  # a fresh memory (pods None) assumes the count it first sees has held
            capacity.pods_since = m.at if capacity.pods is not None else None
            capacity.pods = pods
        held = math.inf if capacity.pods_since is None else m.at - capacity.pods_since
        if held < m.window_s:
            capacity.updated_at = m.at
            lines.append(
                f"{name}: per-replica capacity not measured: {pods} ready pods for {held:.0f} s "
                f"(< the {m.window_s:.0f} s window)"
            )
            return capacity, False
        saturated = self._saturation(name, pool)
        if saturated:
            # A queue can come from a batching window or a batch cap as much as from a pod at its
            # limit: with step times the plane says what a replica serves at the knobs, and a
            # saturated window's throughput only counts as a lower bound, as it does when the
            # window mixes knobs or this run raises them.
            plane = "the step plane gives it" if capacity.steps.points else ""
            past = plane or self._knobs_of_the_past(name, pool, mem, knobs)
            if past:
                lines.append(f"{name}: {saturated}, but not the pool's capacity: {past}")
                saturated = ""  # still a lower bound: an estimate below the throughput rises to it
        prompt = None if m.prompt_tokens_per_s is None else m.prompt_tokens_per_s / pods
        generation = None if m.generation_tokens_per_s is None else m.generation_tokens_per_s / pods
        before = self._per_replica(name, capacity, pool.current)  # at the knobs the window ran
        # The first saturated measurement replaces the default guess outright: an EWMA from a
        # guess that may be off several-fold would keep the guess's error for many runs.
        weight = c.capacity_ewma if capacity.measured else 1.0
        if name == "colocated":
            if prompt is None or generation is None or prompt + generation <= 0:
                return capacity, True
            load = prompt / before.prompt_tps + generation / before.generation_tps  # replicas busy, each
            factor = (1 - weight) + weight * load if saturated else max(load, 1.0)
        else:
            observed = prompt if name == "prefill" else generation
            old = before.prompt_tps if name == "prefill" else before.generation_tps
            if observed is None or observed <= 0:
                return capacity, True
            factor = ((1 - weight) * old + weight * observed if saturated else max(old, observed)) / old
        recovered = ""
        ratio = self._owned_latency_ratio(name, m, slo)
        cut = not saturated and factor <= 1.0 and bool(capacity.steps.points) and capacity.scale < 1.0
        if cut and 0.0 < ratio < c.latency_margin:
            # A capacity cut to the load that once broke an SLO (saturated for latency) would hold
            # the pods it added for good; with the SLOs met by a margin it relaxes towards the step
            # plane, and the projection in scale-down guards the way back.
            factor = 1.0 + c.capacity_ewma * (1.0 / capacity.scale - 1.0)
            recovered = f"owned latency {ratio:.2f}x its SLO (< {c.latency_margin:g}): back towards the step plane"
        self._rescale(name, capacity, factor)
        if saturated and not capacity.measured:
            capacity.measured = True
            saturated += " (first measurement: replaces the default guess)"
        capacity.updated_at = m.at
        after = self._per_replica(name, capacity, pool.current)
        if (after.prompt_tps, after.generation_tps) != (before.prompt_tps, before.generation_tps):
            capacity.observations += 1
            why = saturated or recovered or "throughput above the estimate"
            lines.append(f"{name}: per-replica capacity {self._moved(name, before, after)} ({why})")
        return capacity, True

    def _per_replica(self, name: str, capacity: Capacity, settings: PoolSettings) -> PerReplica:
        """Tokens/s one replica serves at ``settings``' knobs: the step plane's throughput at the
        batch cap (generation) and the token budget (prompts), times the measured scale; the
        stored estimate where no step times were reported."""
        c = self.config
        plane = capacity.steps.plane(c.step_overhead_seqs, c.step_prompt_token_share)
        if plane is None:
            return PerReplica(capacity.prompt_tps, capacity.generation_tps)
        batch, budget = settings.knobs.get(MAX_BATCH), settings.knobs.get(TOKEN_BUDGET)
        prompt = capacity.prompt_tps if budget is None else plane.prompt_tokens_per_s(budget) * capacity.scale
        generation = capacity.generation_tps if batch is None else plane.decode_tokens_per_s(batch) * capacity.scale
        at = ", ".join(f"{knob} {_num(v)}" for knob, v in ((MAX_BATCH, batch), (TOKEN_BUDGET, budget)) if v is not None)
        scaled = "" if capacity.scale == 1.0 else f" x{capacity.scale:.2f} measured"
        slots = None if batch is None else int(batch)
        costs = StepCosts(plane.per_seq_s / capacity.scale, plane.per_prompt_token_s / capacity.scale, slots, budget)
        return PerReplica(prompt, generation, f"at {at}: {plane.describe()}{scaled}", costs)

    def _rescale(self, name: str, capacity: Capacity, factor: float) -> None:
        """Multiply what one replica serves by ``factor``: the step plane's scale, or the estimate."""
        c = self.config
        if capacity.steps.points:
            capacity.scale = min(max(capacity.scale * factor, 0.1), 10.0)
            return
        if name != "decode":
            capacity.prompt_tps = min(max(capacity.prompt_tps * factor, c.prefill_capacity_tps / 100),
                                      c.prefill_capacity_tps * 100)  # fmt: skip
        if name != "prefill":
            capacity.generation_tps = min(max(capacity.generation_tps * factor, c.decode_capacity_tps / 100),
                                          c.decode_capacity_tps * 100)  # fmt: skip

    @staticmethod
    def _moved(name: str, before: PerReplica, after: PerReplica) -> str:
        moved = []
        if name != "decode":
            moved.append(f"{before.prompt_tps:.0f} -> {after.prompt_tps:.0f} prompt tok/s")
        if name != "prefill":
            moved.append(f"{before.generation_tps:.0f} -> {after.generation_tps:.0f} generation tok/s")
        return ", ".join(moved)

    def _knobs_of_the_past(self, name: str, pool: PoolInput, mem: TunerMemory, knobs: Mapping[str, Proposal]) -> str:
        """Why a saturated window does not measure the capacity of the knobs to come, or ''.

        The throughput of a saturated pool is its capacity at the batch cap and token budget it
        ran with. When one of them changed within the window, the window mixes two settings; when
        this run raises one (a full batch with ITL to spare, prefill-bound with a budget to
        grow), the pool is about to serve more per replica. Either way, learning that throughput
        as the capacity would add replicas that the new knobs do not need."""
        m = pool.metrics
        for knob in (MAX_BATCH, TOKEN_BUDGET):
            if knob not in pool.current.knobs:
                continue
            history = mem.keys.get(f"{name}/{knob}")
            since = None if history is None or history.last_change_at is None else m.at - history.last_change_at
            if since is not None and since < m.window_s:
                return f"{knob} changed {since:.0f} s ago (< the {m.window_s:.0f} s window)"
            proposal = knobs.get(knob)
            if proposal is not None and proposal.target > pool.current.knobs[knob]:
                return f"{knob} rises this run ({_num(pool.current.knobs[knob])} -> {_num(proposal.target)})"
        return ""

    def _latency_saturation(
        self,
        name: str,
        pool: PoolInput,
        slo: SLOTargets,
        capacity: Capacity,
        knobs: Mapping[str, Proposal],
        lines: list[str],
    ) -> None:
        """A pool that violates an SLO it owns with the knob that protects it at its limit is
        saturated for latency: one replica cannot serve its current share of the traffic within
        the SLO, so that share is an upper bound on the capacity that counts (capacity at the
        SLO, not raw throughput: short-prompt chat or long-prompt RAG can break a TTFT SLO well
        below a pod's token throughput). The estimate drops to it at once, for the next runs
        (this run's replica decision, one more replica, is already made): without that, the
        replica count computed from throughput alone scales back down to the count that broke
        the SLO as soon as the stabilization window allows. It rises again only when pods are
        seen serving more (``_update_capacity``). Not for ITL over SLO at the minimum batch
        without a queue: that is the step time, not the load."""
        c, m = self.config, pool.metrics
        exhausted = self._exhausted(pool, knobs)
        pods = m.ready_pods or 0
        waiting = (m.waiting or 0.0) / max(pods, 1)
        if not exhausted or pods <= 0 or self._saturation(name, pool):
            return  # nothing exhausted, or a queue already made this run's measurement
        if capacity.steps.points:
            return  # step times: the latency projection sizes the pool for latency, throughput stays throughput
        if all(k == MAX_BATCH for k in exhausted) and waiting < c.queue_per_pod:
            return
        prompt = None if m.prompt_tokens_per_s is None else m.prompt_tokens_per_s / pods
        generation = None if m.generation_tokens_per_s is None else m.generation_tokens_per_s / pods
        before = self._per_replica(name, capacity, pool.current)
        if name == "colocated":
            if prompt is None or generation is None or prompt + generation <= 0:
                return
            factor = prompt / before.prompt_tps + generation / before.generation_tps
        else:
            observed = prompt if name == "prefill" else generation
            old = before.prompt_tps if name == "prefill" else before.generation_tps
            if observed is None or observed <= 0:
                return
            factor = observed / old
        if factor >= 1.0:
            return  # the estimate already says one replica is full at this load
        self._rescale(name, capacity, factor)
        capacity.observations += 1
        capacity.measured = True
        ratio = self._owned_latency_ratio(name, m, slo)
        after = self._per_replica(name, capacity, pool.current)
        lines.append(
            f"{name}: per-replica capacity {self._moved(name, before, after)} (saturated for latency: {ratio:.2f}x "
            f"the SLO with {self._spent(pool, knobs, exhausted)})"
        )

    def _saturation(self, name: str, pool: PoolInput) -> str:
        """Why the pool counts as saturated (its throughput is its capacity), or '' if it does not."""
        c, m = self.config, pool.metrics
        pods = max(m.ready_pods or 1, 1)
        # A full batch without a queue is not saturation: arrivals may just fill it. A queue is.
        if m.waiting is not None and m.waiting / pods >= c.saturation_queue_per_pod:
            return f"saturated: {m.waiting / pods:.1f} waiting per pod"
        return ""

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
        new, held_by = stabilize(history, now, old, rise, fall)
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
        history.moved(now, 1 if new > old else -1)
        how = proposal.how if new == proposal.target else f"stabilized over {_num(rise if new > old else fall)} s"
        reason = f"{name}: {proposal.why} -> {knob} {_num(old)} -> {_num(new)}" + (f" ({how})" if how else "")
        reason += f"; {note}" if note else ""
        changes.append(Change(name, knob, old, new, reason))
        lines.append(reason)
        return current.with_value(knob, new)

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
    ) -> Decision:
        mem.remember(DecisionRecord(at=now, hold=hold, changes=[str(c) for c in changes]))
        if not lines:
            lines.append("no pools to tune")
        return Decision(now, tuple(changes), tuple(lines), hold, hold_reason, settings, mem, inputs)


# --- formatting --------------------------------------------------------------------------------


def _cap_out_of_reach(mean_batch: float, cap: float) -> bool:
    """The batch cap is above the mean batch + 3 sd (Poisson-like: sd = sqrt(mean)): it is
    (almost) never what a waiting request waits for."""
    return mean_batch + 3.0 * math.sqrt(mean_batch) < cap


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def _queue_ms(m: PoolMetrics) -> float | None:
    return _ms(trusted_queue_s(m))


def _fmt_ms(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 10 else f"{value:.1f}"


def _opt(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.1f}"


def _pct(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.0%}"
