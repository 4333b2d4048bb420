"""Prometheus metrics with vLLM's names, so existing dashboards and autoscalers work unchanged,
plus llm-fleet's own under ``llmfleet_*``. One registry per app, labels ``model_name``, vLLM's
``engine`` (``"0"``: one engine per server; the router has none) and ``role``. The registry also
holds prometheus_client's process, platform and GC collectors (``process_*``, ``python_*``), as
vLLM's default registry does, and the app adds the HTTP metrics (app.py).

Request histograms are observed on the engine thread right after each step, from the engine's
own timestamps (arrival, first scheduled, first token, each token, finish).

Which finished requests count (``vllm:request_success_total`` and the per-request histograms),
as vLLM 0.32 decides:

- A request the API gave up on for its client (a closed stream or connection; the choices already
  handed over of a call refused part-way, say by a full queue) is not recorded at all. vLLM's
  ``AsyncLLM.abort`` drops it from the output processor (``OutputProcessor.abort_requests``),
  which never calls ``_update_stats_from_finished`` for it: no ``finished_reason="abort"``, no
  e2e, queue, prefill, decode, inference, size or max_tokens observation. What it produced before
  (its TTFT, inter-token gaps and tokens) counts, as vLLM counts those per step.
- A request the server ends itself counts under the finish reason its answer carries, with every
  histogram: vLLM's engine core sends an ``abort`` output for each request it aborts (a pause or
  a shutdown in abort mode, a request added during shutdown), and the output processor records
  those as finished. Ours: the drain timeout (vLLM's shutdown abort), and a request whose token
  could not be sampled or detokenized, or whose step the runner failed (where vLLM's engine would
  die and record nothing, ours goes on), each answered with ``finish_reason: "abort"``.
- The engine never ends a request for want of KV blocks: a preempted request waits and is
  recomputed (``vllm:num_preemptions``), and one that can never fit is refused before it is
  admitted (a 400, which neither server records as a finished request).
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
)

from llmfleet.server.config import EngineConfig
from llmfleet.server.engine.engine import EngineStats, LLMEngine, RequestOutput
from llmfleet.server.metric_buckets import (
    BATCH_BUCKETS,
    BYTES_BUCKETS,
    ITERATION_BUCKETS,
    ITL_BUCKETS,
    N_BUCKETS,
    REQUEST_BUCKETS,
    STEP_BUCKETS,
    TTFT_BUCKETS,
    length_buckets,
)

# vLLM's FinishReason (vllm/v1/engine/__init__.py), every one exported from the start as vLLM does;
# this engine ends requests with the first three only
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
KV_FAILURE_REASONS = ("fetch", "mismatch")  # the KV body could not be fetched; it did not match the request

NUMERIC_KNOBS = sorted(
    name
    for name, field in EngineConfig.model_fields.items()
    if field.annotation in (int, float) and name in EngineConfig.live_fields()
)


class ServerMetrics:
    # vLLM's engine index (label ``engine``): a server runs one engine; None: no label (the router)
    ENGINE_INDEX: str | None = "0"

    def __init__(self, model_name: str, role: str, max_model_len: int | None = None) -> None:
        self.registry = CollectorRegistry()
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=self.registry)
        engine = {} if self.ENGINE_INDEX is None else {"engine": self.ENGINE_INDEX}
        self.labels = {"model_name": model_name, **engine, "role": role}
        names = list(self.labels)
        reg = self.registry

        plain = []  # the metrics labelled by model_name and role alone: their series are made below

        def made(metric, extra):
            if not extra:
                plain.append(metric)
            return metric

        def hist(name, doc, buckets, extra=()):
            return made(Histogram(name, doc, [*names, *extra], buckets=buckets, registry=reg), extra)

        def counter(name, doc, extra=()):
            return made(Counter(name, doc, [*names, *extra], registry=reg), extra)

        def gauge(name, doc, extra=()):
            return made(Gauge(name, doc, [*names, *extra], registry=reg), extra)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds", "Mean time per output token.", ITL_BUCKETS)
        # vLLM's older name for the time between output tokens: one observation per token interval
        self.itl_alias = hist(
            "vllm:time_per_output_token_seconds", "Deprecated: inter_token_latency_seconds.", ITL_BUCKETS
        )
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency.", REQUEST_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", "Time waiting before first scheduled.", REQUEST_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds", "First scheduled to first token.", REQUEST_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds", "First token to last token.", REQUEST_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds", "First scheduled to finished.", REQUEST_BUCKETS)
        sizes = length_buckets(max_model_len)
        self.prompt_len = hist("vllm:request_prompt_tokens", "Prompt tokens per finished request.", sizes)
        self.generation_len = hist("vllm:request_generation_tokens", "Generated tokens per finished request.", sizes)
        self.max_tokens = hist("vllm:request_params_max_tokens", "The max_tokens of finished requests.", sizes)
        # vLLM's, per API request and prompt (a parent of n sequences), once all n have finished
        self.params_n = hist("vllm:request_params_n", "The n of finished requests.", N_BUCKETS)
        self.max_num_generation_tokens = hist(
            "vllm:request_max_num_generation_tokens", "The most tokens one of a request's n sequences generated.", sizes
        )
        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV cache usage, 0..1.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self.success = counter("vllm:request_success", "Finished requests.", ("finished_reason",))
        self.preemptions = counter("vllm:num_preemptions", "Running requests preempted for want of KV blocks.")
        self.shed = counter(
            "llmfleet_batch_shed", "Running requests sent back to wait (recomputed) by a live cut of max_batch_size."
        )
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.iteration_tokens = hist("vllm:iteration_tokens_total", "Tokens per engine step.", ITERATION_BUCKETS)
        self.cache_info = Info("vllm:cache_config", "KV cache configuration.", names, registry=reg)

        self.batch_size = hist("llmfleet_batch_size", "Requests per engine step.", BATCH_BUCKETS)
        self.step_seconds = hist("llmfleet_step_duration_seconds", "Engine step time.", STEP_BUCKETS)
        self.schedule_seconds = hist("llmfleet_scheduler_duration_seconds", "Scheduler time per step.", STEP_BUCKETS)
        self.config_generation = gauge("llmfleet_config_generation", "Generation of the applied engine config.")
        self.knob = gauge("llmfleet_config_knob", "Applied live knob values.", ("knob",))
        self.config_errors = counter("llmfleet_config_errors", "Engine config files rejected.")
        self.kv_transfer_bytes = hist("llmfleet_kv_transfer_bytes", "KV bytes moved per request.", BYTES_BUCKETS)
        self.kv_transfer_seconds = hist("llmfleet_kv_transfer_seconds", "KV transfer time.", STEP_BUCKETS)
        self.role_info = gauge("llmfleet_role_info", "Server role.")
        self.in_flight = gauge("llmfleet_requests_in_flight", "HTTP requests in flight.")
        self.kv_held = gauge("llmfleet_kv_export_held_bytes", "Exported KV waiting to be fetched.")
        self.kv_cached_tokens = counter(
            "llmfleet_kv_transfer_cached_tokens",
            "Prompt tokens whose KV a decode server had in its prefix cache, so it did not fetch it.",
        )
        self.kv_recomputed = counter(
            "llmfleet_kv_import_recomputed",
            "Imports whose left-out cached blocks were gone at admission (evicted, or prefix caching off): "
            "the prompt was computed here.",
        )
        self.kv_failures = counter("llmfleet_kv_transfer_failures", "KV transfers that failed.", ("reason",))
        self.role_info.labels(**self.labels).set(1)
        # Export every series from the start, as vLLM does: Prometheus takes a series' first sample
        # as its baseline, so an event that creates it is lost to rate() and increase() (a new pod's
        # first, often slowest, request missing from the TTFT p95), and dashboards show "no data".
        for metric in plain:
            metric.labels(**self.labels)
        for reason in FINISH_REASONS:
            self.success.labels(**self.labels, finished_reason=reason)
        for reason in KV_FAILURE_REASONS:
            self.kv_failures.labels(**self.labels, reason=reason)
        self._totals_seen: dict[str, int] = {}
        self._token_times: dict[str, float] = {}

    def lab(self, metric, **extra):
        return metric.labels(**self.labels, **extra)

    def set_config(self, config: EngineConfig, generation: int, runner) -> None:
        """The applied config: its generation, numeric knobs, and the cache as the runner built it."""
        self.lab(self.config_generation).set(generation)
        for name in NUMERIC_KNOBS:
            self.lab(self.knob, knob=name).set(float(getattr(config, name)))
        dtype = getattr(runner, "dtype", None)
        self.lab(self.cache_info).info(
            {
                "block_size": str(runner.kv_block_size),
                "num_gpu_blocks": str(runner.num_kv_blocks),
                "cache_dtype": str(dtype).removeprefix("torch.") if dtype is not None else config.dtype,
                "enable_prefix_caching": str(config.enable_prefix_caching),  # vLLM's label, "True"/"False"
                "policy": config.policy.value,
                "prefill_mode": config.prefill_mode.value,
                "scheduling": config.scheduling.value,
            }
        )

    def observe_parallel_sampling(self, n: int, max_generated: int) -> None:
        """A prompt's n sequences have all finished: its n, and the most tokens one generated."""
        self.lab(self.params_n).observe(n)
        self.lab(self.max_num_generation_tokens).observe(max_generated)

    def observe_kv_transfer(self, nbytes: int, seconds: float) -> None:
        """One KV body sent (prefill role) or received and checked (decode role)."""
        self.lab(self.kv_transfer_bytes).observe(nbytes)
        self.lab(self.kv_transfer_seconds).observe(seconds)

    def set_kv_held(self, nbytes: int) -> None:
        self.lab(self.kv_held).set(nbytes)

    def count_kv_cached_tokens(self, tokens: int) -> None:
        self.lab(self.kv_cached_tokens).inc(tokens)

    def count_kv_failure(self, reason: str) -> None:
        self.lab(self.kv_failures, reason=reason).inc()

    def set_load(self, stats: EngineStats) -> None:
        """Queue, batch and KV gauges from an engine snapshot (after a step, and at each scrape)."""
        self.lab(self.running).set(stats.num_running)
        self.lab(self.waiting).set(stats.num_waiting)
        self.lab(self.kv_usage).set(stats.kv_usage)

    def on_step(self, engine: LLMEngine, events: list[RequestOutput]) -> None:
        """Engine-thread observer: called after each step with its events."""
        stats = engine.stats()
        self.set_load(stats)
        self._advance(self.preemptions, "preemptions", stats.preemptions_total)
        self._advance(self.shed, "shed", stats.shed_total)
        self._advance(self.prefix_queries, "prefix_queries", stats.prefix_cache_queries)
        self._advance(self.prefix_hits, "prefix_hits", stats.prefix_cache_hits)
        self._advance(self.kv_recomputed, "kv_recomputed", stats.kv_imports_recomputed)
        if stats.last_batch_size:
            self.lab(self.batch_size).observe(stats.last_batch_size)
            self.lab(self.iteration_tokens).observe(stats.last_num_tokens)
            self.lab(self.step_seconds).observe(stats.last_step_seconds)
            self.lab(self.schedule_seconds).observe(stats.last_schedule_seconds)
        for ev in events:
            self._observe(ev)

    def _advance(self, counter: Counter, name: str, total: int) -> None:
        """Move ``counter`` up to the engine's running ``total``."""
        seen = self._totals_seen.get(name, 0)
        if total > seen:
            self.lab(counter).inc(total - seen)
            self._totals_seen[name] = total

    def _observe(self, ev: RequestOutput) -> None:
        m = ev.metrics
        if ev.new_token_ids:
            self.lab(self.generation_tokens).inc(len(ev.new_token_ids))
            previous = self._token_times.get(ev.request_id)
            now = m.last_token_time
            if previous is None:
                self.lab(self.prompt_tokens).inc(ev.num_prompt_tokens)
                self.lab(self.ttft).observe(m.first_token_time - m.arrival_time)
            elif now is not None:
                self.lab(self.itl).observe(now - previous)
                self.lab(self.itl_alias).observe(now - previous)
            self._token_times[ev.request_id] = now
        if not ev.finished:
            return
        self._token_times.pop(ev.request_id, None)
        if ev.client_aborted:  # vLLM records no finished request for it (see the module's doc)
            return
        self.lab(self.success, finished_reason=ev.finish_reason).inc()
        self.lab(self.prompt_len).observe(ev.num_prompt_tokens)
        self.lab(self.generation_len).observe(ev.num_output_tokens)
        if ev.max_tokens is not None:
            self.lab(self.max_tokens).observe(ev.max_tokens)
        if m.finished_time is None or ev.num_output_tokens == 0:
            return
        self.lab(self.e2e).observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.lab(self.queue).observe(m.first_scheduled_time - m.arrival_time)
            self.lab(self.prefill).observe(m.first_token_time - m.first_scheduled_time)
            self.lab(self.inference).observe(m.finished_time - m.first_scheduled_time)
        self.lab(self.decode).observe(m.last_token_time - m.first_token_time)
        if ev.num_output_tokens > 1:
            tpot = (m.last_token_time - m.first_token_time) / (ev.num_output_tokens - 1)
            self.lab(self.tpot).observe(tpot)
