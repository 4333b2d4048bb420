"""What the tuner reads about one pool, and the interface every metric source implements.

Two sources implement ``MetricSource``: ``PrometheusSource`` (PromQL over Prometheus's HTTP API,
prometheus.py) and ``ScrapeSource`` (the pods' own ``/metrics``, scrape.py). Both
return a ``PoolMetrics`` snapshot over a trailing window.

Missing data is never read as zero. A value that could not be measured is ``None`` and
``missing[field]`` says why (no series, no requests in the window, too few samples). A snapshot
the tuner must not act on at all (no pod reporting, samples too old, the source unreachable) has
``stale=True`` and a ``reason``. A zero is a measured zero: the counters exist and did not move.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

LATENCY_FIELDS = ("ttft", "itl", "queue_time")
QUANTILE_FIELDS = (*LATENCY_FIELDS, "prompt_length")  # histograms read as quantiles
RATE_FIELDS = (
    "request_rate",
    "prompt_tokens_per_s",
    "prefix_cache_hits_per_s",
    "generation_tokens_per_s",
    "preemptions_per_s",
    "steps_per_s",
    "waiting_growth_per_s",
)
LOAD_FIELDS = (
    "waiting",
    "running",
    "kv_usage_mean",
    "kv_usage_max",
    "mean_batch_size",
    "mean_step_tokens",
    "mean_step_seconds",
    "prompt_tokens_per_request",
)
# Histogram means (sum over count): what a window without observations means for each.
EMPTY_MEAN = {
    "mean_batch_size": "no engine steps in the window",
    "mean_step_tokens": "no engine steps in the window",
    "mean_step_seconds": "no engine steps in the window",
    "prompt_tokens_per_request": "no request finished in the window",
}


@dataclass(frozen=True)
class PoolRef:
    """One pool of one InferenceService; in Prometheus its series carry these three labels."""

    namespace: str
    inference_service: str
    pool: str  # colocated | prefill | decode

    def labels(self) -> dict[str, str]:
        return {"namespace": self.namespace, "inference_service": self.inference_service, "pool": self.pool}

    def __str__(self) -> str:
        return f"{self.namespace}/{self.inference_service}/{self.pool}"


@dataclass(frozen=True)
class StalenessPolicy:
    """When a snapshot, or one of its quantiles, is too thin to act on."""

    max_sample_age_s: float = 60.0  # newest sample older than this: stale
    min_samples: int = 20  # a p95 resting on fewer observations is reported as missing
    min_pods: int = 1  # fewer pods reporting than this: stale


@dataclass(frozen=True)
class Quantiles:
    """Windowed quantiles of one histogram (latencies in seconds, prompt lengths in tokens), and how
    many observations they rest on."""

    p50: float | None = None
    p95: float | None = None
    p99: float | None = None
    samples: float | None = None  # observations in the window (increase of the histogram's _count)
    between: tuple[tuple[float, float], ...] = ()  # (q, value) measured between p95 and p99, ascending

    @property
    def known(self) -> bool:
        return self.p95 is not None


@dataclass(frozen=True)
class PoolMetrics:
    """A pool's behaviour over the trailing ``window_s`` seconds, as of ``at`` (unix seconds).

    Latencies are seconds. ``waiting`` and ``running`` are summed over pods (mean over the window
    where the source can average); ``kv_usage_*`` are fractions 0..1; ``mean_batch_size`` is the
    running sequences per engine step, ``mean_step_tokens`` the tokens per step and
    ``mean_step_seconds`` the time per step, per pod. ``waiting_growth_per_s`` is how fast the
    queue grew over the window (requests/s, summed over pods; negative while it drains): arrivals
    the pool did not keep up with, which served throughput does not show.
    """

    pool: PoolRef
    at: float
    window_s: float
    ttft: Quantiles = field(default_factory=Quantiles)
    itl: Quantiles = field(default_factory=Quantiles)
    queue_time: Quantiles = field(default_factory=Quantiles)
    prompt_length: Quantiles = field(default_factory=Quantiles)  # tokens, per finished request
    request_rate: float | None = None  # finished requests/s
    prompt_tokens_per_s: float | None = None
    prefix_cache_hits_per_s: float | None = None  # prompt tokens a prefix-cache hit covered
    generation_tokens_per_s: float | None = None
    preemptions_per_s: float | None = None
    steps_per_s: float | None = None  # engine steps, summed over pods
    waiting_growth_per_s: float | None = None
    waiting: float | None = None
    running: float | None = None
    kv_usage_mean: float | None = None
    kv_usage_max: float | None = None
    mean_batch_size: float | None = None
    mean_step_tokens: float | None = None
    mean_step_seconds: float | None = None
    prompt_tokens_per_request: float | None = None  # mean prompt of the requests finished in the window
    ready_pods: int | None = None  # pods whose series are in the snapshot
    newest_sample_age_s: float | None = None
    latency_window_s: float | None = None  # set where the latency quantiles come from a wider window
    # The SLO's own window (spec.slo.windowSeconds), where longer than the latencies': a p95 is
    # judged over it, so replica decisions read these; None: the same as ttft and itl.
    slo_window_s: float | None = None
    slo_ttft: Quantiles | None = None
    slo_itl: Quantiles | None = None
    stale: bool = False
    reason: str = ""
    missing: dict[str, str] = field(default_factory=dict)  # field -> why it is None

    @property
    def usable(self) -> bool:
        return not self.stale

    @property
    def judged_ttft(self) -> Quantiles:
        """TTFT over the SLO's window (the p95 the SLO is judged on)."""
        return self.slo_ttft if self.slo_ttft is not None and self.slo_ttft.known else self.ttft

    @property
    def judged_itl(self) -> Quantiles:
        return self.slo_itl if self.slo_itl is not None and self.slo_itl.known else self.itl

    @property
    def judged_window_s(self) -> float:
        """The window the latencies are judged over: the SLO's, or the latencies' where they were
        widened past it (a quantile the SLO's window holds too few of falls back to theirs)."""
        return max(self.slo_window_s or 0.0, self.latency_window_s or self.window_s)

    def why_missing(self, name: str) -> str:
        return self.missing.get(name, f"{name} not measured")

    def computed_prompt_tokens_per_s(self) -> float | None:
        """Prompt tokens the pods computed per second: the steps' tokens beyond one per sequence,
        as the step plane counts them. ``prompt_tokens_per_s`` also counts tokens a prefix-cache
        hit covered and, on a decode server, the whole prompt whose KV came from a prefill server;
        without step counts it stands in."""
        steps, tokens, seqs = self.steps_per_s, self.mean_step_tokens, self.mean_batch_size
        if steps is None or tokens is None or seqs is None:
            return self.prompt_tokens_per_s
        return steps * max(tokens - seqs, 0.0)

    def uncached_prompt_tokens_per_s(self) -> float | None:
        """Prompt tokens/s less those a prefix-cache hit covered: the prompt work the pool's
        demand is (vllm:prompt_tokens_total counts the hits too). Counted as the prompt counter
        counts, when requests are admitted, unlike the step counts above."""
        if self.prompt_tokens_per_s is None:
            return None
        return max(self.prompt_tokens_per_s - (self.prefix_cache_hits_per_s or 0.0), 0.0)

    def mean_prompt_tokens(self) -> float | None:
        """Average prompt length over the window: the prompts of the requests that finished in it
        (``vllm:request_prompt_tokens``). Without that histogram, the prompt token rate over the
        finished-request rate stands in; it reads high while load rises, since prompt tokens are
        counted when a prompt runs and requests when they finish (low while load falls)."""
        if self.prompt_tokens_per_request is not None:
            return self.prompt_tokens_per_request
        if self.prompt_tokens_per_s is None or not self.request_rate:
            return None
        return self.prompt_tokens_per_s / self.request_rate

    def computed_prompt_tokens_per_request(self) -> float | None:
        """The prompt tokens the pods computed for a mean request: its prompt less the share a
        prefix-cache hit or a prefill server's KV covered (the computed prompt tokens over all
        prompt tokens, both counted as prompts run)."""
        computed = self.computed_prompt_tokens_per_s()
        if computed is None:
            return None
        if self.prompt_tokens_per_request is not None and self.prompt_tokens_per_s:
            return self.prompt_tokens_per_request * min(1.0, computed / self.prompt_tokens_per_s)
        return computed / self.request_rate if self.request_rate else None

    def with_staleness(self, stale: bool, reason: str) -> PoolMetrics:
        return replace(self, stale=stale, reason=reason)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, non-finite numbers as None (for status ``inputs`` and logs)."""
        return _json_safe(asdict(self))

    def summary(self) -> dict[str, Any]:
        """The numbers a decision cites, in milliseconds and per second, rounded for status."""

        def ms(value: float | None) -> float | None:
            return None if value is None else round(value * 1000.0, 1)

        def rounded(value: float | None, digits: int = 2) -> float | None:
            return None if value is None else round(value, digits)

        judged = {}
        if self.slo_window_s:
            judged = {
                "sloWindowS": self.slo_window_s,
                "ttftP95OverSloWindowMs": ms(self.judged_ttft.p95),
                "itlP95OverSloWindowMs": ms(self.judged_itl.p95),
            }
        return {
            "ttftP95Ms": ms(self.ttft.p95),
            "itlP95Ms": ms(self.itl.p95),
            "queueP95Ms": ms(self.queue_time.p95),
            "requestRate": rounded(self.request_rate),
            "promptTokensPerS": rounded(self.prompt_tokens_per_s, 1),
            **({"prefixCacheHitsPerS": rounded(hits, 1)} if (hits := self.prefix_cache_hits_per_s) else {}),
            "generationTokensPerS": rounded(self.generation_tokens_per_s, 1),
            "waiting": rounded(self.waiting),
            "waitingGrowthPerS": rounded(self.waiting_growth_per_s, 3),
            "running": rounded(self.running),
            "kvUsageMax": rounded(self.kv_usage_max, 3),
            "meanBatchSize": rounded(self.mean_batch_size),
            "meanStepMs": ms(self.mean_step_seconds),
            "readyPods": self.ready_pods,
            **({"latencyWindowS": self.latency_window_s} if self.latency_window_s else {}),
            **judged,
            "stale": self.stale,
            **({"reason": self.reason} if self.reason else {}),
        }


@runtime_checkable
class MetricSource(Protocol):
    """Anything that can measure a pool over a trailing window."""

    async def snapshot(self, pool: PoolRef, window_s: float) -> PoolMetrics: ...


def stale_snapshot(pool: PoolRef, at: float, window_s: float, reason: str) -> PoolMetrics:
    """A snapshot that carries nothing but why it is unusable."""
    return PoolMetrics(pool=pool, at=at, window_s=window_s, stale=True, reason=reason)


def finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def trusted_quantiles(
    name: str,
    quantiles: dict[float, float | None],
    samples: float | None,
    policy: StalenessPolicy,
    window_s: float,
    missing: dict[str, str],
) -> Quantiles:
    """Keep a histogram's quantiles only when enough observations back them; say why otherwise."""
    if samples is None:
        missing[name] = f"{name}: no histogram series"
        return Quantiles()
    if samples < policy.min_samples:
        missing[name] = f"{name}: {samples:.0f} observations in the {window_s:.0f} s window (< {policy.min_samples})"
        return Quantiles(samples=samples)
    values = {q: finite_or_none(v) for q, v in quantiles.items()}
    if values.get(0.95) is None:
        missing[name] = f"{name}: quantile undefined (no observations in the window)"
        return Quantiles(samples=samples)
    between = tuple((q, v) for q, v in sorted(values.items()) if 0.95 < q < 0.99 and v is not None)
    return Quantiles(p50=values.get(0.5), p95=values.get(0.95), p99=values.get(0.99), samples=samples, between=between)


