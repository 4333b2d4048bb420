"""``batchTimeoutMs`` (colocated, prefill): the prefill coalescing window, halved while TTFT is
over its SLO or mostly queueing, and widened only while TTFT has room and prompts come often enough
to coalesce."""

from __future__ import annotations

from llmfleet.operator.tuner.decision import TIMEOUT, PoolInput, SLOTargets, TunerConfig, num
from llmfleet.operator.tuner.proposal import Proposal, fmt_ms, ms, queue_ms


class WindowRule:
    """The batching window's proposal for one pool and one snapshot."""

    def __init__(self, config: TunerConfig) -> None:
        self.config = config

    def propose(self, name: str, pool: PoolInput, slo: SLOTargets) -> Proposal:
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
