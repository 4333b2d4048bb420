"""One tuner run around the law (operator/tuner/run.py): what reaches the actuator, and what the
run reports for status, the TunerActive condition and Events."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from llmfleet.operator import decision_metrics
from llmfleet.operator.daemon import _StatusActuator
from llmfleet.operator.metrics.source import PoolMetrics, PoolRef
from llmfleet.operator.resource.spec import Bound, SpecError, parse_spec
from llmfleet.operator.resource.tuner_state import TunerState
from llmfleet.operator.tuner.memory import TunerMemory
from llmfleet.operator.tuner.run import Autotuner, PoolView, measured_pools, views_from_state
from tests.operator.tuner.scenarios import metrics

SPEC = parse_spec(
    {
        "model": {"builtin": "tiny"},
        "slo": {"ttftP95Ms": 500, "itlP95Ms": 100},
        "pools": {"colocated": {"minReplicas": 1, "maxReplicas": 4, "engine": {"maxBatchSize": 32}}},
        "autotune": {"intervalSeconds": 10, "cooldownSeconds": 0},
    }
)
REF = PoolRef("ns", "chat", "colocated")


class FixedSource:
    def __init__(self, snapshot: PoolMetrics) -> None:
        self.snapshot_value = snapshot
        self.asked: list[tuple[PoolRef, float]] = []

    async def snapshot(self, pool: PoolRef, window_s: float) -> PoolMetrics:
        self.asked.append((pool, window_s))
        return self.snapshot_value


class RecordingActuator:
    def __init__(self, views: dict[str, PoolView]) -> None:
        self.views = views
        self.applied: list[tuple[str, int | None, dict[str, float]]] = []

    def observe(self) -> dict[str, PoolView]:
        return self.views

    def apply(self, pool: str, replicas: int | None, knobs: dict[str, float]) -> None:
        self.applied.append((pool, replicas, knobs))


async def test_an_itl_violation_shrinks_the_batch_and_says_why():
    source = FixedSource(metrics(itl_ms=180.0, ttft_ms=200.0))
    actuator = RecordingActuator(views_from_state(SPEC, None))
    outcome = await Autotuner(SPEC, source, {"colocated": REF}).step(actuator, now=1000.0)
    assert source.asked == [(REF, 30.0), (REF, 60.0)]  # the metric window, then the SLO's for replicas
    (pool, _, knobs), *_ = actuator.applied
    assert pool == "colocated" and knobs["maxBatchSize"] < 32
    assert outcome.status["tuner"]["knobs"]["colocated"]["maxBatchSize"] == knobs["maxBatchSize"]
    assert "ITL p95 180 ms > SLO 100 ms" in outcome.status["lastDecision"]["reason"]
    assert outcome.status["latency"]["itlP95Ms"] == 180.0
    assert outcome.condition.status == "True" and outcome.condition.reason == "Adjusted"
    assert any(reason == "Tuned" and "maxBatchSize" in message for _, reason, message in outcome.events)
    TunerMemory.model_validate(outcome.status["tuner"]["memory"])  # what status keeps can be read back


async def test_stale_metrics_hold_and_warn():
    source = FixedSource(metrics().with_staleness(True, "colocated: no pods to scrape"))
    actuator = RecordingActuator(views_from_state(SPEC, None))
    outcome = await Autotuner(SPEC, source, {"colocated": REF}).step(actuator, now=1000.0)
    assert actuator.applied == []
    assert outcome.condition.status == "False" and outcome.condition.reason == "MetricsUnavailable"
    assert "no pods to scrape" in outcome.condition.message
    assert outcome.events[-1][:2] == ("Warning", "TunerHolding")


def test_views_follow_the_tuner_state_within_the_spec_bounds():
    state = TunerState(replicas={"colocated": 9}, knobs={"colocated": {"maxBatchSize": 48}})
    view = views_from_state(SPEC, state)["colocated"]
    assert view.replicas == 4  # maxReplicas wins over the tuner's 9
    assert view.knobs["maxBatchSize"] == 48


async def test_a_value_the_spec_bounds_moved_past_is_corrected_and_recorded():
    """The operator's actuator shows the tuner's own values: a maxReplicas lowered under them is a
    recorded change (lastDecision, a Tuned event), even in a run that holds for want of metrics."""
    state = TunerState(replicas={"colocated": 9}, knobs={"colocated": {"maxBatchSize": 48}})
    narrowed = SPEC.model_copy(deep=True)
    narrowed.pools["colocated"].bounds["maxBatchSize"] = Bound(min=8, max=16)
    source = FixedSource(metrics().with_staleness(True, "colocated: no pods to scrape"))
    actuator = _StatusActuator(narrowed, state)
    outcome = await Autotuner(narrowed, source, {"colocated": REF}).step(actuator, now=1000.0)
    moved = {(c.knob, c.old, c.new) for c in outcome.decision.changes}
    assert moved == {("replicas", 9, 4), ("maxBatchSize", 48, 16)}
    assert all("spec bounds win" in c.reason for c in outcome.decision.changes)
    assert [e[1] for e in outcome.events].count("Tuned") == 2
    assert state.replicas["colocated"] == 4 and state.knobs["colocated"]["maxBatchSize"] == 16


async def test_the_series_of_a_pool_the_fleet_no_longer_runs_are_dropped():
    """After a switch to disaggregated mode, llmfleet_tuner_replicas{pool="colocated"} would stay
    on every dashboard at its last value."""
    disaggregated = parse_spec(
        {
            "model": {"builtin": "tiny"},
            "slo": {"ttftP95Ms": 500, "itlP95Ms": 100},
            "mode": "disaggregated",
            "pools": {"prefill": {"maxReplicas": 4}, "decode": {"maxReplicas": 4}},
        }
    )
    for spec in (SPEC, disaggregated):
        refs = {pool: PoolRef("ns", "switching", pool) for pool in spec.active_pools}
        actuator = RecordingActuator(views_from_state(spec, None))
        outcome = await Autotuner(spec, FixedSource(metrics()), refs).step(actuator, now=1000.0)
        decision_metrics.record("ns", "switching", outcome, spec.slo)
    exposed = generate_latest(decision_metrics.REGISTRY).decode()
    decision_metrics.forget("ns", "switching")
    assert 'inference_service="switching",namespace="ns",pool="decode"' in exposed
    assert 'pool="colocated"' not in exposed


DISAGGREGATED = parse_spec(
    {
        "model": {"builtin": "tiny"},
        "slo": {"ttftP95Ms": 500, "itlP95Ms": 100},
        "mode": "disaggregated",
        "pools": {"prefill": {"maxReplicas": 4}, "decode": {"maxReplicas": 4}},
    }
)


def test_a_disaggregated_fleets_ttft_column_is_the_routers_else_the_pools_added():
    """Clients wait for the prefill, then for the decode server's first token. The router times
    that whole wait; while it has too few first tokens in its window, the column shows the two
    pools' p95s added, as the tuner judges them, not the prefill server's alone."""
    from llmfleet.operator.tuner.run import _latency

    pools = {"prefill": metrics("prefill", ttft_ms=300, queue_ms=40)}
    pools["decode"] = metrics("decode", ttft_ms=150, itl_ms=30)
    router = metrics("router", ttft_ms=410, itl_ms=35)
    assert _latency(DISAGGREGATED, pools, router) == {
        "ttftP95Ms": 410.0,
        "ttftFrom": "router",
        "itlP95Ms": 30.0,
        "queueP95Ms": 40.0,
    }
    too_few = metrics("router", ttft_ms=None).with_staleness(True, "router: 0 pods reporting")
    for client in (too_few, None):
        assert _latency(DISAGGREGATED, pools, client) == {
            "ttftP95Ms": 450.0,
            "ttftFrom": "prefill+decode",
            "itlP95Ms": 30.0,
            "queueP95Ms": 40.0,
        }
    pools["decode"] = metrics("decode", ttft_ms=None, itl_ms=30)
    assert _latency(DISAGGREGATED, pools)["ttftP95Ms"] == 300.0
    assert _latency(DISAGGREGATED, pools)["ttftFrom"] == "prefill"
    assert _latency(SPEC, {"colocated": metrics()}, None)["ttftFrom"] == "colocated"


class ByPool:
    def __init__(self, snapshots: dict[str, PoolMetrics]) -> None:
        self.snapshots = snapshots
        self.asked: list[str] = []

    async def snapshot(self, pool: PoolRef, window_s: float) -> PoolMetrics:
        self.asked.append(pool.pool)
        return self.snapshots[pool.pool]


async def test_a_run_measures_the_router_of_a_disaggregated_fleet_for_its_status_only():
    """The router's snapshot has no engine gauges (a source may call it stale for that): its TTFT
    goes to status and to the local fleet's view, and the law never sees it."""
    refs = {pool: PoolRef("ns", "pd", pool) for pool in measured_pools(DISAGGREGATED)}
    assert list(refs) == ["prefill", "decode", "router"]
    router = metrics("router", ttft_ms=420, running=None, waiting=None).with_staleness(True, "no gauges")
    source = ByPool({"prefill": metrics("prefill"), "decode": metrics("decode"), "router": router})
    actuator = RecordingActuator(views_from_state(DISAGGREGATED, None))
    outcome = await Autotuner(DISAGGREGATED, source, refs).step(actuator, now=1000.0)
    assert source.asked.count("router") == 1
    assert not outcome.decision.hold  # a router without gauges holds nothing
    assert set(outcome.decision.inputs) == {"prefill", "decode"}
    assert outcome.status["latency"]["ttftP95Ms"] == 420.0 and outcome.status["latency"]["ttftFrom"] == "router"
    assert outcome.metrics["router"] is router
    # without the router's ref (the simulator's fleets), nothing asks for it
    colocated = ByPool({"colocated": metrics()})
    await Autotuner(SPEC, colocated, {"colocated": REF}).step(RecordingActuator(views_from_state(SPEC, None)), 1000.0)
    assert "router" not in colocated.asked and measured_pools(SPEC) == ["colocated"]


