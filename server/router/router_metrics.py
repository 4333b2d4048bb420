"""The router's metrics: latency as the client sees it, under vLLM's names with ``role="router"``
(TTFT, ITL and end-to-end latency, finished requests by reason), and its own ``llmfleet_router_*``
series: retries per pool, prefills the decode servers did themselves, streams cut by a failure,
requests held for a pool with no server (now, in all, refused) and the cold starts they waited
through.

Token counters stay at zero here: the prefill and decode servers count the tokens, and a fleet sum
must not count them twice."""

from __future__ import annotations

import time

from prometheus_client import Counter, Gauge, Histogram

from llmfleet.server.http.server_metrics import ServerMetrics
from llmfleet.server.metric_buckets import COLD_START_BUCKETS

HOLD_REFUSALS = ("full", "timeout")  # too many held already; no server came within the hold timeout


class RouterMetrics(ServerMetrics):
    ENGINE_INDEX = None  # no engine here: no vLLM engine label

    def __init__(self, model_name: str, pools: tuple[str, ...] = ("prefill", "decode")) -> None:
        super().__init__(model_name, "router")
        names = list(self.labels)
        self.retries = Counter(
            "llmfleet_router_retries",
            "Requests sent again after a server failed.",
            [*names, "pool"],
            registry=self.registry,
        )
        self.fallbacks = Counter(
            "llmfleet_router_local_prefills",
            "Requests whose decode server computed the prompt itself (no prefill server could).",
            names,
            registry=self.registry,
        )
        self.broken_streams = Counter(
            "llmfleet_router_broken_streams",
            "Streams ended with an error event after a server failed.",
            names,
            registry=self.registry,
        )
        self.held_now = Gauge(
            "llmfleet_router_held_requests",
            "Requests waiting for a server of a pool that has none (scaled to zero, or a rollout's gap).",
            names,
            registry=self.registry,
        )
        self.held_total = Counter(
            "llmfleet_router_held",
            "Requests that waited for a server of a pool that had none.",
            names,
            registry=self.registry,
        )
        self.held_refusals = Counter(
            "llmfleet_router_held_refused",
            "Held requests answered 503: too many held already (full), or no server in time (timeout).",
            [*names, "reason"],
            registry=self.registry,
        )
        self.cold_starts = Histogram(
            "llmfleet_router_cold_start_seconds",
            "From the first request held for a pool with no server to that pool's first ready server.",
            names,
            buckets=COLD_START_BUCKETS,
            registry=self.registry,
        )
        for pool in pools:
            self.lab(self.retries, pool=pool)
        for reason in HOLD_REFUSALS:
            self.lab(self.held_refusals, reason=reason)
        for metric in (self.fallbacks, self.broken_streams, self.held_now, self.held_total, self.cold_starts):
            self.lab(metric)
        # No engine here: its gauges would read 0 beside the servers' under the same model_name
        # and pull a dashboard's or an autoscaler's average down.
        for gauge in (self.running, self.waiting, self.kv_usage):
            gauge.remove(*self.labels.values())

    def first_token(self, seconds: float) -> None:
        self.lab(self.ttft).observe(seconds)

    def token_gap(self, seconds: float) -> None:
        self.lab(self.itl).observe(seconds)

    def held(self, now: int, new: bool = False) -> None:
        """``now`` requests are held; ``new``: one more began waiting."""
        self.lab(self.held_now).set(now)
        if new:
            self.lab(self.held_total).inc()

    def held_refused(self, reason: str) -> None:
        self.lab(self.held_refusals, reason=reason).inc()

    def cold_start(self, seconds: float) -> None:
        self.lab(self.cold_starts).observe(seconds)

    def finished(self, started: float, reason: str | None) -> None:
        self.lab(self.e2e).observe(time.monotonic() - started)
        # the engine's reasons, as vLLM counts them: a reply that ends in tool calls stopped
        reason = "stop" if reason == "tool_calls" else reason or "abort"
        self.lab(self.success, finished_reason=reason).inc()
