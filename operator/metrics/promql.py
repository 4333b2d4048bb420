"""PromQL for one pool, as pure functions (the tuner's Prometheus source and the dashboards share them).

Every series carries ``namespace``, ``inference_service`` and ``pool`` (PodMonitor relabeling in a
cluster, static labels in the local fleet). Builders take a ready-made selector string so a
dashboard can pass Grafana variables (``namespace="$namespace",...``) and a window such as
``"1m"`` or ``"$__rate_interval"``; ``pool_selector`` and ``duration`` build them from a PoolRef
and seconds.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmfleet.operator.metrics.source import PoolRef

TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
QUEUE_TIME = "vllm:request_queue_time_seconds"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"  # in prompt tokens, as vLLM's
GENERATION_TOKENS = "vllm:generation_tokens_total"
REQUEST_SUCCESS = "vllm:request_success_total"
PREEMPTIONS = "vllm:num_preemptions_total"
BATCH_SHED = "llmfleet_batch_shed_total"  # a live decrease of max_batch_size; not KV pressure
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
BATCH_SIZE = "llmfleet_batch_size"
ITERATION_TOKENS = "vllm:iteration_tokens_total"
STEP_DURATION = "llmfleet_step_duration_seconds"
PROMPT_LENGTH = "vllm:request_prompt_tokens"  # per finished request

LATENCY_HISTOGRAMS = {"ttft": TTFT, "itl": ITL, "queue_time": QUEUE_TIME}
QUANTILE_HISTOGRAMS = {**LATENCY_HISTOGRAMS, "prompt_length": PROMPT_LENGTH}
QUANTILES = (0.5, 0.95, 0.99)  # what every source measures and the dashboards plot
# ... and between p95 and p99 where a projection reads a rarer tail (projection.itl_tail)
TAIL_QUANTILES = {"itl": (0.96, 0.97, 0.98)}


def measured_quantiles(name: str) -> tuple[float, ...]:
    """The quantiles a source measures of one histogram (a PoolMetrics field name), ascending."""
    return tuple(sorted((*QUANTILES, *TAIL_QUANTILES.get(name, ()))))


def quote(value: str) -> str:
    """A PromQL string literal."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def label_selector(labels: Mapping[str, str]) -> str:
    """``{a="x",b="y"}`` contents (without braces), sorted for stable output."""
    return ",".join(f"{name}={quote(value)}" for name, value in sorted(labels.items()))


def pool_selector(ref: PoolRef, extra: Mapping[str, str] | None = None) -> str:
    return label_selector({**ref.labels(), **(extra or {})})


def duration(window: float | str) -> str:
    """A range duration: seconds as ``60s`` (or ``1500ms``); strings pass through (``$__rate_interval``)."""
    if isinstance(window, str):
        return window
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    millis = round(window * 1000)
    return f"{millis // 1000}s" if millis % 1000 == 0 else f"{millis}ms"


def histogram_quantile(metric: str, q: float, selector: str, window: float | str) -> str:
    """The q-quantile of a histogram over the window, all pods of the pool merged."""
    return f"histogram_quantile({q:g}, sum by (le) (rate({metric}_bucket{{{selector}}}[{duration(window)}])))"


def histogram_observations(metric: str, selector: str, window: float | str) -> str:
    """How many observations the quantiles rest on (rate of _count times the window)."""
    return f"sum(increase({metric}_count{{{selector}}}[{duration(window)}]))"


def histogram_mean(metric: str, selector: str, window: float | str) -> str:
    w = duration(window)
    return f"sum(rate({metric}_sum{{{selector}}}[{w}])) / sum(rate({metric}_count{{{selector}}}[{w}]))"


def counter_rate(counter: str, selector: str, window: float | str) -> str:
    """Per-second rate summed over the pool's pods (and label variants such as finished_reason)."""
    return f"sum(rate({counter}{{{selector}}}[{duration(window)}]))"


def gauge_sum_mean(gauge: str, selector: str, window: float | str) -> str:
    """Each pod's mean over the window, summed over pods (queue lengths)."""
    return f"sum(avg_over_time({gauge}{{{selector}}}[{duration(window)}]))"


def gauge_avg_mean(gauge: str, selector: str, window: float | str) -> str:
    """Each pod's mean over the window, averaged over pods (utilisations)."""
    return f"avg(avg_over_time({gauge}{{{selector}}}[{duration(window)}]))"


def gauge_max(gauge: str, selector: str, window: float | str) -> str:
    return f"max(max_over_time({gauge}{{{selector}}}[{duration(window)}]))"


def gauge_growth(gauge: str, selector: str, window: float | str) -> str:
    """How fast a gauge rose over the window, per second, summed over pods (least squares, as ``deriv``)."""
    return f"sum(deriv({gauge}{{{selector}}}[{duration(window)}]))"


def pods_reporting(selector: str, fresh_s: float = 60.0) -> str:
    """Pods with a sample at most ``fresh_s`` old. Prometheus drops a vanished target's series via
    staleness markers, but a series cut off without them (Prometheus restarted after the pod went)
    would otherwise count for the whole 5-minute lookback."""
    return f"count(timestamp({RUNNING}{{{selector}}}) >= time() - {fresh_s:g})"


def newest_sample_time(selector: str) -> str:
    """Unix time of the pool's newest sample; the tuner compares it with the query time."""
    return f"max(timestamp({RUNNING}{{{selector}}}))"


def pool_queries(selector: str, window: float | str, fresh_s: float = 60.0) -> dict[str, str]:
    """Every query behind one PoolMetrics snapshot, keyed by field (quantiles as ``ttft:0.95``);
    pods count as reporting with a sample at most ``fresh_s`` old."""
    queries: dict[str, str] = {}
    for name, metric in QUANTILE_HISTOGRAMS.items():
        for q in measured_quantiles(name):
            queries[f"{name}:{q:g}"] = histogram_quantile(metric, q, selector, window)
        queries[f"{name}:samples"] = histogram_observations(metric, selector, window)
    queries |= {
        "request_rate": counter_rate(REQUEST_SUCCESS, selector, window),
        "prompt_tokens_per_s": counter_rate(PROMPT_TOKENS, selector, window),
        "prefix_cache_hits_per_s": counter_rate(PREFIX_CACHE_HITS, selector, window),
        "generation_tokens_per_s": counter_rate(GENERATION_TOKENS, selector, window),
        "preemptions_per_s": counter_rate(PREEMPTIONS, selector, window),
        "steps_per_s": counter_rate(f"{BATCH_SIZE}_count", selector, window),
        "waiting_growth_per_s": gauge_growth(WAITING, selector, window),
        "waiting": gauge_sum_mean(WAITING, selector, window),
        "running": gauge_sum_mean(RUNNING, selector, window),
        "kv_usage_mean": gauge_avg_mean(KV_USAGE, selector, window),
        "kv_usage_max": gauge_max(KV_USAGE, selector, window),
        "mean_batch_size": histogram_mean(BATCH_SIZE, selector, window),
        "mean_step_tokens": histogram_mean(ITERATION_TOKENS, selector, window),
        "mean_step_seconds": histogram_mean(STEP_DURATION, selector, window),
        "prompt_tokens_per_request": histogram_mean(PROMPT_LENGTH, selector, window),
        "ready_pods": pods_reporting(selector, fresh_s),
        "newest_sample": newest_sample_time(selector),
    }
    return queries