async def test_observe_mode_decides_and_reports_but_changes_nothing():
    """autotune.mode observe: the same decision, in lastDecision, Events and the decision metrics,
    none of it applied, and no replicas or knobs in status.tuner for reconcile to apply."""
    spec = parse_spec(SPEC.model_dump(by_alias=True, exclude_none=True) | {"autotune": {"mode": "observe"}})
    source = FixedSource(metrics(itl_ms=180.0, ttft_ms=200.0))
    actuator = RecordingActuator(views_from_state(spec, None))
    outcome = await Autotuner(spec, source, {"colocated": REF}).step(actuator, now=1000.0)
    assert actuator.applied == []
    assert outcome.observed and outcome.decision.changed("colocated", "maxBatchSize") is not None
    assert set(outcome.status["tuner"]) == {"memory"}
    assert outcome.status["lastDecision"]["observed"] is True
    assert outcome.status["lastDecision"]["changes"][0]["knob"] == "maxBatchSize"
    assert outcome.condition.reason == "Observing" and outcome.condition.message.startswith("observe mode")
    assert [reason for _, reason, _ in outcome.events] == ["WouldTune"]
    assert "not made" in outcome.events[0][2]
    decision_metrics.record("ns", "observed", outcome, spec.slo)
    text = generate_latest(decision_metrics.REGISTRY).decode()
    assert 'llmfleet_tuner_observe_mode{inference_service="observed",namespace="ns"} 1.0' in text
    would = outcome.decision.settings["colocated"].knobs["maxBatchSize"]
    assert f'knob="maxBatchSize",namespace="ns",pool="colocated"}} {would:.1f}' in text  # the would-be value
    decision_metrics.forget("ns", "observed")
    # an external autoscaler may run beside an observing tuner, not beside an acting one
    raw = spec.model_dump(by_alias=True, exclude_none=True) | {"externalAutoscaler": True}
    assert parse_spec(raw).external_autoscaler
    with pytest.raises(SpecError, match="externalAutoscaler needs"):
        parse_spec(raw | {"autotune": {"mode": "act"}})


def test_an_observing_tuners_status_is_not_applied_by_reconcile():
    from llmfleet.operator.reconcile.converge import tuner_state

    spec = parse_spec(SPEC.model_dump(by_alias=True, exclude_none=True) | {"autotune": {"mode": "observe"}})
    status = {"tuner": {"replicas": {"colocated": 3}, "knobs": {"colocated": {"maxBatchSize": 8}}}}
    assert tuner_state(spec, status) is None
    assert tuner_state(SPEC, status).replicas == {"colocated": 3}
