"""What the simulated fleet measures, and the tuner's view of it.

Two records, for two readers:

- ``RequestRecord``: every request's arrival and token times as its client saw them, for the
  report (SLO attainment per minute, goodput, latency percentiles).
- ``PoolSeries``: each pool's metrics as its servers export them (server/http/server_metrics.py: the
  same histogram buckets, TTFT and prompt tokens counted at the first token, ITL per token gap,
  queue time and prompt length at the finish, batch size and tokens per step), scraped every
  ``scrape_interval``. ``SimMetricSource`` turns scrapes into the tuner's ``PoolMetrics`` exactly
  as the direct-scrape source does: counter increases over the window, ``histogram_quantile``
  over bucket deltas (PromQL's interpolation, so the tuner sees bucketed quantiles as it would in
  a cluster), gauge means, and staleness when no pod reports.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field

from llmfleet.operator.metrics import promql
from llmfleet.operator.metrics.quantile import bucket_quantile
from llmfleet.operator.metrics.source import (
    EMPTY_MEAN,
    WIDEST,
    PoolMetrics,
    PoolRef,
    StalenessPolicy,
    judge_staleness,
    least_squares_slope,
    stale_snapshot,
    trusted_quantiles,
)
from llmfleet.server.metric_buckets import ITL_BUCKETS as SERVER_ITL_BUCKETS
from llmfleet.server.metric_buckets import REQUEST_BUCKETS, TTFT_BUCKETS, length_buckets

LATENCY_BUCKETS = {"ttft": TTFT_BUCKETS, "itl": SERVER_ITL_BUCKETS, "queue_time": REQUEST_BUCKETS}
COUNTERS = (
    "requests",
    "request_prompt_tokens",  # the finished requests' prompts (vllm:request_prompt_tokens's _sum)
    "prompt_tokens",
    "generation_tokens",
    "preemptions",
    "prefix_cache_hits",  # prompt tokens, as vllm:prefix_cache_hits
    "steps",
    "step_batch",
    "step_tokens",
    "step_seconds",
)


@dataclass
class RequestRecord:
    """One request as its client saw it. ``status``: finished, rejected (429 or 400 at the door),
    aborted (its pod was killed at the end of a drain) or unfinished (still running at the end)."""

    index: int
    arrival: float
    prompt_len: int
    output_len: int
    token_times: list[float] = field(default_factory=list)
    status: str = "unfinished"
    detail: str = ""
    pod: str = ""  # the pod that served it (the decode pod in disaggregated mode)
    dispatched_at: float | None = None  # when the router handed it to that pod
    held_s: float = 0.0  # how long the router held it for a pool with no ready pod (a start from zero)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (DistServe's TPOT); 0 for one-token outputs."""
        if len(self.token_times) < 2:
            return 0.0 if self.token_times else None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def e2e(self) -> float | None:
        return self.token_times[-1] - self.arrival if self.token_times else None


