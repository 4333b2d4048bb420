"""What the tuner's rules share: a rule's recommendation (``Proposal``), the readings several
rules take of the same snapshot, and how numbers are written in reasons."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from llmfleet.operator.metrics.source import PoolMetrics
from llmfleet.operator.tuner.decision import PoolInput, ScalingLimit, SLOTargets, TunerConfig
from llmfleet.operator.tuner.forecast import Outlook
from llmfleet.operator.tuner.projection import owns_ttft, surge, trusted_queue_s


class Moved(NamedTuple):
    """What earlier runs tell a replica proposal about the pool's pods and load."""

    added_since: float | None  # pods the tuner added, ready since: the SLO window has yet to see them all
    removed_since: float | None  # pods the tuner removed, gone since
    outlook: Outlook | None  # the forecast's
    window_pods: float | None = None  # the ready pods the latencies' window saw on average
    # (tokens, seconds) of the p95 prompt's own prefill, smoothed over the scale-down window
    first_token_floor: tuple[float, float] | None = None
    # seconds a decode step of one sequence takes, smoothed over the scale-down window
    decode_step_floor: float | None = None


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
    # replicas: the fewest the latency projection holds within the SLOs, judged now, or one above a
    # count that broke them at the load there is now
    floor: float | None = None
    driver: str = ""  # replicas: which term set the count (demand, queue, forecast, latency, busy window, bounds)
    judged: bool = False  # replicas: the owned latency was measured at this count, so needed is judged
    load: float | None = None  # replicas: the requests/s the pool finished this run
    # replicas: the owned SLO broke at this count with every knob spent, or a busy window projects
    # ITL far past it (LatencySizing.busy_itl), without a queue
    broke: bool = False
    # replicas: the owned SLOs held over a whole window measured at this count, no busy window past its limit
    held: bool = False
    limit: ScalingLimit | None = None  # replicas: why the count differs from what the SLOs ask (ScalingLimited)

    @property
    def needed(self) -> float:
        """What this run judged the pool needs: the target, not below the latency floor."""
        return self.target if self.floor is None else max(self.target, self.floor)


def exhausted_knobs(pool: PoolInput, knobs: Mapping[str, Proposal]) -> list[str]:
    """Knobs that cannot restore a violated SLO (at their limit, or short of the excess) that no
    other knob is protecting this run."""
    moving = {knobs[k].protects for k in protecting_knobs(pool, knobs)}
    return [k for k, p in knobs.items() if p.exhausted and p.protects not in moving]


def protecting_knobs(pool: PoolInput, knobs: Mapping[str, Proposal]) -> list[str]:
    """Knobs that move this run to protect an SLO, with room left to do it."""
    return [k for k, p in knobs.items() if p.protective and not p.exhausted and p.target != pool.current.value(k)]


def spent(pool: PoolInput, knobs: Mapping[str, Proposal], exhausted: list[str]) -> str:
    """'batchTimeoutMs at its limit' or '... short of the excess', for each knob that cannot
    restore its SLO."""
    return ", ".join(
        f"{k} at its limit" if knobs[k].target == pool.current.value(k) else f"{k} short of the excess"
        for k in exhausted
    )


def owned_latency_ratio(name: str, m: PoolMetrics, slo: SLOTargets) -> float:
    """The owned latencies over their SLOs, as judged over the SLO's window (replicas follow
    these; the knobs react to the shorter metric window). A decode pool owns TTFT where the law
    gives it a finite share of it (Disaggregated.ttft_budgets)."""
    ratios = [0.0]
    ttft, itl = m.judged_ttft.p95, m.judged_itl.p95
    if ttft is not None and owns_ttft(name, slo.ttft_p95_ms):
        ratios.append(ttft * 1000.0 / slo.ttft_p95_ms)
    if name in ("colocated", "decode") and itl is not None:
        ratios.append(itl * 1000.0 / slo.itl_p95_ms)
    return max(ratios)


def busy_surge(m: PoolMetrics, config: TunerConfig) -> float:
    """The load factor of a busy window as long as the one the latencies are judged over, whose
    work is that of the requests in flight in it (running and waiting, and its arrivals)."""
    return surge(m.request_rate, m.judged_window_s, config.surge_sd, (m.running or 0.0) + (m.waiting or 0.0))


def kv_under_pressure(m: PoolMetrics, config: TunerConfig) -> bool:
    """The KV cache is (nearly) full or preempting: a bigger batch would only preempt."""
    return (m.kv_usage_max or 0.0) >= config.kv_pressure or (m.preemptions_per_s or 0.0) > 0


def busy_kv_load(m: PoolMetrics, pods: int, config: TunerConfig) -> float:
    """The busiest pod's KV usage at a busy window's load, in pods' worth: spread alike over n
    pods, each runs ``busy_kv_load / n`` full, which must stay under ``kv_pressure``."""
    return (m.kv_usage_max or 0.0) * pods * busy_surge(m, config)


def cap_out_of_reach(mean_batch: float, cap: float) -> bool:
    """The batch cap is above the mean batch + 3 sd (Poisson-like: sd = sqrt(mean)): it is
    (almost) never what a waiting request waits for."""
    return mean_batch + 3.0 * math.sqrt(mean_batch) < cap


def ttft_over_with_a_queue(name: str, pool: PoolInput, slo: SLOTargets, queue_per_pod: float) -> str:
    """Why a colocated or decode pool's ITL excess is no reason to shrink a knob (TTFT, or the
    decode pool's share of it, over as well, with requests waiting: the pool lacks capacity,
    which only replicas add), or ''."""
    m = pool.metrics
    ttft, pods = ms(m.ttft.p95), max(m.ready_pods or 1, 1)
    if name == "prefill" or not math.isfinite(slo.ttft_p95_ms):
        return ""
    waiting = (m.waiting or 0.0) / pods
    if waiting < queue_per_pod:
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


# --- formatting --------------------------------------------------------------------------------


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def queue_ms(m: PoolMetrics) -> float | None:
    return ms(trusted_queue_s(m))


def fmt_ms(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 10 else f"{value:.1f}"


def opt(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.1f}"


def pct(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.0%}"
