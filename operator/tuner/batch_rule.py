"""``maxBatchSize`` (colocated, decode): AIMD against the ITL SLO, grown at once where prompts
wait for a batch slot or a busy window would fill the slots, held where a smaller batch would only
move an excess onto TTFT or leave the slow, prompt-carrying steps as long."""

from __future__ import annotations

import math
from dataclasses import replace

from llmfleet.operator.metrics.source import PoolMetrics
from llmfleet.operator.tuner.decision import (
    MAX_BATCH,
    TOKEN_BUDGET,
    PoolInput,
    SLOTargets,
    TunerConfig,
    num,
)
from llmfleet.operator.tuner.projection import StepCosts, project, slots_for
from llmfleet.operator.tuner.proposal import (
    Proposal,
    busy_kv_load,
    busy_surge,
    cap_out_of_reach,
    fmt_ms,
    kv_under_pressure,
    ms,
    opt,
    pct,
    queue_ms,
    ttft_over_with_a_queue,
)


class BatchRule:
    """The batch cap's proposal for one pool and one snapshot."""

    def __init__(self, config: TunerConfig) -> None:
        self.config = config

    def propose(
        self,
        name: str,
        pool: PoolInput,
        slo: SLOTargets,
        budget: Proposal | None,
        steps: StepCosts | None,
        lone_step_s: float | None = None,
    ) -> Proposal:
        """AIMD against the ITL SLO (colocated, decode). Over the SLO: x0.75 of the batch that
        actually ran, as TCP decreases from the flight size, but not
        - with TTFT over too and requests waiting (a smaller batch would only move the excess
          onto TTFT);
        - where a decode step of one sequence (``lone_step_s``) is past the SLO (no batch meets it);
        - where a decode step of a busy batch is well within it (the slow gaps carry prompt work,
          which pods, each with fewer prompts, thin out and a smaller batch does not);
        - below the requests running on every pod maxReplicas allows (they would queue for good).
        Under 0.8 SLO with the batch the limit: +4, or straight to the slots a busy window needs.
        Never up while the KV cache is under pressure: a bigger batch would only preempt. Within
        0.8-1x, a decode pool's TTFT share broken by waits for a slot is spent: pods must cut it."""
        c, m = self.config, pool.metrics
        cur, allowed = pool.current.knobs[MAX_BATCH], pool.limits.knob(MAX_BATCH)
        itl, target_ms = ms(m.itl.p95), slo.itl_p95_ms
        if itl is None:
            return Proposal(cur, f"ITL p95 unknown ({m.why_missing('itl')})")
        if itl > target_ms:
            why = f"ITL p95 {fmt_ms(itl)} ms > SLO {fmt_ms(target_ms)} ms"
            if lone_step_s is not None and lone_step_s * 1000.0 >= target_ms:
                return Proposal(
                    cur,
                    f"{why}, but a decode step of one sequence takes {fmt_ms(lone_step_s * 1000.0)} ms: "
                    "no batch brings it within",
                    severity=itl / target_ms,
                    exhausted=True,
                    protects="itl",
                )
            if budget is not None and budget.target < pool.current.knobs[TOKEN_BUDGET]:
                return Proposal(cur, f"{why}, but prefill chunks dominate the steps: {TOKEN_BUDGET} shrinks instead")
            if budget is not None and budget.exhausted and budget.protects == "itl":
                # the prompt chunks make the steps long: a smaller batch leaves them long and queues requests
                grows = budget.target > pool.current.knobs[TOKEN_BUDGET]
                return Proposal(
                    cur,
                    f"{why}, but prefill chunks dominate the steps and no {TOKEN_BUDGET} brings them within it"
                    + (f" ({TOKEN_BUDGET} grows to put each prompt over fewer of them)" if grows else ""),
                    severity=itl / target_ms,
                    exhausted=True,
                    protects="itl",
                )
            crowded = ttft_over_with_a_queue(name, pool, slo, c.queue_per_pod)
            if crowded:
                return Proposal(
                    cur,
                    f"{why}, but {crowded}: a smaller batch would move the excess onto TTFT",
                    severity=itl / target_ms,
                    exhausted=True,
                    protects="itl",
                )
            busy = _busy_batch(m, cur, c.queue_per_pod)
            decode_ms = _busy_decode_step_ms(m, steps, busy)
            if decode_ms is not None and decode_ms < c.itl_low_water * target_ms:
                return Proposal(
                    cur,
                    f"{why}, but a decode step of a busy batch ({busy:.0f} sequences) "
                    f"takes {fmt_ms(decode_ms)} ms: the slow gaps are steps that carry prompt work, "
                    "which a smaller batch leaves as long",
                    severity=itl / target_ms,
                    exhausted=True,
                    protects="itl",
                )
            base = cur if m.mean_batch_size is None else min(cur, float(math.ceil(m.mean_batch_size)))
            new = allowed.clamp(math.floor(base * c.batch_decrease_factor))
            if new >= cur:
                return Proposal(
                    cur,
                    f"{why} with {MAX_BATCH} at its minimum {num(allowed.low)}",
                    severity=itl / target_ms,
                    exhausted=True,
                    protects="itl",
                )
            most = pool.limits.max_replicas
            if m.running is not None and new * most < m.running:
                return Proposal(
                    cur,
                    f"{why}, but {num(new)} slots on each of at most {most} pods (maxReplicas) are fewer than the "
                    f"{m.running:.0f} requests running: the cut would queue them with no pod to make up for it",
                    severity=itl / target_ms,
                    exhausted=True,
                    protects="itl",
                )
            how = f"x{c.batch_decrease_factor:g}" + (f" of the observed batch {num(base)}" if base < cur else "")
            return Proposal(new, why, how, protective=True, severity=itl / target_ms, protects="itl")
        slots = self._slot_bound_ttft(pool, slo, budget)
        if slots is not None:
            return slots
        if itl >= c.itl_low_water * target_ms:
            why = f"ITL p95 {fmt_ms(itl)} ms within {c.itl_low_water:g}-1x SLO {fmt_ms(target_ms)} ms"
            waits = self._slot_wait_over_ttft(name, pool, slo)
            if waits:
                # no ITL to spend on more slots: the pods are what is left to cut the wait
                ttft = ms(m.ttft.p95) or 0.0
                return Proposal(
                    cur,
                    f"{waits}, and {why}: no room for more slots",
                    severity=ttft / slo.ttft_p95_ms,
                    exhausted=True,
                    protects="ttft",
                )
            return self._batch_at_max_replicas(pool, slo, steps, why) or Proposal(cur, why)
        why = f"ITL p95 {fmt_ms(itl)} ms < {c.itl_low_water:g} x SLO {fmt_ms(target_ms)} ms"
        if kv_under_pressure(m, c):
            return Proposal(
                cur,
                f"{why}, but the KV cache is under pressure (max usage {pct(m.kv_usage_max)}, "
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
                f"{why}, but the batch is not the limit (mean batch {opt(m.mean_batch_size)} of {num(cur)}, "
                f"{opt(None if m.waiting is None else m.waiting / pods)} waiting per pod)",
            )
        step = c.batch_increase_step
        if not (full or queued):  # straight to the slots needed, in whole steps
            step *= max(1, math.ceil((slots - cur) / c.batch_increase_step))
        new = allowed.clamp(cur + step)
        if new <= cur:
            return Proposal(cur, f"{why} with {MAX_BATCH} at its maximum {num(allowed.high)}")
        if full:
            evidence = f"the batch is full (mean {m.mean_batch_size:.1f} of {num(cur)})"
        elif queued:
            evidence = f"{m.waiting / pods:.1f} requests wait per pod"  # type: ignore[operator]
        else:
            evidence = f"at a busy window's load {pods_then} would need {slots} slots for a request to rarely wait"
        return Proposal(new, f"{why} and {evidence}", f"+{num(new - cur)}")

    def _batch_at_max_replicas(
        self, pool: PoolInput, slo: SLOTargets, steps: StepCosts | None, why: str
    ) -> Proposal | None:
        """With ITL within 0.8-1x its SLO, a full batch and requests queueing at maxReplicas, no
        pod can come for the queue: the batch grows (+4 at most) to the largest whose decode step,
        at the measured ITL p95's ratio to the step plane's step, stays within
        ``itl_headroom_at_max`` of the SLO. A bigger batch serves more per pod while steps are
        overhead-bound. None where that does not apply."""
        c, m = self.config, pool.metrics
        cur, allowed = pool.current.knobs[MAX_BATCH], pool.limits.knob(MAX_BATCH)
        most, pods = pool.limits.max_replicas, m.ready_pods or 0
        itl, running = ms(m.itl.p95), m.mean_batch_size
        if steps is None or itl is None or running is None or pods < most or pool.current.replicas < most:
            return None
        if (m.waiting or 0.0) / pods < c.queue_per_pod or running < c.batch_full_fraction * cur:
            return None
        if kv_under_pressure(m, c):
            return None
        step_ms = _busy_decode_step_ms(m, steps, running)
        if not step_ms:
            return None
        limit = c.itl_headroom_at_max * slo.itl_p95_ms * step_ms / itl  # a step's ms at that ITL
        fits = math.floor((limit / 1000.0 - steps.overhead_s) / steps.per_seq_s) if steps.per_seq_s > 0 else cur
        new = allowed.clamp(min(cur + c.batch_increase_step, fits))
        if new <= cur:
            return None
        return Proposal(
            new,
            f"{why}, but {m.waiting / pods:.1f} requests wait per pod at maxReplicas {most} with the batch full "
            f"(mean {running:.1f} of {num(cur)}), and a decode step of {num(new)} sequences keeps ITL within "
            f"{c.itl_headroom_at_max:g}x its SLO by the step plane",
            f"+{num(new - cur)}",
        )

    def _slot_wait_over_ttft(self, name: str, pool: PoolInput, slo: SLOTargets) -> str:
        """Why a decode pool's TTFT is over its share of the SLO (Disaggregated.ttft_budgets gives
        it one only where what a decode server adds to every request fits, so the excess is the
        wait for a batch slot) while the batch reaches its cap, or '': below it (the mean batch +
        3 sd) the waits were a backlog's that has left the queue, not slots short at this load."""
        m = pool.metrics
        ttft, queue, running = ms(m.ttft.p95), queue_ms(m), m.mean_batch_size
        if name != "decode" or ttft is None or ttft <= slo.ttft_p95_ms:
            return ""
        if running is None or cap_out_of_reach(running, pool.current.knobs[MAX_BATCH]):
            return ""
        waited = "" if queue is None else f" (queue p95 {fmt_ms(queue)} ms)"
        return f"TTFT p95 {fmt_ms(ttft)} ms > its share {fmt_ms(slo.ttft_p95_ms)} ms, waiting for a batch slot{waited}"

    def _slots_needed(self, name: str, pool: PoolInput, slo: SLOTargets, steps: StepCosts | None) -> tuple[int, str]:
        """The batch slots that keep a request's wait for one rare at the load of a busy window
        (projection.slots_for), with the pods there are or with the fewest pods whose time
        would allow it (the latency projects within the SLOs with slots to spare, and the KV cache
        holds the sequences); when that is more than the cap: (slots, for what), else (0, '').
        Pods and slots are one decision: a scale-down projected at today's cap would find the
        slots short and keep pods that a bigger cap lets go, and a cap does not cost anything
        until it binds."""
        c, m, cur = self.config, pool.metrics, pool.current.knobs[MAX_BATCH]
        pods = m.ready_pods or 0
        if steps is None or pods <= 0 or pods != pool.current.replicas:
            return 0, ""
        busy, kv = busy_surge(m, c), busy_kv_load(m, pods, c)
        unbounded = replace(steps, slots=None)
        candidates = [(busy, f"its {pods} pods")]
        for n in range(pods - 1, max(pool.limits.min_replicas, 1) - 1, -1):
            if kv / n >= c.kv_pressure:
                break
            k = pods / n * busy
            if project(name, m, slo.ttft_p95_ms, slo.itl_p95_ms, 0.0, k, unbounded).ratio > c.projected_latency_limit:
                break
            candidates.append((k, f"{n} pods"))
        needed, what = max(((slots_for(m, steps, k) or 0), what) for k, what in candidates)
        return (needed, what) if needed > cur else (0, "")

    def _slot_bound_ttft(self, pool: PoolInput, slo: SLOTargets, budget: Proposal | None) -> Proposal | None:
        """TTFT (a decode pool's share of it, where it owns one) spent queueing for a batch slot
        while ITL has room: a bigger batch protects TTFT (immediately, like the window's shrink),
        before any replica is added. Requests wait for admission when every slot is taken or the
        step's token budget is spent; steps that do not fill the budget leave the slots as the
        limit. None when this does not apply."""
        c, m = self.config, pool.metrics
        cur, allowed = pool.current.knobs[MAX_BATCH], pool.limits.knob(MAX_BATCH)
        ttft, queue, itl = ms(m.ttft.p95), queue_ms(m), ms(m.itl.p95)
        if ttft is None or queue is None or itl is None or ttft <= 0:
            return None
        target_ms = slo.ttft_p95_ms
        if queue / ttft < c.queue_dominant_fraction or ttft < c.ttft_low_water * target_ms:
            return None
        if itl >= c.itl_low_water * slo.itl_p95_ms:
            return None  # no ITL to spend on a bigger batch
        if kv_under_pressure(m, c):
            return None
        budget_now = pool.current.knobs.get(TOKEN_BUDGET)
        steps = m.mean_step_tokens
        if budget is not None and budget.target != budget_now:
            return None  # the token budget moves this run: one lever at a time
        if budget_now is not None and (steps is None or steps >= c.batch_full_fraction * budget_now):
            return None  # the budget, not the slots, may be what holds prompts back
        running = m.mean_batch_size
        if running is None or cap_out_of_reach(running, cur):
            return None  # the cap is (almost) never reached: slots are not what requests wait for
        new = allowed.clamp(cur + c.batch_increase_step)
        if new <= cur:
            return None
        why = (
            f"queue p95 {fmt_ms(queue)} ms is {queue / ttft:.0%} of TTFT p95 {fmt_ms(ttft)} ms "
            f"(>= {c.ttft_low_water:g} x SLO {fmt_ms(target_ms)} ms) with ITL p95 {fmt_ms(itl)} ms "
            f"< {c.itl_low_water:g} x SLO {fmt_ms(slo.itl_p95_ms)} ms"
            + f", mean batch {running:.1f} of {num(cur)} (+3 sd reaches it)"
            + ("" if steps is None else f" and steps under the budget ({steps:.0f} tokens)")
            + ": prompts wait for a batch slot"
        )
        return Proposal(new, why, f"+{num(new - cur)}", protective=True, severity=ttft / target_ms, protects="ttft")


def _busy_batch(m: PoolMetrics, cap: float, queue_per_pod: float) -> float:
    """The batch of a busy step: the cap where requests queue (the batch runs full), else the
    mean + 2 sd (Poisson-like occupancy, sd = sqrt(mean)), no more than the cap."""
    mean = m.mean_batch_size or 0.0
    if (m.waiting or 0.0) / max(m.ready_pods or 1, 1) >= queue_per_pod:
        return cap
    return min(cap, mean + 2.0 * math.sqrt(mean))


def _busy_decode_step_ms(m: PoolMetrics, costs: StepCosts | None, batch: float) -> float | None:
    """A decode step of ``batch`` sequences alone, no prompt work in it, at the step model's
    costs, in ms; None without costs or a measured batch."""
    if costs is None or m.mean_batch_size is None:
        return None
    return 1000.0 * (costs.overhead_s + costs.per_seq_s * max(batch, 1.0))
