"""Pool metrics from the pods' own ``/metrics`` (the local fleet, clusters without Prometheus).

Each snapshot scrapes every pod of the pool and keeps the scrape. Windowed numbers come from a
pod's scrapes since the one closest to ``window_s`` ago: counter rates, and histogram quantiles
from bucket deltas with PromQL's interpolation (quantile.py). Gauges are averaged over
the pod's scrapes inside the window.

- Counter resets: each step between two kept scrapes is judged alone, as Prometheus's ``rate``
  does: a value that went down, or a series created (``_created``) after the earlier scrape,
  counts from zero there, and what the pod counted before its restart still counts.
- Pods appearing: a pod with no earlier scrape counts from its series' creation time when that
  lies inside the window (its whole life is in the window); otherwise it has no rate yet.
- Pods not counted (first seen without a creation time in the window, or failing to answer while
  still a target) are covered by the others: summed rates and gauges are scaled up to every
  target by the counted pods' mean, as a balanced router makes them alike. Reading their share as
  zero would look like less demand exactly when a pod is too busy to answer. ``missing["coverage"]``
  says so. Fewer than ``min_reporting_fraction`` of the targets answering makes the snapshot stale.
- Pods disappearing (a scale-down, a pod moved): what they counted inside the window still counts,
  spread over the window, as Prometheus keeps a removed target's samples until they age out.
- The first snapshot of a pool has nothing to difference against and is stale.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from llmfleet.operator.metrics import promql
from llmfleet.operator.metrics.quantile import bucket_deltas, bucket_quantile, parse_le
from llmfleet.operator.metrics.source import (
    EMPTY_MEAN,
    PoolMetrics,
    PoolRef,
    StalenessPolicy,
    judge_staleness,
    least_squares_slope,
    stale_snapshot,
    trusted_quantiles,
)

Targets = Mapping[PoolRef, Sequence[str]] | Callable[[PoolRef], Sequence[str]]
COUNTER_FIELDS = {
    "request_rate": promql.REQUEST_SUCCESS,
    "prompt_tokens_per_s": promql.PROMPT_TOKENS,
    "prefix_cache_hits_per_s": promql.PREFIX_CACHE_HITS,
    "generation_tokens_per_s": promql.GENERATION_TOKENS,
    "preemptions_per_s": promql.PREEMPTIONS,
    "steps_per_s": f"{promql.BATCH_SIZE}_count",
}
HISTOGRAM_MEANS = {
    "mean_batch_size": promql.BATCH_SIZE,
    "mean_step_tokens": promql.ITERATION_TOKENS,
    "mean_step_seconds": promql.STEP_DURATION,
    "prompt_tokens_per_request": promql.PROMPT_LENGTH,
}


@dataclass(frozen=True)
class PodScrape:
    """One pod's exposition at one time, label variants summed (a pod serves one model and role)."""

    at: float
    counters: dict[str, float] = field(default_factory=dict)  # *_total, histogram *_count and *_sum
    gauges: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)  # histogram -> le -> cumulative
    created: dict[str, float] = field(default_factory=dict)  # family -> earliest _created of its series


def parse_exposition(text: str, at: float) -> PodScrape:
    """Parse the Prometheus text format into a PodScrape."""
    scrape = PodScrape(at=at)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, value = sample.name, float(sample.value)
            if name.endswith("_created"):
                base = name.removesuffix("_created")
                scrape.created[base] = min(value, scrape.created.get(base, value))
            elif family.type == "histogram" and name.endswith("_bucket"):
                if "le" not in sample.labels:
                    raise ValueError(f"{name} has a bucket without an le label")
                le = parse_le(sample.labels["le"])
                per_le = scrape.buckets.setdefault(family.name, {})
                per_le[le] = per_le.get(le, 0.0) + value
            elif family.type in ("counter", "histogram", "summary"):
                scrape.counters[name] = scrape.counters.get(name, 0.0) + value
            elif family.type == "gauge":
                scrape.gauges[name] = scrape.gauges.get(name, 0.0) + value
    return scrape


def family_of(sample_name: str) -> str:
    for suffix in ("_total", "_count", "_sum"):
        if sample_name.endswith(suffix):
            return sample_name.removesuffix(suffix)
    return sample_name


