"""Properties of the control law over random inputs: bounds never crossed, no decision without
reasons, deterministic, and quiet on repeated inputs within the cooldown."""

from __future__ import annotations

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from llmfleet.operator.metrics.source import PoolMetrics, PoolRef, Quantiles
from llmfleet.operator.tuner.law import (
    INTEGER_KNOBS,
    KNOB_FIELDS,
    MAX_BATCH,
    REPLICAS,
    TIMEOUT,
    TOKEN_BUDGET,
    PoolInput,
    PoolLimits,
    PoolSettings,
    Range,
    SLOTargets,
    Tuner,
    TunerConfig,
)
from llmfleet.operator.tuner.memory import TunerMemory


def opt(strategy: st.SearchStrategy[float]) -> st.SearchStrategy[float | None]:
    return st.one_of(st.none(), strategy)


seconds = st.floats(0.0005, 20.0, allow_nan=False)
rates = st.floats(0.0, 1e6, allow_nan=False)


@st.composite
def latencies(draw: st.DrawFn) -> Quantiles:
    p95 = draw(opt(seconds))
    if p95 is None:
        return Quantiles(samples=draw(opt(st.floats(0, 19))))
    return Quantiles(p50=p95 / 2, p95=p95, p99=p95 * 1.5, samples=draw(st.floats(20, 1e5)))


@st.composite
def pool_metrics(draw: st.DrawFn, pool: str, at: float) -> PoolMetrics:
    return PoolMetrics(
        pool=PoolRef("ns", "svc", pool),
        at=at,
        window_s=60.0,
        ttft=draw(latencies()),
        itl=draw(latencies()),
        queue_time=draw(latencies()),
        request_rate=draw(opt(st.floats(0, 1e4))),
        prompt_tokens_per_s=draw(opt(rates)),
        generation_tokens_per_s=draw(opt(rates)),
        preemptions_per_s=draw(opt(st.floats(0, 10))),
        waiting=draw(opt(st.floats(0, 1e4))),
        running=draw(opt(st.floats(0, 1e4))),
        kv_usage_mean=draw(opt(st.floats(0, 1))),
        kv_usage_max=draw(opt(st.floats(0, 1))),
        mean_batch_size=draw(opt(st.floats(0, 4096))),
        mean_step_tokens=draw(opt(st.floats(0, 1e5))),
        ready_pods=draw(st.integers(0, 20)),
        newest_sample_age_s=1.0,
        stale=draw(st.integers(0, 4)) == 0,
        reason="stale for the test",
    )


@st.composite
def int_range(draw: st.DrawFn, low: int, high: int) -> Range:
    a, b = sorted(draw(st.lists(st.integers(low, high), min_size=2, max_size=2)))
    return Range(float(a), float(b))


@st.composite
def pool_limits(draw: st.DrawFn) -> PoolLimits:
    lo, hi = sorted(draw(st.lists(st.integers(0, 12), min_size=2, max_size=2)))
    timeout = sorted(draw(st.lists(st.floats(0, 500, allow_nan=False), min_size=2, max_size=2)))
    return PoolLimits(
        lo,
        max(hi, 1),
        {
            MAX_BATCH: draw(int_range(1, 512)),
            TIMEOUT: Range(*timeout),
            TOKEN_BUDGET: draw(int_range(1, 32768)),
        },
    )


@st.composite
def pool_settings(draw: st.DrawFn) -> PoolSettings:
    """Current values, sometimes outside the limits (manual edits): the tuner must fix those."""
    return PoolSettings(
        draw(st.integers(0, 20)),
        {
            MAX_BATCH: float(draw(st.integers(1, 1024))),
            TIMEOUT: draw(st.floats(0, 1000, allow_nan=False)),
            TOKEN_BUDGET: float(draw(st.integers(1, 65536))),
        },
    )


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[dict[str, PoolInput], SLOTargets, TunerConfig, list[float]]:
    names = draw(st.sampled_from([("colocated",), ("prefill", "decode")]))
    times = [1000.0]
    for _ in range(draw(st.integers(0, 5))):
        times.append(times[-1] + draw(st.sampled_from([5.0, 30.0, 61.0, 400.0])))
    pools = {n: PoolInput(draw(pool_metrics(n, times[0])), draw(pool_settings()), draw(pool_limits())) for n in names}
    slo = SLOTargets(draw(st.floats(10, 5000)), draw(st.floats(5, 1000)))
    config = TunerConfig(
        cooldown_s=draw(st.sampled_from([0.0, 30.0, 60.0])),
        knob_relax_stabilization_s=draw(st.sampled_from([0.0, 60.0])),
        scale_down_stabilization_s=draw(st.sampled_from([0.0, 300.0])),
        headroom=draw(st.floats(0, 0.9)),
    )
    return pools, slo, config, times


def within_limits(value: float, knob: str, limits: PoolLimits) -> bool:
    if knob == REPLICAS:
        return limits.min_replicas <= value <= limits.max_replicas and value == int(value)
    allowed = limits.knob(knob)
    return allowed.low <= value <= allowed.high and (knob not in INTEGER_KNOBS or value == int(value))


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_bounds_never_crossed_and_every_decision_has_reasons(case) -> None:
    pools, slo, config, times = case
    tuner, memory = Tuner(config), TunerMemory()
    current = {name: p.current for name, p in pools.items()}
    for now in times:
        inputs = {n: PoolInput(p.metrics, current[n], p.limits) for n, p in pools.items()}
        decision = tuner.decide(inputs, slo, memory, now)
        assert decision.reasons and all(decision.reasons)
        assert decision.hold == any(p.metrics.stale for p in pools.values())
        for change in decision.changes:
            assert change.old == current[change.pool].value(change.knob)
            assert change.old != change.new
            assert change.reason.startswith(f"{change.pool}: ") and any(ch.isdigit() for ch in change.reason)
        for name, after in decision.settings.items():
            for knob in (REPLICAS, *KNOB_FIELDS):
                assert within_limits(after.value(knob), knob, pools[name].limits), (name, knob, decision.reasons)
        current, memory = dict(decision.settings), TunerMemory.load(decision.memory.to_json())


@settings(max_examples=150, deadline=None)
@given(scenarios(), st.floats(0.0, 0.99))
def test_identical_inputs_are_idempotent_within_the_cooldown(case, fraction) -> None:
    pools, slo, config, times = case
    assume(config.cooldown_s > 0)
    tuner = Tuner(config)
    first = tuner.decide(pools, slo, TunerMemory(), times[0])
    assert first == tuner.decide(pools, slo, TunerMemory(), times[0])  # deterministic

    applied = {n: PoolInput(p.metrics, first.settings[n], p.limits) for n, p in pools.items()}
    later = times[0] + fraction * config.cooldown_s
    second = tuner.decide(applied, slo, first.memory, later)
    changed_before = {(c.pool, c.knob) for c in first.changes}
    again = [c for c in second.changes if (c.pool, c.knob) in changed_before]
    assert not again, (first.reasons, second.reasons)
