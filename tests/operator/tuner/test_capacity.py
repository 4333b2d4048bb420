"""Capacity at the SLO, steady pod counts, and when a batching window is worth growing: rules the
simulator's tuner evaluation (`llm-fleet bench tuner`) showed the law needed."""

from __future__ import annotations

import pytest

from llmfleet.operator.tuner.law import REPLICAS, TIMEOUT, Tuner
from llmfleet.operator.tuner.memory import TunerMemory
from tests.operator.tuner.scenarios import ONE_SHOT, SLO, metrics, pool_input, settings


def decide(memory: TunerMemory | None = None, now: float = 1000.0, current=None, **kw):
    pools = {"colocated": pool_input(metrics("colocated", at=now, **kw), current)}
    return Tuner(ONE_SHOT).decide(pools, SLO, memory or TunerMemory(), now=now)


def test_an_slo_broken_with_the_knob_at_its_limit_caps_the_capacity_at_the_pods_load() -> None:
    # TTFT over SLO, window already 0 (its queue waits within the SLO: no drained backlog): one
    # more replica now, and the per-pod load that broke the SLO becomes the capacity estimate
    # (defaults 4000 prompt / 400 generation tok/s per replica).
    first = decide(ttft_ms=800, queue_ms=400, prompt_tps=1000, gen_tps=200, current=settings(timeout=0))
    assert first.changed("colocated", REPLICAS).new == 2
    capacity = first.memory.capacity["colocated"]
    load = 1000 / 4000 + 200 / 400
    assert capacity.prompt_tps == pytest.approx(4000 * load) and capacity.generation_tps == pytest.approx(400 * load)
    assert any("saturated for latency: 1.60x the SLO with batchTimeoutMs at its limit" in r for r in first.reasons)
    # at that estimate the same traffic needs ceil(1 / 0.8) = 2 replicas: no scaling back to 1
    later = decide(
        first.memory,
        now=1300.0,
        ttft_ms=300,
        queue_ms=100,
        prompt_tps=1000,
        gen_tps=200,
        pods=2,
        current=settings(replicas=2, timeout=0),
    )
    assert later.changed("colocated", REPLICAS) is None


def test_a_queue_measures_capacity_the_old_way_not_twice() -> None:
    decision = decide(ttft_ms=800, queue_ms=600, waiting=3, prompt_tps=1000, gen_tps=200, current=settings(timeout=0))
    assert not any("saturated for latency" in r for r in decision.reasons)
    assert any("saturated: 3.0 waiting per pod" in r for r in decision.reasons)


def test_per_pod_rates_wait_for_a_steady_pod_count() -> None:
    saturated = {"waiting": 4, "gen_tps": 900, "prompt_tps": 100}
    first = decide(pods=2, current=settings(replicas=2), **saturated)
    measured = first.memory.capacity["colocated"].generation_tps
    assert measured != 400  # a fresh memory measures at once
    # a third pod joins: the window's tokens came from two, so nothing is measured for one window
    joined = decide(first.memory, now=1030.0, pods=3, current=settings(replicas=3), **saturated)
    assert joined.memory.capacity["colocated"].generation_tps == measured
    assert any("not measured: 3 ready pods for 0 s (< the 60 s window)" in r for r in joined.reasons)
    steady = decide(joined.memory, now=1100.0, pods=3, current=settings(replicas=3), **saturated)
    assert steady.memory.capacity["colocated"].generation_tps != measured


@pytest.mark.parametrize(("rate", "grows"), [(10.0, True), (1.0, False)])
def test_the_window_grows_only_where_prompts_arrive_to_coalesce(rate: float, grows: bool) -> None:
    decision = decide(ttft_ms=100, itl_ms=40, rate=rate)
    change = decision.changed("colocated", TIMEOUT)
    if grows:
        assert change is not None and change.new == 25
    else:
        assert change is None
        assert any("would coalesce 0.03 more prompts per pod (< 0.2)" in r for r in decision.reasons)


def test_a_queue_quantile_above_the_ttft_quantile_is_not_a_queue_share() -> None:
    # vLLM's queue-time buckets start at 300 ms: short queues interpolate to ~285 ms whatever they are
    decision = decide(ttft_ms=280, queue_ms=285, itl_ms=90)
    assert decision.changed("colocated", TIMEOUT) is None
    honest = decide(ttft_ms=300, queue_ms=240, itl_ms=90)
    assert honest.changed("colocated", TIMEOUT).new == 10


def test_prompt_tokens_a_prefix_cache_covered_are_no_demand_and_no_capacity() -> None:
    # 12000 prompt tok/s arrive, 10500 of them a shared system prompt the prefix cache holds:
    # demand 1500/4000 + 200/400 = 0.875 replicas, 2 with headroom. Counted whole, the pod
    # "outran" its estimate 3.5x, and the estimate rose to match for generation too: 400 -> 1400
    # tok/s per replica that no pod could decode.
    decision = decide(prompt_tps=12000, prefix_hits_tps=10500, gen_tps=200)
    assert decision.changed("colocated", REPLICAS).new == 2
    assert any("prompt 1500 tok/s / 4000 per replica" in r for r in decision.reasons)
    capacity = decision.memory.capacity["colocated"]
    assert (capacity.prompt_tps, capacity.generation_tps) == (4000, 400)
    assert decision.inputs["colocated"]["prefixCacheHitsPerS"] == 10500