def judge_staleness(metrics: PoolMetrics, policy: StalenessPolicy) -> PoolMetrics:
    """Mark a snapshot stale when no or too few pods report, or its newest sample is too old."""
    if metrics.stale:
        return metrics
    if metrics.ready_pods is None or metrics.ready_pods < policy.min_pods:
        pods = 0 if metrics.ready_pods is None else metrics.ready_pods
        return metrics.with_staleness(True, f"{metrics.pool.pool}: {pods} pods reporting (< {policy.min_pods})")
    if metrics.newest_sample_age_s is None:
        return metrics.with_staleness(True, f"{metrics.pool.pool}: age of the newest sample unknown")
    if metrics.newest_sample_age_s > policy.max_sample_age_s:
        return metrics.with_staleness(
            True,
            f"{metrics.pool.pool}: newest sample {metrics.newest_sample_age_s:.0f} s old "
            f"(> {policy.max_sample_age_s:.0f} s)",
        )
    return metrics


def least_squares_slope(points: Sequence[tuple[float, float]]) -> float | None:
    """Slope of (time, value) points by least squares, as PromQL's ``deriv``; None under two times."""
    if len({t for t, _ in points}) < 2:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / spread


def _json_safe(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


WIDEST = 4.0  # how many times its window a sparse pool's latency window may widen to


async def snapshot_widening_latency(
    source: MetricSource, pool: PoolRef, window_s: float, slo_window_s: float | None = None, widest: float = WIDEST
) -> PoolMetrics:
    """``source``'s snapshot over ``window_s``; where a latency quantile rests on too few
    observations (a pool that sees few requests, each long), the latency quantiles (and the
    prompt lengths') come from the window doubled, up to ``widest`` times, instead of the tuner
    going without them. Not for a pool that is idle now: the quantiles of traffic that has ended
    say nothing of what it needs. Rates and gauges stay those of ``window_s``. With an SLO window
    longer than ``window_s``, TTFT and ITL over it come along as ``slo_ttft`` and ``slo_itl``:
    a widening takes only the quantiles that were short, so an ITL measured over ``window_s``
    beside a TTFT widened to the SLO's window is still a shorter window's p95."""
    m = await source.snapshot(pool, window_s)
    wide, over_slo_window = window_s, None
    idle = not (m.request_rate or m.running or m.waiting)  # its latencies would be history, not sparse
    while not m.stale and not idle and _too_few(m) and wide < widest * window_s:
        wide *= 2
        wider = await source.snapshot(pool, wide)
        if wider.stale:
            break
        if wide == slo_window_s:
            over_slo_window = wider
        took = {k: getattr(wider, k) for k in QUANTILE_FIELDS if not getattr(m, k).known and getattr(wider, k).known}
        if took:
            missing = {k: v for k, v in m.missing.items() if k not in took}
            m = replace(m, **took, missing=missing, latency_window_s=wide)
    if not m.stale and slo_window_s is not None and slo_window_s > window_s:
        judged = over_slo_window or await source.snapshot(pool, slo_window_s)
        if not judged.stale:
            m = replace(m, slo_window_s=slo_window_s, slo_ttft=judged.ttft, slo_itl=judged.itl)
    return m


def _too_few(m: PoolMetrics) -> bool:
    return any("observations in the" in m.missing.get(k, "") for k in ("ttft", "itl"))