class Histogram:
    """A cumulative histogram with Prometheus ``le`` buckets."""

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = list(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last is +Inf

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1

    def cumulative(self) -> list[int]:
        out, total = [], 0
        for c in self.counts:
            total += c
            out.append(total)
        return out


@dataclass(frozen=True)
class Scrape:
    at: float
    counters: dict[str, float]
    buckets: dict[str, list[int]]  # cumulative counts per histogram, +Inf last
    waiting: float  # summed over the pool's reporting pods
    running: float
    kv_mean: float | None
    kv_max: float | None


@dataclass(frozen=True)
class PodGauges:
    waiting: int
    running: int
    kv_usage: float


_PRUNE_BATCH = 256


class PoolSeries:
    """One pool's exported metrics, summed over its pods (pods come and go; the sums never reset)."""

    def __init__(self, name: str, max_model_len: int | None = None) -> None:
        self.name = name
        self.counters = dict.fromkeys(COUNTERS, 0.0)
        self.histograms = {k: Histogram(b) for k, b in LATENCY_BUCKETS.items()}
        self.histograms["prompt_length"] = Histogram(length_buckets(max_model_len))
        self.scrapes: list[Scrape] = []
        self._scrape_times: list[float] = []
        # Scrapes are kept for the widest window the longest one asked may widen to, so a
        # week-long trace holds minutes of them, not a week.
        self._longest_window_s = 0.0

    # -- what the servers observe ---------------------------------------------------------------

    def first_token(self, ttft: float, prompt_len: int) -> None:
        self.histograms["ttft"].observe(ttft)
        self.counters["prompt_tokens"] += prompt_len
        self.counters["generation_tokens"] += 1

    def next_token(self, gap: float) -> None:
        self.histograms["itl"].observe(gap)
        self.counters["generation_tokens"] += 1

    def finished(self, queue_time: float | None, prompt_len: int) -> None:
        self.counters["requests"] += 1
        self.counters["request_prompt_tokens"] += prompt_len
        self.histograms["prompt_length"].observe(prompt_len)
        if queue_time is not None:
            self.histograms["queue_time"].observe(queue_time)

    def step(self, batch: int, tokens: int, seconds: float) -> None:
        self.counters["steps"] += 1
        self.counters["step_batch"] += batch
        self.counters["step_tokens"] += tokens
        self.counters["step_seconds"] += seconds

    def preempted(self, count: int) -> None:
        self.counters["preemptions"] += count

    def prefix_hit(self, tokens: int) -> None:
        self.counters["prefix_cache_hits"] += tokens

    # -- scrapes --------------------------------------------------------------------------------

    def scrape(self, at: float, pods: list[PodGauges]) -> None:
        kv = [p.kv_usage for p in pods]
        self.scrapes.append(
            Scrape(
                at=at,
                counters=dict(self.counters),
                buckets={k: h.cumulative() for k, h in self.histograms.items()},
                waiting=float(sum(p.waiting for p in pods)),
                running=float(sum(p.running for p in pods)),
                kv_mean=sum(kv) / len(kv) if kv else None,
                kv_max=max(kv) if kv else None,
            )
        )
        self._scrape_times.append(at)
        if self._longest_window_s:
            old = bisect_left(self._scrape_times, at - WIDEST * self._longest_window_s)
            if old > _PRUNE_BATCH:  # in batches: slicing the lists costs their length
                del self.scrapes[:old], self._scrape_times[:old]

    def window(self, now: float, window_s: float) -> list[Scrape]:
        """Scrapes from ``now - window_s`` to ``now``."""
        self._longest_window_s = max(self._longest_window_s, window_s)
        return self.scrapes[bisect_left(self._scrape_times, now - window_s - 1e-9) :]


class SimMetricSource:
    """``MetricSource`` over simulated pools: what the direct-scrape source would report."""

    def __init__(
        self,
        series: Callable[[str], PoolSeries],
        ready_pods: Callable[[str], int],
        clock: Callable[[], float],
        policy: StalenessPolicy | None = None,
    ) -> None:
        self._series = series
        self._ready = ready_pods
        self._clock = clock
        self.policy = policy or StalenessPolicy()

    async def snapshot(self, pool: PoolRef, window_s: float) -> PoolMetrics:
        return self.measure(pool, window_s)

    def measure(self, pool: PoolRef, window_s: float) -> PoolMetrics:
        now = self._clock()
        pods = self._ready(pool.pool)
        if pods <= 0:
            return stale_snapshot(pool, now, window_s, f"{pool.pool}: 0 pods reporting (none ready)")
        series = self._series(pool.pool)
        scrapes = series.window(now, window_s)
        if len(scrapes) < 2:
            return stale_snapshot(pool, now, window_s, f"{pool.pool}: fewer than two scrapes in the window")
        first, last = scrapes[0], scrapes[-1]
        span = last.at - first.at
        delta = {k: last.counters[k] - first.counters[k] for k in COUNTERS}
        missing: dict[str, str] = {}
        histograms = {}  # ttft, itl, queue_time and prompt_length, as PoolMetrics names them
        for name, histogram in series.histograms.items():
            d = [b - a for a, b in zip(first.buckets[name], last.buckets[name], strict=True)]
            samples = float(d[-1])
            pairs = [(le, float(c)) for le, c in zip([*histogram.bounds, float("inf")], d, strict=True)]
            quantiles = {q: bucket_quantile(q, pairs) if samples else None for q in promql.measured_quantiles(name)}
            histograms[name] = trusted_quantiles(name, quantiles, samples, self.policy, window_s, missing)
        steps, finished = delta["steps"], delta["requests"]
        observed = dict.fromkeys(("mean_batch_size", "mean_step_tokens", "mean_step_seconds"), steps)
        for name, count in (observed | {"prompt_tokens_per_request": finished}).items():
            if count <= 0:
                missing[name] = f"{name}: {EMPTY_MEAN[name]}"
        kv_means = [s.kv_mean for s in scrapes if s.kv_mean is not None]
        kv_maxes = [s.kv_max for s in scrapes if s.kv_max is not None]
        metrics = PoolMetrics(
            pool=pool,
            at=now,
            window_s=window_s,
            **histograms,
            request_rate=delta["requests"] / span,
            prompt_tokens_per_s=delta["prompt_tokens"] / span,
            generation_tokens_per_s=delta["generation_tokens"] / span,
            preemptions_per_s=delta["preemptions"] / span,
            prefix_cache_hits_per_s=delta["prefix_cache_hits"] / span,
            steps_per_s=steps / span,
            waiting_growth_per_s=least_squares_slope([(s.at, s.waiting) for s in scrapes]),
            waiting=sum(s.waiting for s in scrapes) / len(scrapes),
            running=sum(s.running for s in scrapes) / len(scrapes),
            kv_usage_mean=sum(kv_means) / len(kv_means) if kv_means else None,
            kv_usage_max=max(kv_maxes) if kv_maxes else None,
            mean_batch_size=delta["step_batch"] / steps if steps > 0 else None,
            mean_step_tokens=delta["step_tokens"] / steps if steps > 0 else None,
            mean_step_seconds=delta["step_seconds"] / steps if steps > 0 else None,
            prompt_tokens_per_request=delta["request_prompt_tokens"] / finished if finished > 0 else None,
            ready_pods=pods,
            newest_sample_age_s=max(0.0, now - last.at),
            missing=missing,
        )
        return judge_staleness(metrics, self.policy)
