"""The two pools of a disaggregated fleet as one: how the TTFT SLO splits between the prefill
pool and the decode pool, whose parts add up to what clients wait, and the spec's bounds on the
prefill:decode ratio."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

from llmfleet.operator.tuner.decision import REPLICAS, Change, PoolInput, PoolSettings, SLOTargets, TunerConfig
from llmfleet.operator.tuner.decision import num as _num
from llmfleet.operator.tuner.memory import TunerMemory
from llmfleet.operator.tuner.projection import trusted_queue_s
from llmfleet.operator.tuner.proposal import fmt_ms


class Disaggregated:
    """The SLO split and the ratio bounds of a prefill and a decode pool."""

    def __init__(self, config: TunerConfig) -> None:
        self.config = config

    def ttft_budgets(self, pools: Mapping[str, PoolInput], slo: SLOTargets, lines: list[str]) -> dict[str, SLOTargets]:
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

    def ratio_bounds(
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
