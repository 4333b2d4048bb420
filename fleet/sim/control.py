"""The real tuner in the loop: operator/tuner/run.py's ``Autotuner`` (the same run the operator's
daemon and the local fleet make) reads the simulated pools through ``SimMetricSource`` and acts
through ``FleetActuator``: knobs become each pool's live engine config (as the ConfigMap write
does), replicas start or drain pods (as the Deployment's scale does)."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

from llmfleet.operator.resource.tuner_state import TunerState, effective_engine, effective_replicas, pools_to_wake
from llmfleet.operator.tuner.law import Tuner, TunerConfig
from llmfleet.operator.tuner.run import Autotuner, PoolView, views_from_state
from llmfleet.sim.fleet import ControlRecord, Fleet, TunerRun

T = TypeVar("T")


def run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never waits on anything (the simulated metric source answers at once)."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("the simulated control loop awaited real I/O")


class FleetActuator:
    """``operator.autotune.Actuator`` over the simulated fleet, as the local fleet's actuator."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.state = TunerState()

    def observe(self) -> dict[str, PoolView]:
        return views_from_state(self.fleet.spec, self.state)

    def apply(self, pool: str, replicas: int | None, knobs: dict[str, float]) -> None:
        spec = self.fleet.spec
        if replicas is not None:
            self.state.replicas[pool] = replicas
        if knobs:
            self.state.knobs[pool] = {**self.state.knobs.get(pool, {}), **knobs}
            self.fleet.set_engine(pool, effective_engine(spec, pool, self.state))
        self.fleet.scale(pool, effective_replicas(spec, pool, self.state))


class TunerController:
    name = "tuner"

    def __init__(self, fleet: Fleet, config: TunerConfig | None = None) -> None:
        spec = fleet.spec
        self.fleet = fleet
        self.interval_s = float(spec.autotune.interval_seconds)
        refs = {pool: fleet.pool_ref(pool) for pool in spec.active_pools}
        self.autotuner = Autotuner(spec, fleet.metric_source, refs, tuner=Tuner(config) if config else None)
        self.actuator = FleetActuator(fleet)
        self.runs = 0
        # per run: (time, {pool: (replicas it leaves, replicas it judged needed)}), for the bench
        self.needed: list[tuple[float, dict[str, tuple[int, float]]]] = []
        # per ScalingLimited reason while True: runs, first and last time, the last message
        self.limited: dict[str, dict[str, Any]] = {}
        fleet.wake_hook = self.wake

    def wake(self) -> None:
        """A request at the router for a pool at zero: the pools at zero go to their floor at once,
        as the operator's wake handler sets them, not at the next run."""
        for pool, replicas in pools_to_wake(self.fleet.spec, self.actuator.state).items():
            self.actuator.apply(pool, replicas, {})

    def control(self, now: float) -> None:
        outcome = run_sync(self.autotuner.step(self.actuator, now))
        self.runs += 1
        decision = outcome.decision
        scaling = outcome.scaling
        if scaling is not None and scaling.status == "True":
            seen = self.limited.setdefault(scaling.reason, {"runs": 0, "first_s": now})
            seen.update(runs=seen["runs"] + 1, last_s=now, message=scaling.message)
        if not decision.hold:
            self.needed.append(
                (
                    now,
                    {  # a pool at zero is not judged: it needs what it runs
                        pool: (s.replicas, float(decision.inputs.get(pool, {}).get("neededReplicas", s.replicas)))
                        for pool, s in decision.settings.items()
                    },
                )
            )
        changes = [c.to_dict() for c in decision.changes]
        if self.fleet.options.record_runs:
            self.fleet.runs.append(
                TunerRun(
                    at=now,
                    replicas={pool: int(s.replicas) for pool, s in decision.settings.items()},
                    changes=changes,
                    hold=decision.hold,
                    reasons=list(decision.reasons),
                )
            )
        if decision.changes or decision.hold:
            self.fleet.decisions.append(
                ControlRecord(
                    at=now,
                    controller=self.name,
                    changes=changes,
                    hold=decision.hold,
                    reason=decision.hold_reason if decision.hold else "; ".join(c.reason for c in decision.changes),
                )
            )
