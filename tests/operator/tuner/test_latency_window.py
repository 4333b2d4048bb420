"""A pool that sees few requests: its latency quantiles come from a wider window, not nowhere."""

from __future__ import annotations

import asyncio

from llmfleet.operator.metrics.source import PoolMetrics, PoolRef, snapshot_widening_latency
from tests.operator.tuner.scenarios import metrics

POOL = PoolRef("default", "svc", "colocated")


class SparseSource:
    """Ten requests per 30 s: a p95 needs 20 observations, so 60 s of them."""

    def __init__(self) -> None:
        self.windows: list[float] = []

    async def snapshot(self, pool: PoolRef, window_s: float) -> PoolMetrics:
        self.windows.append(window_s)
        samples = 10 * window_s / 30
        if samples < 20:
            why = f"{{}}: {samples:.0f} observations in the {window_s:.0f} s window (< 20)"
            return metrics(
                ttft_ms=None,
                itl_ms=None,
                queue_ms=None,
                prompt_tps=window_s,
                missing={k: why.format(k) for k in ("ttft", "itl", "queue_time")},
            )
        return metrics(ttft_ms=900, itl_ms=80, queue_ms=300, prompt_tps=window_s)


def test_too_few_observations_widen_the_latency_window_only() -> None:
    source = SparseSource()
    m = asyncio.run(snapshot_widening_latency(source, POOL, 30.0))
    assert source.windows == [30.0, 60.0]
    assert m.ttft.p95 == 0.9 and m.itl.p95 == 0.08 and m.queue_time.p95 == 0.3
    assert m.prompt_tokens_per_s == 30.0  # rates stay the window's own
    assert m.latency_window_s == 60.0 and m.summary()["latencyWindowS"] == 60.0
    assert "ttft" not in m.missing


def test_the_widening_stops_at_four_windows() -> None:
    source = SparseSource()
    m = asyncio.run(snapshot_widening_latency(source, POOL, 10.0))
    assert source.windows == [10.0, 20.0, 40.0]  # 40 s holds 13 observations: still too few
    assert m.ttft.p95 is None and "observations in the 10 s window" in m.missing["ttft"]
    assert m.latency_window_s is None


def test_an_idle_pool_takes_no_latencies_from_traffic_that_has_ended() -> None:
    """Quantiles from up to 2 minutes back made the tuner add replicas to a pool nobody used."""
    source = SparseSource()
    idle = metrics(
        ttft_ms=None,
        itl_ms=None,
        queue_ms=None,
        rate=0.0,
        prompt_tps=0,
        gen_tps=0,
        running=0,
        waiting=0,
        missing={"ttft": "ttft: 0 observations in the 30 s window (< 20)"},
    )

    async def snapshot(pool: PoolRef, window_s: float) -> PoolMetrics:
        source.windows.append(window_s)
        return idle if window_s == 30.0 else await SparseSource.snapshot(source, pool, window_s)

    source.snapshot = snapshot
    m = asyncio.run(snapshot_widening_latency(source, POOL, 30.0))
    assert source.windows == [30.0]
    assert m.ttft.p95 is None and m.latency_window_s is None


class ByWindowSource:
    """TTFT p95 450 ms over the last 30 s, 350 ms over 60 s: a short burst inside a calmer minute."""

    def __init__(self) -> None:
        self.windows: list[float] = []

    async def snapshot(self, pool: PoolRef, window_s: float) -> PoolMetrics:
        self.windows.append(window_s)
        return metrics(ttft_ms=450 if window_s <= 30 else 350, itl_ms=80, prompt_tps=window_s)


def test_the_slo_window_comes_along_for_replica_decisions() -> None:
    source = ByWindowSource()
    m = asyncio.run(snapshot_widening_latency(source, POOL, 30.0, slo_window_s=60.0))
    assert source.windows == [30.0, 60.0]
    assert m.ttft.p95 == 0.45 and m.judged_ttft.p95 == 0.35  # knobs read the first, replicas the second
    assert m.prompt_tokens_per_s == 30.0
    assert m.summary()["ttftP95OverSloWindowMs"] == 350.0 and m.summary()["sloWindowS"] == 60.0


def test_a_widening_to_the_slo_window_serves_it_without_a_second_query() -> None:
    source = SparseSource()  # widened to 60 s for its sparse latencies
    m = asyncio.run(snapshot_widening_latency(source, POOL, 30.0, slo_window_s=60.0))
    assert source.windows == [30.0, 60.0]
    assert m.slo_window_s == 60.0 and m.judged_ttft.p95 == m.ttft.p95 == 0.9
    assert m.judged_window_s == 60.0


class SparseFirstTokens:
    """Ten first tokens per 30 s (a p95 needs 60 s of them) but hundreds of gaps, and a burst of
    long prompt steps in the last 30 s: ITL p95 2150 ms there, 170 ms over the minute."""

    async def snapshot(self, pool: PoolRef, window_s: float) -> PoolMetrics:
        itl = 2150 if window_s <= 30 else 170
        if window_s < 60:
            why = f"ttft: 10 observations in the {window_s:.0f} s window (< 20)"
            return metrics(ttft_ms=None, itl_ms=itl, missing={"ttft": why})
        return metrics(ttft_ms=4000, itl_ms=itl)


def test_an_itl_beside_a_widened_ttft_is_judged_over_the_slo_window() -> None:
    """A TTFT widened to the SLO's window made the 30 s ITL p95 read as the minute's, and the
    tuner added a pod the minute did not need (long-prompt, seed 11: 16 minutes at 5 pods)."""
    m = asyncio.run(snapshot_widening_latency(SparseFirstTokens(), POOL, 30.0, slo_window_s=60.0))
    assert m.itl.p95 == 2.15  # the knobs read the short window
    assert m.judged_itl.p95 == 0.17 and m.judged_ttft.p95 == 4.0


def test_latencies_widened_past_the_slo_window_are_judged_over_theirs() -> None:
    source = SparseSource()  # the SLO's 20 s hold too few, as do 40 s: the latencies widen to 80 s
    m = asyncio.run(snapshot_widening_latency(source, POOL, 10.0, slo_window_s=20.0, widest=8.0))
    assert m.latency_window_s == 80.0 and m.judged_ttft.p95 == 0.9
    assert m.judged_window_s == 80.0
