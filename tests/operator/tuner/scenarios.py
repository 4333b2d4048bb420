"""Builders for tuner inputs: one PoolMetrics per call, milliseconds in, seconds stored."""

from __future__ import annotations

from llmfleet.operator.metrics.source import PoolMetrics, PoolRef, Quantiles
from llmfleet.operator.tuner.law import (
    MAX_BATCH,
    TIMEOUT,
    TOKEN_BUDGET,
    PoolInput,
    PoolLimits,
    PoolSettings,
    Range,
    SLOTargets,
    TunerConfig,
)

SLO = SLOTargets(ttft_p95_ms=500.0, itl_p95_ms=100.0)
# Rule tables look at one run: no stabilization window to cover, no anti-flap history.
ONE_SHOT = TunerConfig(knob_relax_stabilization_s=0.0, scale_down_stabilization_s=0.0, flap_window_s=0.0)


def latency(p95_ms: float | None, samples: float = 500.0) -> Quantiles:
    if p95_ms is None:
        return Quantiles(samples=samples)
    return Quantiles(p50=p95_ms / 2000.0, p95=p95_ms / 1000.0, p99=p95_ms * 1.2 / 1000.0, samples=samples)


def metrics(
    pool: str = "colocated",
    *,
    ttft_ms: float | None = 200.0,
    itl_ms: float | None = 90.0,
    queue_ms: float | None = 20.0,
    rate: float | None = 10.0,
    prompt_tps: float | None = 1000.0,
    prompt_p95: float | None = None,  # tokens; None: no prompt-length histogram (the token rates stand in)
    prefix_hits_tps: float | None = None,
    gen_tps: float | None = 200.0,
    waiting: float | None = 0.0,
    running: float | None = 8.0,
    kv_max: float | None = 0.2,
    preemptions: float | None = 0.0,
    mean_batch: float | None = 8.0,
    step_tokens: float | None = 12.0,
    step_ms: float | None = None,
    steps_per_s: float | None = None,
    growth: float | None = None,
    pods: int = 1,
    at: float = 1000.0,
    stale: bool = False,
    reason: str = "",
    missing: dict[str, str] | None = None,
) -> PoolMetrics:
    return PoolMetrics(
        pool=PoolRef("default", "svc", pool),
        at=at,
        window_s=60.0,
        ttft=latency(ttft_ms),
        itl=latency(itl_ms),
        queue_time=latency(queue_ms),
        prompt_length=Quantiles() if prompt_p95 is None else Quantiles(p95=prompt_p95, samples=500.0),
        request_rate=rate,
        prompt_tokens_per_s=prompt_tps,
        prefix_cache_hits_per_s=prefix_hits_tps,
        generation_tokens_per_s=gen_tps,
        preemptions_per_s=preemptions,
        steps_per_s=steps_per_s,
        waiting_growth_per_s=growth,
        waiting=waiting,
        running=running,
        kv_usage_mean=None if kv_max is None else kv_max / 2,
        kv_usage_max=kv_max,
        mean_batch_size=mean_batch,
        mean_step_tokens=step_tokens,
        mean_step_seconds=None if step_ms is None else step_ms / 1000.0,
        ready_pods=pods,
        newest_sample_age_s=1.0,
        stale=stale,
        reason=reason,
        missing=missing or {},
    )


def settings(replicas: int = 1, batch: float = 32, timeout: float = 20.0, budget: float = 512) -> PoolSettings:
    return PoolSettings(replicas, {MAX_BATCH: float(batch), TIMEOUT: float(timeout), TOKEN_BUDGET: float(budget)})


def limits(
    min_replicas: int = 1,
    max_replicas: int = 8,
    batch: tuple[float, float] = (1, 256),
    timeout: tuple[float, float] = (0, 100),
    budget: tuple[float, float] = (64, 16384),
) -> PoolLimits:
    return PoolLimits(
        min_replicas, max_replicas, {MAX_BATCH: Range(*batch), TIMEOUT: Range(*timeout), TOKEN_BUDGET: Range(*budget)}
    )


def pool_input(m: PoolMetrics, current: PoolSettings | None = None, lim: PoolLimits | None = None) -> PoolInput:
    return PoolInput(m, current or settings(), lim or limits())
