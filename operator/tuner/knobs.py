"""The knob rules: per pool, what each engine knob should be for the SLOs, from one metrics
snapshot. ``maxBatchSize`` follows AIMD against the ITL SLO, ``batchTimeoutMs`` (the prefill
coalescing window) answers TTFT and queue time, and ``maxNumBatchedTokens`` (the step's token
budget) trades between the two. Each rule returns a Proposal; law.py stabilizes and gates it."""

from __future__ import annotations

import math
from dataclasses import replace

from llmfleet.operator.metrics.source import PoolMetrics
from llmfleet.operator.tuner.decision import (
    MAX_BATCH,
    POOL_KNOBS,
    TIMEOUT,
    TOKEN_BUDGET,
    PoolInput,
    SLOTargets,
    TunerConfig,
    num,
)
from llmfleet.operator.tuner.projection import StepCosts, p95_prompt_computed, project, slots_for
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
)

# A TTFT p95 below this share of the queue-time p95 does not read the queue's waits: the widest
# ratio between neighbouring histogram bounds (160 s to 640 s) is 4, so interpolation in coarse
# buckets alone cannot put it this far below.
_DRAINED_TTFT_SHARE = 0.25


class KnobRules:
    """The knobs' proposals for one pool and one snapshot; stateless apart from the config."""

    def __init__(self, config: TunerConfig) -> None:
        self.config = config

    def propose(
        self, name: str, pool: PoolInput, slo: SLOTargets, steps: StepCosts | None, lone_step_s: float | None = None
    ) -> dict[str, Proposal]:
        """One proposal per knob the pool has, in the order POOL_KNOBS decides them (the batch
        rule reads the budget's). ``steps``: the step costs at the current knobs, or None;
        ``lone_step_s``: a decode step of one sequence, as the replica rule averages it, or None."""
        proposals: dict[str, Proposal] = {}
        for knob in POOL_KNOBS[name]:
            if knob not in pool.current.knobs:
                continue
            if knob == TOKEN_BUDGET:
                proposals[knob] = self._budget_rule(name, pool, slo, steps)
            elif knob == MAX_BATCH:
                proposals[knob] = self._batch_rule(name, pool, slo, proposals.get(TOKEN_BUDGET), steps, lone_step_s)
            else:
                proposals[knob] = self._timeout_rule(name, pool, slo)
        return proposals

    def _batch_rule(
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
            crowded = self._ttft_over_with_a_queue(name, pool, slo)
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

    def _ttft_over_with_a_queue(self, name: str, pool: PoolInput, slo: SLOTargets) -> str:
        """Why a colocated or decode pool's ITL excess is no reason to shrink a knob (TTFT, or the
        decode pool's share of it, over as well, with requests waiting: the pool lacks capacity,
        which only replicas add), or ''."""
        m = pool.metrics
        ttft, pods = ms(m.ttft.p95), max(m.ready_pods or 1, 1)
        if name == "prefill" or not math.isfinite(slo.ttft_p95_ms):
            return ""
        waiting = (m.waiting or 0.0) / pods
        if waiting < self.config.queue_per_pod:
            return ""
        if ttft is None:
            # Too few first tokens to judge while requests wait (a cold start's queue): the mean
            # wait is the queue over the arrival rate (Little's law), and the first tokens to come
            # will carry it.
            rate = m.request_rate
            wait_ms = math.inf if not rate else (m.waiting or 0.0) / rate * 1000.0
            if wait_ms <= slo.ttft_p95_ms:
                return ""
            return (
                f"TTFT p95 is unknown with {waiting:.1f} requests waiting per pod, a mean wait of "
                f"{fmt_ms(wait_ms)} ms at {rate or 0:.2f} requests/s (Little's law) over its SLO"
            )
        if ttft <= slo.ttft_p95_ms:
            return ""
        return f"TTFT p95 {fmt_ms(ttft)} ms is over its SLO too with {waiting:.1f} requests waiting per pod"

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

    def _timeout_rule(self, name: str, pool: PoolInput, slo: SLOTargets) -> Proposal:
        """The coalescing window against TTFT and queue time (colocated, prefill): halved while
        TTFT is over its SLO or mostly queueing; +5 ms while TTFT has more than half its SLO to
        spare and prompts arrive often enough to coalesce (a window that holds nothing back only
        adds latency)."""
        c, m = self.config, pool.metrics
        cur, allowed = pool.current.knobs[TIMEOUT], pool.limits.knob(TIMEOUT)
        ttft, target_ms = ms(m.ttft.p95), slo.ttft_p95_ms
        if ttft is None:
            return Proposal(cur, f"TTFT p95 unknown ({m.why_missing('ttft')})")
        queue = queue_ms(m)
        share = queue / ttft if queue is not None and ttft > 0 else None
        over = ttft > target_ms
        queue_bound = share is not None and share >= c.queue_dominant_fraction and ttft >= c.ttft_low_water * target_ms
        if over or queue_bound:
            why = (
                f"TTFT p95 {fmt_ms(ttft)} ms > SLO {fmt_ms(target_ms)} ms"
                if over
                else f"queue p95 {fmt_ms(queue)} ms is {share:.0%} of TTFT p95 {fmt_ms(ttft)} ms "  # type: ignore[arg-type]
                f"(>= {c.ttft_low_water:g} x SLO {fmt_ms(target_ms)} ms)"
            )
            shrunk = cur * c.timeout_shrink_factor
            new = allowed.clamp(allowed.low if shrunk < c.timeout_snap_ms else round(shrunk, 1))
            if new >= cur:
                return Proposal(
                    cur,
                    f"{why} with {TIMEOUT} at its minimum {num(allowed.low)}",
                    severity=ttft / target_ms,
                    exhausted=over,
                    protects="ttft",
                )
            # A window adds at most its length to a TTFT: when the excess is longer, shrinking it
            # helps but cannot restore the SLO alone, so it does not stand in for replicas.
            short = over and cur < ttft - target_ms
            if short:
                why += f", more than the whole {num(cur)} ms window"
            return Proposal(
                new,
                why,
                f"x{c.timeout_shrink_factor:g}",
                protective=True,
                severity=ttft / target_ms,
                exhausted=short,
                protects="ttft",
            )
        step = c.timeout_step_ms
        if ttft + step >= c.ttft_low_water * target_ms:
            return Proposal(
                cur,
                f"TTFT p95 {fmt_ms(ttft)} ms leaves no room for +{num(step)} ms under "
                f"{c.ttft_low_water:g} x SLO {fmt_ms(target_ms)} ms",
            )
        why = f"TTFT p95 {fmt_ms(ttft)} ms + {num(step)} ms < {c.ttft_low_water:g} x SLO {fmt_ms(target_ms)} ms"
        if name != "prefill":  # a prefill pool has no ITL of its own
            itl = ms(m.itl.p95)
            if itl is None or itl >= c.itl_low_water * slo.itl_p95_ms:
                shown = "unknown" if itl is None else f"{fmt_ms(itl)} ms"
                return Proposal(
                    cur, f"{why}, but ITL p95 {shown} is not < {c.itl_low_water:g} x SLO {fmt_ms(slo.itl_p95_ms)} ms"
                )
            why += f" and ITL p95 {fmt_ms(itl)} ms < {c.itl_low_water:g} x SLO {fmt_ms(slo.itl_p95_ms)} ms"
        pods = max(m.ready_pods or 1, 1)
        expected = None if m.request_rate is None else m.request_rate / pods * (cur + step) / 1000.0
        if expected is None or expected < c.window_coalesce_min:
            shown = "unknown" if expected is None else f"{expected:.2f}"
            return Proposal(
                cur,
                f"{why}, but a {num(round(cur + step, 1))} ms window would coalesce {shown} more prompts per pod "
                f"(< {c.window_coalesce_min:g}): it would only add latency",
            )
        new = allowed.clamp(round(cur + step, 1))
        if new <= cur:
            return Proposal(cur, f"{why} with {TIMEOUT} at its maximum {num(allowed.high)}")
        return Proposal(new, why, f"+{num(round(new - cur, 1))} ms")

    def _budget_rule(self, name: str, pool: PoolInput, slo: SLOTargets, costs: StepCosts | None) -> Proposal:
        """The step's token budget (colocated, prefill): x0.75 when prefill-heavy steps break the
        ITL SLO (never below the batch; from a budget no step reaches, straight to the largest
        step, a p95 prompt beside the batch), x2 when TTFT is over with prompts the budget cannot
        take and ITL has room, but not for the first tokens of a backlog that already drained,
        which a bigger budget would not have served sooner.

        A cut helps ITL only where the steps it leaves fit the SLO: a prompt cut into more chunks
        that each still take longer puts it over more of the gaps the p95 reads. So where the step
        model (``costs``) puts a full step at the cut budget over the SLO, the budget is spent for
        ITL (_chunks_over_the_slo): it holds, or grows where the longer prompts span several
        steps, and more replicas, which give each pod fewer prompts, are what is left. A TTFT
        excess with a queue holds only a cut that would help ITL: fewer, larger chunks serve the
        queue too (a cold start's, with prompts far longer than the starting budget)."""
        c, m = self.config, pool.metrics
        cur, allowed = pool.current.knobs[TOKEN_BUDGET], pool.limits.knob(TOKEN_BUDGET)
        ttft, itl = ms(m.ttft.p95), ms(m.itl.p95) if name != "prefill" else None
        steps, batch = m.mean_step_tokens, m.mean_batch_size
        if itl is not None and itl > slo.itl_p95_ms and steps and batch and steps >= c.prefill_heavy_ratio * batch:
            why = (
                f"ITL p95 {fmt_ms(itl)} ms > SLO {fmt_ms(slo.itl_p95_ms)} ms with prefill-heavy steps "
                f"({steps:.0f} tokens per step for {batch:.1f} sequences)"
            )
            floor_ = allowed.clamp(max(allowed.low, pool.current.knobs.get(MAX_BATCH, allowed.low)))
            largest = _largest_step_tokens(m)
            cut = math.floor(cur * c.budget_decrease_factor)
            base = cut if largest is None else min(cut, math.ceil(largest))
            new = max(floor_, allowed.clamp(base))
            full = _full_step_ms(m, new, costs)
            if full is not None and full > c.projected_latency_limit * slo.itl_p95_ms:
                why += (
                    f", but a full step at {TOKEN_BUDGET} {num(new)} would take {full:.0f} ms "
                    f"(> {c.projected_latency_limit:g} x SLO)"
                )
                return self._chunks_over_the_slo(pool, why, itl / slo.itl_p95_ms)
            crowded = self._ttft_over_with_a_queue(name, pool, slo)
            if crowded:
                return Proposal(cur, f"{why}, but {crowded}: a smaller budget would move the excess onto TTFT")
            if new >= cur:
                return Proposal(cur, f"{why} with {TOKEN_BUDGET} at its floor {num(floor_)}")
            how = f"x{c.budget_decrease_factor:g}" if base == cut else "to the largest step run"
            return Proposal(
                new,
                why,
                how,
                protective=True,
                severity=itl / slo.itl_p95_ms,
                protects="itl",
            )
        if ttft is None:
            return Proposal(cur, f"TTFT p95 unknown ({m.why_missing('ttft')})")
        if ttft <= slo.ttft_p95_ms:
            held = Proposal(cur, f"TTFT p95 {fmt_ms(ttft)} ms <= SLO {fmt_ms(slo.ttft_p95_ms)} ms")
            return self._budget_relaxation(name, pool, slo, ttft, itl) or held
        why = f"TTFT p95 {fmt_ms(ttft)} ms > SLO {fmt_ms(slo.ttft_p95_ms)} ms"
        queue = queue_ms(m)
        prompt = m.mean_prompt_tokens()
        # A prompt longer than the budget takes several steps; steps that fill the budget leave the
        # next prompts waiting for one; and where prompts queue while neither the window nor the
        # slots hold them back, a budget too small for two prompts beside a full batch makes the
        # second of two arrivals wait a step. A queue in front of a small budget is the budget's
        # doing, so it does not rule the budget out.
        pair = None if prompt is None else 2 * prompt + pool.current.knobs.get(MAX_BATCH, 0.0)
        if prompt is not None and prompt > cur:
            evidence = f"mean prompt {prompt:.0f} tokens > budget {num(cur)}"
        elif steps is not None and steps >= 0.9 * cur:
            evidence = f"steps fill the budget ({steps:.0f} of {num(cur)} tokens)"
        elif (
            pair is not None
            and pair > cur
            and queue is not None
            and queue >= c.queue_dominant_fraction * ttft
            and self._window_and_slots_clear(pool)
        ):
            evidence = (
                f"prompts queue (queue p95 {fmt_ms(queue)} ms) with {TIMEOUT} at its minimum and batch slots "
                f"free, and two mean prompts and a full batch ({pair:.0f} tokens) overflow the budget"
            )
        else:
            return Proposal(
                cur, f"{why}, but prompts fit the budget (mean prompt {opt(prompt)} tokens, queue p95 {opt(queue)} ms)"
            )
        drained = self.drained_backlog(pool, slo)
        if drained:
            return Proposal(cur, f"{why} and {evidence}, but {drained}")
        if itl is not None and itl >= c.itl_low_water * slo.itl_p95_ms:
            return Proposal(cur, f"{why} and {evidence}, but ITL p95 {fmt_ms(itl)} ms has no room")
        if name != "prefill" and itl is None:
            return Proposal(cur, f"{why} and {evidence}, but ITL p95 is unknown ({m.why_missing('itl')})")
        new = allowed.clamp(math.floor(cur * c.budget_increase_factor))
        if new <= cur:
            return Proposal(cur, f"{why} and {evidence} with {TOKEN_BUDGET} at its maximum {num(allowed.high)}")
        return Proposal(
            new,
            f"{why} and {evidence}",
            f"x{c.budget_increase_factor:g}",
            protective=True,
            severity=ttft / slo.ttft_p95_ms,
            protects="ttft",
        )

    def _chunks_over_the_slo(self, pool: PoolInput, why: str, severity: float) -> Proposal:
        """The budget where a step that carries a prompt chunk breaks the ITL SLO at any budget a
        cut would reach: the p95 reads how many gaps such steps are, not how long each is. A
        smaller budget cuts each prompt into more of them; where the longer prompts (the p95 of
        prompt lengths, else the mean) span more than one step, a bigger one (x2) puts them over
        fewer, and spends less of each pod on the steps' fixed cost. Either way the budget cannot
        restore the SLO alone (``exhausted``): what is left over is for replicas, which give each
        pod fewer prompts."""
        c, m = self.config, pool.metrics
        cur, allowed = pool.current.knobs[TOKEN_BUDGET], pool.limits.knob(TOKEN_BUDGET)
        long, which = (
            (m.prompt_length.p95, "p95 prompt") if m.prompt_length.known else (m.mean_prompt_tokens(), "mean prompt")
        )
        new = allowed.clamp(math.floor(cur * c.budget_increase_factor))
        if long is None or long <= cur or new <= cur:
            return Proposal(
                cur,
                f"{why}: smaller chunks only put each prompt over more gaps",
                severity=severity,
                exhausted=True,
                protects="itl",
            )
        return Proposal(
            new,
            f"{why}, and a {which} ({long:.0f} tokens) spans more than one step at {num(cur)}: "
            "larger chunks put prompts over fewer gaps",
            f"x{c.budget_increase_factor:g}",
            protective=True,
            severity=severity,
            exhausted=True,
            protects="itl",
        )

    def drained_backlog(self, pool: PoolInput, slo: SLOTargets) -> str:
        """Why a TTFT excess is a backlog that has already drained, or '': requests left the queue
        after waiting longer than the whole TTFT SLO (queue p95), while fewer waited on average
        over the window than a live queue with those waits would hold (Little's law: the request
        rate times the mean wait, which is at least half the median and 5% of the p95). Those
        waits began before the window, in a queue the pods have since cleared (pods added for it,
        say). A bigger budget would not clear it any sooner, and it would lengthen every step that
        carries a prompt when the next burst comes. A pool that sees few requests, each waiting
        long, holds few and is no backlog. Nor is a TTFT p95 below the queue's: a request's queue
        time is recorded when it finishes, its first token when it comes, and every first token
        includes its wait, so waits the TTFT p95 does not read came before the window's first
        tokens (long answers finishing now), and the excess is the prompts' own."""
        m, q = pool.metrics, pool.metrics.queue_time
        queue = ms(q.p95)
        if queue is None or q.p95 is None or queue <= slo.ttft_p95_ms or m.waiting is None or not m.request_rate:
            return ""
        ttft = ms(m.ttft.p95)
        if ttft is not None and ttft < queue * _DRAINED_TTFT_SHARE:
            return ""
        pods = max(m.ready_pods or 1, 1)
        least_mean_wait = max(0.5 * (q.p50 or 0.0), 0.05 * q.p95)
        waiting, held = m.waiting / pods, m.request_rate / pods * least_mean_wait
        if waiting >= held:
            return ""
        return (
            f"its requests queued for longer than the SLO (queue p95 {fmt_ms(queue)} ms) while {waiting:.2f} "
            f"waited per pod, where a live queue that slow holds at least {held:.2f}: a backlog that has drained"
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
        if name != "prefill" and (
            itl is None or itl >= c.itl_low_water * slo.itl_p95_ms or itl / slo.itl_p95_ms > tight
        ):
            return None
        pair = 2 * prompt + pool.current.knobs.get(MAX_BATCH, 0.0)
        new = allowed.clamp(math.floor(cur * c.budget_increase_factor))
        if pair <= cur or new <= cur:
            return None
        room = "" if itl is None else f", ITL p95 {fmt_ms(itl)} ms has room"
        why = (
            f"TTFT p95 {fmt_ms(ttft)} ms is {tight:.0%} of its SLO{room}, and two mean prompts and a full batch "
            f"({pair:.0f} tokens) overflow the budget"
        )
        return Proposal(new, why, f"x{c.budget_increase_factor:g}")

    def _window_and_slots_clear(self, pool: PoolInput) -> bool:
        """The batching window is at its minimum and the batch cap is out of reach (the mean
        batch + 3 sd under it): neither holds a waiting prompt back."""
        cur = pool.current.knobs
        window_low = TIMEOUT not in cur or cur[TIMEOUT] <= pool.limits.knob(TIMEOUT).low
        running = pool.metrics.mean_batch_size
        slots_free = MAX_BATCH not in cur or (running is not None and cap_out_of_reach(running, cur[MAX_BATCH]))
        return window_low and slots_free


def _full_step_ms(m: PoolMetrics, budget: float, costs: StepCosts | None) -> float | None:
    """The longest step ``budget`` lets the window's load take, in ms: its mean step with the
    prompt tokens topped up (or cut) to the budget, but to no more than one more mean prompt,
    at the step model's cost per prompt token. None without step times."""
    if costs is None or not m.mean_step_seconds or m.mean_step_tokens is None:
        return None
    prompt = m.mean_prompt_tokens()
    tokens = budget if prompt is None else min(budget, m.mean_step_tokens + prompt)
    return 1000.0 * (m.mean_step_seconds + costs.per_prompt_token_s * (tokens - m.mean_step_tokens))


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


def _largest_step_tokens(m: PoolMetrics) -> float | None:
    """The tokens of the largest step the pool runs: a p95 prompt's computed tokens beside the
    mean batch. A budget above it splits no prompt, so cutting a budget that never binds to x0.75
    of itself changes no step. None without prompt lengths or a measured batch."""
    prompt = p95_prompt_computed(m)
    if prompt is None or m.mean_batch_size is None:
        return None
    return m.mean_batch_size + prompt