@dataclass(frozen=True)
class Baseline:
    """Where a pod's window starts: an earlier scrape, or nothing at the series' creation time."""

    at: float
    scrapes: tuple[PodScrape, ...] = ()  # the baseline scrape, then the later kept ones; (): from zero

    @property
    def scrape(self) -> PodScrape | None:
        return self.scrapes[0] if self.scrapes else None


def pick_baseline(
    history: Iterable[PodScrape], current: PodScrape, window_s: float, min_gap_s: float
) -> Baseline | None:
    """The earlier scrape closest to ``window_s`` before ``current`` (older ones up to 2x the window
    when nothing fits), else the creation time of the pod's series when it lies inside the window."""
    earlier = sorted((s for s in history if current.at - s.at >= min_gap_s), key=lambda s: s.at)
    inside = [s for s in earlier if current.at - s.at <= window_s]
    older = [s for s in earlier if current.at - s.at <= 2 * window_s]
    start = inside[0] if inside else older[-1] if older else None
    if start is not None:
        return Baseline(start.at, tuple(s for s in earlier if s.at >= start.at))
    born = min(current.created.values(), default=None)  # the pod's first series: its start
    if born is not None and current.at - window_s <= born <= current.at - min_gap_s:
        return Baseline(born)
    return None


def _restarted(family: str, earlier: PodScrape, later: PodScrape) -> bool:
    created = later.created.get(family)
    return created is not None and created > earlier.at


def counter_delta(name: str, current: PodScrape, baseline: Baseline) -> float | None:
    """Increase of one counter since the baseline, over every kept scrape in between: a step
    that went down, or whose series was created after the earlier scrape, counts from zero.
    None: no such series."""
    if name not in current.counters:
        return None
    points = [s for s in (*baseline.scrapes, current) if name in s.counters]
    total = 0.0 if points[0] is baseline.scrape else points[0].counters[name]  # a series born since
    for earlier, later in itertools.pairwise(points):
        before, value = earlier.counters[name], later.counters[name]
        reset = value < before or _restarted(family_of(name), earlier, later)
        total += value if reset else value - before
    return total


def histogram_delta(name: str, current: PodScrape, baseline: Baseline) -> dict[float, float] | None:
    """Observations per bucket since the baseline, resets judged step by step as counters are."""
    if name not in current.buckets:
        return None
    points = [s for s in (*baseline.scrapes, current) if name in s.buckets]
    total = {} if points[0] is baseline.scrape else dict(points[0].buckets[name])
    for earlier, later in itertools.pairwise(points):
        before = None if _restarted(name, earlier, later) else earlier.buckets[name]
        for le, count in bucket_deltas(later.buckets[name], before).items():
            total[le] = total.get(le, 0.0) + count
    return total


@dataclass(frozen=True)
class PodWindow:
    """What one pod counted in the window: from its baseline to its last scrape, over ``span_s``
    (up to now for a pod that has gone, whose traffic the others took over)."""

    last: PodScrape
    baseline: Baseline
    span_s: float


