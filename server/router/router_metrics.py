"""The router's metrics: latency as the client sees it, under vLLM's names with ``role="router"``
(TTFT, ITL and end-to-end latency, finished requests by reason), and its own ``llmfleet_router_*``
counters: retries per pool, prefills the decode servers did themselves, streams cut by a failure.

Token counters stay at zero here: the prefill and decode servers count the tokens, and a fleet sum
must not count them twice."""

from __future__ import annotations

import time

from prometheus_client import Counter

from llmfleet.server.http.server_metrics import ServerMetrics


class RouterMetrics(ServerMetrics):
    def __init__(self, model_name: str) -> None:
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
        for pool in ("prefill", "decode"):
            self.lab(self.retries, pool=pool)
        self.lab(self.fallbacks)
        self.lab(self.broken_streams)
        # No engine here: its gauges would read 0 beside the servers' under the same model_name
        # and pull a dashboard's or an autoscaler's average down.
        for gauge in (self.running, self.waiting, self.kv_usage):
            gauge.remove(*self.labels.values())

    def first_token(self, seconds: float) -> None:
        self.lab(self.ttft).observe(seconds)

    def token_gap(self, seconds: float) -> None:
        self.lab(self.itl).observe(seconds)

    def finished(self, started: float, reason: str | None) -> None:
        self.lab(self.e2e).observe(time.monotonic() - started)
        # the engine's reasons, as vLLM counts them: a reply that ends in tool calls stopped
        reason = "stop" if reason == "tool_calls" else reason or "abort"
        self.lab(self.success, finished_reason=reason).inc()
