"""``maxNumBatchedTokens`` (colocated, prefill): the step's token budget, cut where
prefill-heavy steps break the ITL SLO and a cut leaves steps that fit it, grown where TTFT is over
with prompts the budget cannot take, or where long prompts span several steps over the ITL SLO."""

from __future__ import annotations

import math

from llmfleet.operator.metrics.source import PoolMetrics
from llmfleet.operator.tuner.decision import (
    MAX_BATCH,
    TIMEOUT,
    TOKEN_BUDGET,
    PoolInput,
    SLOTargets,
    TunerConfig,
    num,
)
from llmfleet.operator.tuner.projection import StepCosts, p95_prompt_computed
from llmfleet.operator.tuner.proposal import (
    Proposal,
    cap_out_of_reach,
    fmt_ms,
    ms,
    opt,
    queue_ms,
    ttft_over_with_a_queue,
)

# A TTFT p95 below this share of the queue-time p95 does not read the queue's waits: the widest
# ratio between neighbouring histogram bounds (160 s to 640 s) is 4, so interpolation in coarse
# buckets alone cannot put it this far below.
_DRAINED_TTFT_SHARE = 0.25


class BudgetRule:
    """The token budget's proposal for one pool and one snapshot."""

    def __init__(self, config: TunerConfig) -> None:
        self.config = config

    def propose(self, name: str, pool: PoolInput, slo: SLOTargets, costs: StepCosts | None) -> Proposal:
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
            crowded = ttft_over_with_a_queue(name, pool, slo, c.queue_per_pod)
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


def _largest_step_tokens(m: PoolMetrics) -> float | None:
    """The tokens of the largest step the pool runs: a p95 prompt's computed tokens beside the
    mean batch. A budget above it splits no prompt, so cutting a budget that never binds to x0.75
    of itself changes no step. None without prompt lengths or a measured batch."""
    prompt = p95_prompt_computed(m)
    if prompt is None or m.mean_batch_size is None:
        return None
    return m.mean_batch_size + prompt