class ScrapeSource:
    """``MetricSource`` that scrapes the pods itself; give it the pods' /metrics URLs per pool."""

    def __init__(
        self,
        targets: Targets,
        *,
        client: httpx.AsyncClient | None = None,
        policy: StalenessPolicy | None = None,
        clock: Callable[[], float] = time.time,
        timeout_s: float = 3.0,
        min_gap_s: float = 1.0,
        min_reporting_fraction: float = 0.5,
    ) -> None:
        self._targets = targets
        self.policy = policy or StalenessPolicy()
        self._clock = clock
        self._own_client = client is None
        self._client = client or httpx.AsyncClient(timeout=timeout_s)
        self._min_gap_s = min_gap_s
        self._min_fraction = min_reporting_fraction
        self._history: dict[PoolRef, dict[str, deque[PodScrape]]] = {}
        self._longest_window_s = 0.0  # history is kept for the longest window asked (the SLO's, a widened one)

    async def aclose(self) -> None:
        if self._own_client:
            await self._client.aclose()

    def targets(self, pool: PoolRef) -> list[str]:
        found = self._targets(pool) if callable(self._targets) else self._targets.get(pool, ())
        return list(dict.fromkeys(found))

    async def scrape(self, url: str) -> PodScrape:
        response = await self._client.get(url)
        response.raise_for_status()
        return parse_exposition(response.text, self._clock())

    async def snapshot(self, pool: PoolRef, window_s: float) -> PoolMetrics:
        now = self._clock()
        urls = self.targets(pool)
        if not urls:
            return stale_snapshot(pool, now, window_s, f"{pool.pool}: no pods to scrape")
        history = self._history.setdefault(pool, {})
        self._longest_window_s = max(self._longest_window_s, window_s)
        keep_s = 2 * self._longest_window_s + self._min_gap_s
        for url in [u for u, kept in history.items() if u not in urls and (not kept or now - kept[-1].at > keep_s)]:
            del history[url]  # gone, and older than any window
        # A second snapshot of the same run (another window) reads the scrape just taken.
        current = {
            url: history[url][-1] for url in urls if history.get(url) and now - history[url][-1].at < self._min_gap_s
        }
        to_scrape = [url for url in urls if url not in current]
        results = await asyncio.gather(*(self.scrape(url) for url in to_scrape), return_exceptions=True)
        fresh: dict[str, PodScrape] = {}
        failed: list[str] = []
        for url, result in zip(to_scrape, results, strict=True):
            if isinstance(result, httpx.HTTPError | ValueError):
                failed.append(f"{url}: {result!r}")
            elif isinstance(result, BaseException):
                raise result
            else:
                fresh[url] = result
        current |= fresh
        windows: dict[str, PodWindow] = {}
        for url, scrape in current.items():
            baseline = pick_baseline(
                [s for s in history.get(url, ()) if s is not scrape], scrape, window_s, self._min_gap_s
            )
            if baseline is not None:
                windows[url] = PodWindow(scrape, baseline, scrape.at - baseline.at)
        gone = {url: kept for url, kept in history.items() if url not in urls and kept}
        for url, kept in gone.items():
            *earlier, last = kept
            baseline = pick_baseline(earlier, last, window_s - (now - last.at), self._min_gap_s)
            if baseline is not None and baseline.scrape is not None:
                windows[url] = PodWindow(last, baseline, now - baseline.at)
        for url, scrape in fresh.items():
            pod_history = history.setdefault(url, deque())
            pod_history.append(scrape)
            while pod_history and scrape.at - pod_history[0].at > keep_s:
                pod_history.popleft()
        return self._assemble(pool, now, window_s, urls, current, windows, history, failed)

    def _assemble(
        self,
        pool: PoolRef,
        now: float,
        window_s: float,
        urls: list[str],
        current: dict[str, PodScrape],
        windows: dict[str, PodWindow],
        history: dict[str, deque[PodScrape]],
        failed: list[str],
    ) -> PoolMetrics:
        if not current:
            return stale_snapshot(pool, now, window_s, f"{pool.pool}: no pod answered: {'; '.join(failed)}")
        if len(current) < self._min_fraction * len(urls):
            answered = f"only {len(current)} of {len(urls)} pods answered"
            return stale_snapshot(pool, now, window_s, f"{pool.pool}: {answered}: {'; '.join(failed)}")
        counted = [url for url in current if url in windows]
        if not counted:
            return stale_snapshot(
                pool, now, window_s, f"{pool.pool}: first scrape of every pod; rates need an earlier scrape"
            )
        missing: dict[str, str] = {}
        uncounted = len(current) - len(counted)
        if uncounted or failed:
            notes = [f"{uncounted} pod(s) first seen now"] if uncounted else []
            notes += [f"{len(failed)} pod(s) failed to answer"] if failed else []
            missing["coverage"] = "; ".join(notes) + f": rates scaled from the {len(counted)} counted"
        rates = _Rates(windows, counted, scale=len(urls) / len(counted))

        fields: dict[str, object] = {}
        for name, counter in COUNTER_FIELDS.items():
            fields[name] = rates.summed(counter, name, missing)
        for name, histogram in promql.QUANTILE_HISTOGRAMS.items():
            buckets, samples = rates.merged_buckets(histogram)
            quantiles = {q: bucket_quantile(q, buckets) if buckets else None for q in promql.measured_quantiles(name)}
            fields[name] = trusted_quantiles(name, quantiles, samples, self.policy, window_s, missing)
        for name, histogram in HISTOGRAM_MEANS.items():
            fields[name] = rates.mean(histogram, name, missing)
        fields |= _gauges(current, history, now, window_s, missing, scale=len(urls) / len(current))
        metrics = PoolMetrics(
            pool=pool,
            at=now,
            window_s=window_s,
            ready_pods=len(urls),
            newest_sample_age_s=max(0.0, now - max(s.at for s in current.values())),
            missing=missing,
            **fields,  # type: ignore[arg-type]
        )
        return judge_staleness(metrics, self.policy)


