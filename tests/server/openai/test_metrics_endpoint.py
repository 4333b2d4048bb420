"""/metrics in-process: vLLM's names, types and labels, every series present from the start,
and what parallel sampling observes."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

HISTOGRAMS = [
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_params_max_tokens",
    "vllm:iteration_tokens_total",
    "vllm:request_params_n",
    "vllm:request_max_num_generation_tokens",
    "llmfleet_batch_size",
    "llmfleet_step_duration_seconds",
    "llmfleet_scheduler_duration_seconds",
    "llmfleet_kv_transfer_bytes",
    "llmfleet_kv_transfer_seconds",
]


COUNTERS = [
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:num_preemptions",
    "llmfleet_config_errors",
]


GAUGES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
    "llmfleet_config_generation",
    "llmfleet_config_knob",
    "llmfleet_role_info",
    "llmfleet_requests_in_flight",
]


def test_metrics_names_types_and_labels(client):
    assert client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3}).status_code == 200
    response = client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    for name in HISTOGRAMS:
        assert families[name].type == "histogram", name
    for name in COUNTERS:
        assert families[name].type == "counter", name
    for name in GAUGES:
        assert families[name].type in ("gauge", "info"), name
    assert len(families["vllm:time_to_first_token_seconds"].samples) > 20  # vLLM-like buckets
    steps = {s.labels["le"] for s in families["vllm:iteration_tokens_total"].samples if s.name.endswith("_bucket")}
    assert {"1024.0", "16384.0"} <= steps  # vLLM's: a step's tokens reach the budget, often past 512
    for family in families.values():
        if not family.name.startswith(("vllm:", "llmfleet_")):  # process_*, python_*, http_*
            continue
        for sample in family.samples:
            assert sample.labels.get("model_name") == "fake", sample
            assert sample.labels.get("role") == "colocated", sample
    text = response.text
    success = 'engine="0",finished_reason="length",model_name="fake",role="colocated"'
    assert f"vllm:request_success_total{{{success}}} 1.0" in text
    assert 'llmfleet_config_knob{engine="0",knob="max_batch_size",model_name="fake",role="colocated"} 32.0' in text
    assert 'vllm:cache_config_info{block_size="4"' in text
    (info,) = families["vllm:cache_config_info"].samples
    assert (info.labels["enable_prefix_caching"], info.labels["scheduling"]) == ("True", "fcfs")
    # request sizes, for vLLM's prompt and generation length heatmaps: one finished request
    sizes = {
        s.name: s.value
        for name in ("vllm:request_generation_tokens", "vllm:request_params_max_tokens")
        for s in families[name].samples
        if s.name.endswith(("_sum", "_count"))
    }
    assert sizes == {
        "vllm:request_generation_tokens_sum": 3.0,
        "vllm:request_generation_tokens_count": 1.0,
        "vllm:request_params_max_tokens_sum": 3.0,
        "vllm:request_params_max_tokens_count": 1.0,
    }
    bounds = [float(s.labels["le"]) for s in families["vllm:request_prompt_tokens"].samples if "le" in s.labels]
    assert bounds[:4] == [1.0, 2.0, 5.0, 10.0] and bounds[-1] == float("inf")


def test_every_series_exists_at_zero_before_the_first_request(client):
    """Prometheus takes a series' first sample as its baseline: a histogram born with a pod's
    first request would leave that request out of rate() and the TTFT quantiles."""
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    for name in HISTOGRAMS:
        counts = [s.value for s in families[name].samples if s.name == f"{name}_count"]
        assert counts == [0.0], name
    for name in (
        *COUNTERS,
        "llmfleet_batch_shed",
        "llmfleet_kv_transfer_cached_tokens",
        "llmfleet_kv_import_recomputed",
    ):
        assert [s.value for s in families[name].samples if s.name == f"{name}_total"], name
    failures = {
        s.labels["reason"]: s.value
        for s in families["llmfleet_kv_transfer_failures"].samples
        if s.name.endswith("_total")
    }
    assert failures == {"fetch": 0.0, "mismatch": 0.0}


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_sampling_histograms_observe_each_prompts_n_and_longest_choice(client, stream):
    """vLLM's request_params_n and request_max_num_generation_tokens: one observation per prompt
    once its n choices have finished, the n and the most tokens one of them generated."""
    text = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 6, "temperature": 0}).json()
    cut = text["choices"][0]["text"][2]  # the choices all stop at their third token
    body = {"prompt": ["ab", "ab"], "max_tokens": 6, "n": 3, "temperature": 0, "stream": stream}
    assert client.post("/v1/completions", json=body | {"stop": cut}).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 7, "stream": stream}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    samples = families["vllm:request_params_n"].samples
    buckets = {s.labels["le"]: s.value for s in samples if s.name.endswith("_bucket")}
    assert buckets == {"1.0": 1.0, "2.0": 1.0, "5.0": 3.0, "10.0": 4.0, "20.0": 4.0, "+Inf": 4.0}
    longest = {
        s.name: s.value
        for s in families["vllm:request_max_num_generation_tokens"].samples
        if s.name.endswith(("_sum", "_count"))
    }
    assert longest == {
        "vllm:request_max_num_generation_tokens_sum": 6 + 3 + 3 + 4.0,
        "vllm:request_max_num_generation_tokens_count": 4.0,
    }
