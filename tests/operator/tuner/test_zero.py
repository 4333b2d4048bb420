"""Scale to zero (operator/tuner/zero.py) through one tuner run: an idle pool that may go to zero
goes once idle long enough, a pool at zero stays (unmeasured) until woken or until the fleet is
busy elsewhere, and the reasons say so."""

from __future__ import annotations

from llmfleet.operator.metrics.source import PoolRef
from llmfleet.operator.resource.spec import parse_spec
from llmfleet.operator.resource.tuner_state import TunerState, pools_to_wake
from llmfleet.operator.tuner.run import Autotuner, views_from_state
from llmfleet.operator.tuner.zero import idle
from tests.operator.tuner.scenarios import metrics
from tests.operator.tuner.test_run import RecordingActuator


def spec(min_replicas: int = 0, mode: str = "colocated"):
    pools = {"colocated": {"minReplicas": min_replicas}} if mode == "colocated" else {"prefill": {}, "decode": {}}
    if mode != "colocated":
        pools = {pool: {"minReplicas": min_replicas} for pool in pools}
    return parse_spec(
        {
            "model": {"builtin": "tiny"},
            "slo": {"ttftP95Ms": 500, "itlP95Ms": 100},
            "mode": mode,
            "pools": pools,
            "autotune": {"intervalSeconds": 10, "scaleToZeroAfterSeconds": 60},
        }
    )


IDLE = {"rate": 0.0, "running": 0.0, "waiting": 0.0, "prompt_tps": 0.0, "gen_tps": 0.0}


class Source:
    def __init__(self, **per_pool) -> None:
        self.per_pool = per_pool
        self.asked: list[str] = []

    async def snapshot(self, pool: PoolRef, window_s: float):
        self.asked.append(pool.pool)
        return metrics(pool.pool, **self.per_pool.get(pool.pool, IDLE))


def refs(the_spec):
    return {pool: PoolRef("ml", "svc", pool) for pool in the_spec.active_pools}


async def run(the_spec, tuner: Autotuner, state: TunerState, now: float):
    actuator = RecordingActuator(views_from_state(the_spec, state))
    outcome = await tuner.step(actuator, now)
    for pool, replicas, _ in actuator.applied:
        if replicas is not None:
            state.replicas[pool] = replicas
    return outcome, actuator.applied


def test_idle_needs_measured_zeros():
    assert idle(metrics(**IDLE))
    assert not idle(metrics(**{**IDLE, "rate": 0.1}))
    assert not idle(metrics(**{**IDLE, "running": None}))  # not measured is not idle
    assert not idle(metrics(**IDLE, stale=True)) and not idle(None)


async def test_an_idle_pool_goes_to_zero_after_the_idle_period_and_stays_there_unmeasured():
    the_spec, state = spec(), TunerState()
    source = Source()
    tuner = Autotuner(the_spec, source, refs(the_spec))
    outcome, applied = await run(the_spec, tuner, state, 1000.0)
    assert applied == [] and "idle for 0 s; at zero after 60 s" in outcome.status["lastDecision"]["reason"]
    outcome, applied = await run(the_spec, tuner, state, 1030.0)
    assert applied == []
    outcome, applied = await run(the_spec, tuner, state, 1060.0)
    assert applied == [("colocated", 0, {})]
    (change,) = outcome.decision.changes
    assert (change.old, change.new) == (1, 0) and "idle for 60 s" in change.reason and "wakes it" in change.reason
    assert outcome.status["tuner"]["replicas"] == {"colocated": 0}
    asked = len(source.asked)
    outcome, applied = await run(the_spec, tuner, state, 1070.0)
    assert applied == [] and len(source.asked) == asked  # no pods: nothing measured, nothing moved
    assert "at zero replicas (idle)" in outcome.status["lastDecision"]["reason"]
    assert outcome.status["tuner"]["replicas"] == {"colocated": 0}  # status keeps it at zero
    assert pools_to_wake(the_spec, state) == {"colocated": 1}


async def test_traffic_resets_the_idle_clock_and_a_floor_above_zero_never_goes():
    the_spec, state = spec(), TunerState()
    source = Source()
    tuner = Autotuner(the_spec, source, refs(the_spec))
    await run(the_spec, tuner, state, 1000.0)
    source.per_pool["colocated"] = {**IDLE, "rate": 0.5, "running": 1.0, "prompt_tps": 10.0, "gen_tps": 10.0}
    await run(the_spec, tuner, state, 1050.0)
    source.per_pool.clear()
    outcome, applied = await run(the_spec, tuner, state, 1070.0)
    assert applied == [] and "idle for 0 s" in outcome.status["lastDecision"]["reason"]

    floor, floor_state = spec(min_replicas=1), TunerState()
    tuner = Autotuner(floor, Source(), refs(floor))
    for now in range(1000, 1500, 30):
        _, applied = await run(floor, tuner, floor_state, float(now))
        assert all(replicas != 0 for _, replicas, _ in applied)


async def test_a_disaggregated_fleet_goes_to_zero_together_and_a_pool_left_at_zero_comes_back_for_traffic():
    the_spec, state = spec(mode="disaggregated"), TunerState()
    source = Source(decode={**IDLE, "running": 2.0})  # decode still streams: nothing goes
    tuner = Autotuner(the_spec, source, refs(the_spec))
    for now in (1000.0, 1100.0):
        _, applied = await run(the_spec, tuner, state, now)
        assert all(replicas != 0 for _, replicas, _ in applied)
    source.per_pool.clear()
    await run(the_spec, tuner, state, 1200.0)
    _, applied = await run(the_spec, tuner, state, 1260.0)
    assert sorted(applied) == [("decode", 0, {}), ("prefill", 0, {})]

    state.replicas["decode"] = 1  # woken alone (a request the router sent on without prefill)
    source.per_pool["decode"] = {**IDLE, "rate": 1.0, "running": 1.0, "gen_tps": 50.0}
    outcome, applied = await run(the_spec, tuner, state, 1270.0)
    assert ("prefill", 1, {}) in applied
    assert any("prefill: at zero while decode serves requests" in c.reason for c in outcome.decision.changes)