@dataclass(frozen=True)
class _Rates:
    """Windowed sums over the pods: the counted targets' scaled up to every target, plus what pods
    that have gone counted in the window."""

    windows: dict[str, PodWindow]
    counted: list[str]  # targets with a window
    scale: float  # targets / counted targets

    def _weight(self, url: str) -> float:
        return self.scale if url in self.counted else 1.0

    def summed(self, counter: str, name: str, missing: dict[str, str]) -> float | None:
        total, seen = 0.0, False
        for url, w in self.windows.items():
            delta = counter_delta(counter, w.last, w.baseline)
            if delta is not None:
                total += self._weight(url) * delta / w.span_s
                seen = True
        if not seen:
            missing[name] = f"{name}: no series {counter}"
            return None
        return total

    def merged_buckets(self, histogram: str) -> tuple[dict[float, float], float | None]:
        """Observations per bucket and their count: quantiles need no scaling."""
        merged: dict[float, float] = {}
        samples: float | None = None
        for w in self.windows.values():
            delta = histogram_delta(histogram, w.last, w.baseline)
            if delta is None:
                continue
            for le, count in delta.items():
                merged[le] = merged.get(le, 0.0) + count
            samples = (samples or 0.0) + (counter_delta(f"{histogram}_count", w.last, w.baseline) or 0.0)
        return merged, samples

    def mean(self, histogram: str, name: str, missing: dict[str, str]) -> float | None:
        total = count = 0.0
        seen = False
        for w in self.windows.values():
            sum_delta = counter_delta(f"{histogram}_sum", w.last, w.baseline)
            count_delta = counter_delta(f"{histogram}_count", w.last, w.baseline)
            if sum_delta is not None and count_delta is not None:
                total, count, seen = total + sum_delta, count + count_delta, True
        if not seen:
            missing[name] = f"{name}: no series {histogram}"
            return None
        if count <= 0:
            missing[name] = f"{name}: {EMPTY_MEAN[name]}"
            return None
        return total / count


def _gauges(
    current: dict[str, PodScrape],
    history: dict[str, deque[PodScrape]],
    now: float,
    window_s: float,
    missing: dict[str, str],
    scale: float = 1.0,
) -> dict[str, float | None]:
    """Per pod: the mean of its scrapes inside the window (and the queue's growth over them); then
    summed (scaled up to every target) or averaged over pods."""
    per_pod: dict[str, dict[str, list[float]]] = {}
    growth: list[float] = []
    for url in current:
        inside = [s for s in history.get(url, ()) if now - s.at <= window_s]
        for gauge in (promql.WAITING, promql.RUNNING, promql.KV_USAGE):
            values = [s.gauges[gauge] for s in inside if gauge in s.gauges]
            if values:
                per_pod.setdefault(gauge, {})[url] = values
        slope = least_squares_slope([(s.at, s.gauges[promql.WAITING]) for s in inside if promql.WAITING in s.gauges])
        if slope is not None:
            growth.append(slope)
    out: dict[str, float | None] = {}

    def means(gauge: str) -> list[float]:
        return [sum(v) / len(v) for v in per_pod.get(gauge, {}).values()]

    for name, gauge in (("waiting", promql.WAITING), ("running", promql.RUNNING)):
        values = means(gauge)
        out[name] = scale * sum(values) if values else None
    kv = means(promql.KV_USAGE)
    out["kv_usage_mean"] = sum(kv) / len(kv) if kv else None
    all_kv = [x for v in per_pod.get(promql.KV_USAGE, {}).values() for x in v]
    out["kv_usage_max"] = max(all_kv) if all_kv else None
    for name, value in out.items():
        if value is None:
            missing[name] = f"{name}: no gauge series"
    out["waiting_growth_per_s"] = scale * sum(growth) if growth else None
    if not growth:
        missing["waiting_growth_per_s"] = "waiting_growth_per_s: fewer than two scrapes in the window"
    return out
