"""The PromQL builders: exact text, escaping, and the full query set of one snapshot."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from llmfleet.operator.metrics import promql
from llmfleet.operator.metrics.source import PoolRef

REF = PoolRef("prod", "chat", "decode")
SEL = 'inference_service="chat",namespace="prod",pool="decode"'


def test_pool_selector_is_sorted_and_quoted() -> None:
    assert promql.pool_selector(REF) == SEL
    assert promql.pool_selector(REF, {"role": "decode"}) == SEL + ',role="decode"'
    assert promql.quote('a"b\\c\nd') == '"a\\"b\\\\c\\nd"'


@pytest.mark.parametrize(
    ("window", "text"), [(60, "60s"), (60.0, "60s"), (1.5, "1500ms"), ("$__rate_interval", "$__rate_interval")]
)
def test_duration(window, text) -> None:
    assert promql.duration(window) == text


def test_duration_rejects_nonpositive() -> None:
    with pytest.raises(ValueError):
        promql.duration(0)


def test_histogram_quantile_text() -> None:
    assert promql.histogram_quantile(promql.TTFT, 0.95, SEL, 60) == (
        f"histogram_quantile(0.95, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{{{SEL}}}[60s])))"
    )


def test_other_builders() -> None:
    assert promql.histogram_observations(promql.ITL, SEL, 30) == (
        f"sum(increase(vllm:inter_token_latency_seconds_count{{{SEL}}}[30s]))"
    )
    assert promql.counter_rate(promql.PROMPT_TOKENS, SEL, "1m") == f"sum(rate(vllm:prompt_tokens_total{{{SEL}}}[1m]))"
    assert (
        promql.gauge_sum_mean(promql.WAITING, SEL, 60) == f"sum(avg_over_time(vllm:num_requests_waiting{{{SEL}}}[60s]))"
    )
    assert promql.gauge_max(promql.KV_USAGE, SEL, 60) == f"max(max_over_time(vllm:kv_cache_usage_perc{{{SEL}}}[60s]))"
    assert promql.histogram_mean(promql.BATCH_SIZE, SEL, 60) == (
        f"sum(rate(llmfleet_batch_size_sum{{{SEL}}}[60s])) / sum(rate(llmfleet_batch_size_count{{{SEL}}}[60s]))"
    )
    assert promql.pods_reporting(SEL) == f"count(timestamp(vllm:num_requests_running{{{SEL}}}) >= time() - 60)"
    assert promql.newest_sample_time(SEL) == f"max(timestamp(vllm:num_requests_running{{{SEL}}}))"


def test_grafana_variables_pass_through() -> None:
    selector = 'namespace="$namespace",inference_service="$service",pool=~"$pool"'
    query = promql.histogram_quantile(promql.ITL, 0.99, selector, "$__rate_interval")
    assert '{namespace="$namespace",inference_service="$service",pool=~"$pool"}[$__rate_interval]' in query


def test_pool_queries_cover_every_field() -> None:
    queries = promql.pool_queries(SEL, 60)
    for name in ("ttft", "itl", "queue_time"):
        assert {f"{name}:0.5", f"{name}:0.95", f"{name}:0.99", f"{name}:samples"} <= set(queries)
    assert {
        "request_rate",
        "prompt_tokens_per_s",
        "generation_tokens_per_s",
        "preemptions_per_s",
        "waiting",
        "running",
        "kv_usage_mean",
        "kv_usage_max",
        "mean_batch_size",
        "mean_step_tokens",
        "ready_pods",
        "newest_sample",
    } <= set(queries)
    assert all(SEL in q for q in queries.values())
    assert queries["request_rate"] == f"sum(rate(vllm:request_success_total{{{SEL}}}[60s]))"


def test_a_pod_whose_series_stopped_is_not_reporting(tmp_path) -> None:
    """Real Prometheus semantics (promtool): a series cut off without staleness markers, as after a
    Prometheus restart, stays in an instant query's 5-minute lookback; it must not count as a pod."""
    promtool = shutil.which("promtool") or pytest.skip("promtool is not installed (scripts/install-tools.sh)")
    running = 'vllm:num_requests_running{pool="decode",pod="%s"}'
    test = {
        "rule_files": [],
        "tests": [
            {
                "interval": "15s",
                "input_series": [
                    {"series": running % "live", "values": "1x20"},  # to 5m
                    {"series": running % "gone", "values": "1x8"},  # to 2m, then nothing
                ],
                "promql_expr_test": [
                    {
                        "expr": promql.pods_reporting('pool="decode"', fresh_s=60),
                        "eval_time": "4m",
                        "exp_samples": [{"labels": "{}", "value": 1}],
                    }
                ],
            }
        ],
    }
    (tmp_path / "test.yaml").write_text(json.dumps(test))
    result = subprocess.run([promtool, "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
