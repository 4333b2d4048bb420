"""What the simulated pools report to the tuner: step times and the queue's growth, as the
direct-scrape source would measure them from real pods."""

from __future__ import annotations

import pytest

from llmfleet.operator.metrics.source import PoolRef
from llmfleet.sim.metric_source import PodGauges, PoolSeries, SimMetricSource


def test_step_times_and_queue_growth_over_the_window() -> None:
    series = PoolSeries("colocated")
    clock = [0.0]
    source = SimMetricSource(lambda pool: series, lambda pool: 1, lambda: clock[0])
    for at, waiting in ((0.0, 0), (10.0, 2), (20.0, 4), (30.0, 6)):
        clock[0] = at
        series.step(batch=4, tokens=20, seconds=0.030)
        series.step(batch=8, tokens=8, seconds=0.040)
        series.scrape(at, [PodGauges(waiting=waiting, running=8, kv_usage=0.1)])
    m = source.measure(PoolRef("default", "svc", "colocated"), 60.0)
    assert m.mean_step_seconds == pytest.approx(0.035)
    assert m.mean_batch_size == pytest.approx(6.0) and m.mean_step_tokens == pytest.approx(14.0)
    assert m.waiting_growth_per_s == pytest.approx(0.2)


def test_scrapes_are_kept_for_the_widest_window_the_longest_asked_may_widen_to() -> None:
    """A week-long trace scrapes every simulated second: the series holds what a window can
    read, not the week (it held 800 MB of scrapes for a week of idling)."""
    series = PoolSeries("colocated")
    clock = [0.0]
    source = SimMetricSource(lambda pool: series, lambda pool: 1, lambda: clock[0])
    pool = PoolRef("default", "svc", "colocated")
    for second in range(5000):
        clock[0] = float(second)
        series.step(batch=1, tokens=1, seconds=0.01)
        series.scrape(clock[0], [PodGauges(waiting=0, running=1, kv_usage=0.0)])
        if second and second % 10 == 0:
            assert source.measure(pool, 60.0).mean_batch_size == 1.0
    assert len(series.window(clock[0], 60.0)) == 61
    assert len(series.scrapes) <= 4 * 60 + 1 + 256


def test_the_mean_prompt_is_the_finished_requests_not_the_token_rate_over_them() -> None:
    """On a ramp more prompts start than requests finish: the prompt token rate over the finished
    rate puts the window's 30 prompts on its 10 finished requests (3x the mean prompt); the
    prompt-length histogram reads the finished requests' own prompts."""
    series = PoolSeries("colocated", max_model_len=4096)
    clock = [0.0]
    source = SimMetricSource(lambda pool: series, lambda pool: 1, lambda: clock[0])
    series.scrape(0.0, [PodGauges(waiting=0, running=0, kv_usage=0.0)])
    for i in range(30):
        series.first_token(ttft=0.2, prompt_len=100 if i % 10 else 400)
        if i % 3 == 0:
            series.finished(queue_time=0.01, prompt_len=100 if i % 10 else 400)
    clock[0] = 30.0
    series.scrape(30.0, [PodGauges(waiting=0, running=20, kv_usage=0.2)])
    m = source.measure(PoolRef("default", "svc", "colocated"), 30.0)
    assert m.prompt_tokens_per_s / m.request_rate == pytest.approx(3 * (27 * 100 + 3 * 400) / 30)
    finished = [100 if i % 10 else 400 for i in range(0, 30, 3)]  # 400, 100, 100, 100, 400, ...
    assert m.mean_prompt_tokens() == pytest.approx(sum(finished) / len(finished))
    assert m.prompt_length.p95 is None and m.prompt_length.samples == 10  # too few for a p95
    assert "prompt_length: 10 observations" in m.missing["prompt_length"]


def test_itls_tail_between_p95_and_p99_is_measured_as_prometheus_would() -> None:
    """1.5% of the gaps are prompt steps of 4 s: p98 is still a decode step's, p99 theirs. A
    straight line from p95 to p99 would put p98 at 2.5 s; the simulated pool reports p96-p98 from
    its buckets, as the tuner's Prometheus and scrape sources do."""
    series = PoolSeries("colocated")
    clock = [0.0]
    source = SimMetricSource(lambda pool: series, lambda pool: 1, lambda: clock[0])
    series.scrape(0.0, [PodGauges(waiting=0, running=8, kv_usage=0.1)])
    for i in range(4000):
        series.next_token(4.0 if i % 200 < 3 else 0.09)
    series.step(batch=8, tokens=8, seconds=0.09)
    clock[0] = 30.0
    series.scrape(30.0, [PodGauges(waiting=0, running=8, kv_usage=0.1)])
    itl = source.measure(PoolRef("default", "svc", "colocated"), 60.0).itl
    assert itl.samples == 4000 and itl.p99 is not None and itl.p99 > 2.5
    assert [q for q, _ in itl.between] == [0.96, 0.97, 0.98]
    assert all(value <= 0.1 for _, value in itl.between)  # the decode steps' bucket, (0.075, 0.1]
