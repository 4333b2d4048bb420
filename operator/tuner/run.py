"""One tuner run around the pure law (law.py), the same in the operator and in the local fleet:
measure every pool through a ``MetricSource``, decide, hand the new replicas and knobs to an
``Actuator``, and describe the run for status, Events and logs. A disaggregated fleet's router is
measured too, for the TTFT its clients see (status only: the law holds each pool to its share).

Ownership rule while autotune is on (documented in docs/tuner.md): spec bounds win, the tuner owns
the current value. A manual `kubectl scale` or ConfigMap edit is overwritten with the tuner's value
at the next reconcile; users steer through the spec (bounds, min/max replicas, SLOs). A value
outside the spec's bounds is first brought inside them, and that correction is recorded like any
other change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from llmfleet.operator.metrics.source import MetricSource, PoolMetrics, PoolRef, snapshot_widening_latency
from llmfleet.operator.resource.conditions import Condition
from llmfleet.operator.resource.spec import InferenceServiceSpec
from llmfleet.operator.resource.tuner_state import TunerState, effective_engine, effective_replicas
from llmfleet.operator.tuner.decision import OUT_OF_REACH, TOO_MANY
from llmfleet.operator.tuner.law import Decision, PoolInput, PoolLimits, PoolSettings, SLOTargets, Tuner, TunerConfig
from llmfleet.operator.tuner.memory import TunerMemory
from llmfleet.operator.tuner.zero import pools_at_zero, scale_to_zero


@dataclass
class PoolView:
    """What runs now for one pool: replicas and camelCase knobs (maxBatchSize, batchTimeoutMs, ...)."""

    replicas: int
    knobs: dict[str, float]


class Actuator(Protocol):
    def observe(self) -> dict[str, PoolView]: ...

    def apply(self, pool: str, replicas: int | None, knobs: dict[str, float]) -> None:
        """Only what changed: ``replicas`` None if unchanged, ``knobs`` the changed ones."""


@dataclass
class AutotuneOutcome:
    decision: Decision
    status: dict[str, Any]  # tuner (replicas, knobs, memory), lastDecision, latency
    condition: Condition  # TunerActive
    scaling: Condition | None = None  # ScalingLimited; None on a hold, which judged nothing
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    metrics: dict[str, PoolMetrics] = field(default_factory=dict)  # per pool, and the router's where measured
    observed: bool = False  # autotune.mode observe: the decision's changes were not made


ROUTER = "router"  # the key of the router's PoolRef in ``Autotuner.pools``


class InvalidLimits(ValueError):
    """A pool's spec leaves the tuner no value to choose for a knob. Spec validation rejects such
    bounds, so this is a safety net: the run stops and says why instead of failing the same way forever."""


def pool_limits(spec: InferenceServiceSpec) -> dict[str, PoolLimits]:
    limits = {}
    for name in spec.active_pools:
        try:
            limits[name] = PoolLimits.from_spec(spec.pool(name))
        except ValueError as exc:
            raise InvalidLimits(f"pools.{name}: {exc}") from exc
    return limits


def measured_pools(spec: InferenceServiceSpec) -> list[str]:
    """What a run measures: the pools the spec runs, and the router of a disaggregated fleet."""
    return [*spec.active_pools, *([ROUTER] if spec.mode == "disaggregated" else [])]


def metric_window_s(spec: InferenceServiceSpec) -> float:
    """The trailing window each run measures: three intervals, at least 30 s of samples."""
    return float(max(30, 3 * spec.autotune.interval_seconds))


def views_from_state(spec: InferenceServiceSpec, state: TunerState | None) -> dict[str, PoolView]:
    """What reconcile makes of a tuner state: the spec's values, the tuner's where it has one, in bounds."""
    views = {}
    for pool in spec.active_pools:
        engine = effective_engine(spec, pool, state)
        settings = PoolSettings.from_engine(effective_replicas(spec, pool, state), engine)
        views[pool] = PoolView(settings.replicas, dict(settings.knobs))
    return views


class Autotuner:
    def __init__(
        self,
        spec: InferenceServiceSpec,
        source: MetricSource,
        pools: dict[str, PoolRef],
        *,
        tuner: Tuner | None = None,
        memory: TunerMemory | None = None,
    ) -> None:
        """``pools``: the PoolRef of each pool the spec runs, and of the router (key ``ROUTER``) where
        the fleet has one; without it, status adds the prefill and decode p95s for TTFT."""
        self.spec = spec
        self.source = source
        self.pools = pools
        self.tuner = tuner or Tuner(TunerConfig.from_autotune(spec.autotune))
        self.memory = memory or TunerMemory()

    async def step(self, actuator: Actuator, now: float) -> AutotuneOutcome:
        spec = self.spec
        limits = pool_limits(spec)
        current = actuator.observe()
        window = metric_window_s(spec)
        metrics: dict[str, PoolMetrics] = {}
        inputs: dict[str, PoolInput] = {}
        zero = pools_at_zero(spec, {name: view.replicas for name, view in current.items()})
        for name in spec.active_pools:
            if name in zero:  # no pods to measure: zero.py keeps it there or brings it back
                continue
            metrics[name] = await snapshot_widening_latency(
                self.source, self.pools[name], window, float(spec.slo.window_seconds)
            )
            view = current[name]
            settings = PoolSettings(view.replicas, view.knobs)
            inputs[name] = PoolInput(metrics[name], settings, limits[name], spec.pool(name).parallelism.devices)
        client = await self._client_side(window)
        decision = self.tuner.decide(inputs, SLOTargets.from_spec(spec.slo), self.memory, now)
        settings_now = {name: PoolSettings(view.replicas, view.knobs) for name, view in current.items()}
        decision = scale_to_zero(decision, spec, metrics, settings_now, now)
        self.memory = decision.memory
        observe = spec.autotune.mode == "observe"
        for name, settings in decision.settings.items():
            was = current[name]
            knobs = {k: v for k, v in settings.knobs.items() if was.knobs.get(k) != v}
            replicas = settings.replicas if settings.replicas != was.replicas else None
            if (knobs or replicas is not None) and not observe:
                actuator.apply(name, replicas, knobs)
        return AutotuneOutcome(
            decision=decision,
            status=self._status(decision, metrics, client, observe),
            condition=_condition(decision, observe),
            scaling=_scaling_condition(decision),
            events=_events(decision, observe),
            metrics=metrics | ({ROUTER: client} if client is not None else {}),
            observed=observe,
        )

    async def _client_side(self, window_s: float) -> PoolMetrics | None:
        """The router's snapshot (what its clients saw) where its ref was given (measured_pools
        names it for a disaggregated fleet); None otherwise. It has no engine gauges, so a source
        may call it stale for want of them: only its latency histograms are read, over the pools'
        metric window (never widened: too few first tokens there and status adds the pools' p95s)."""
        ref = self.pools.get(ROUTER)
        return None if ref is None else await self.source.snapshot(ref, window_s)

    def _status(
        self, decision: Decision, metrics: dict[str, PoolMetrics], client: PoolMetrics | None, observe: bool = False
    ) -> dict[str, Any]:
        """An observing tuner keeps only its memory in ``status.tuner``: the replicas and knobs
        there are what reconcile applies, and it applies none of an observer's."""
        owned = {} if observe else decision.tuner_status()
        status: dict[str, Any] = {
            "tuner": {**owned, "memory": decision.memory.model_dump(mode="json")},
            "lastDecision": decision.last_decision_status() | ({"observed": True} if observe else {}),
        }
        # written whole too: spend against need, per pool, where two runs span it
        status["cost"] = {pool: inputs["cost"] for pool, inputs in decision.inputs.items() if "cost" in inputs}
        # Always written whole: a p95 this run could not measure is gone, not left under a new time.
        status["latency"] = {**_latency(self.spec, metrics, client), "at": status["lastDecision"]["time"]}
        return status


def _latency(
    spec: InferenceServiceSpec, metrics: dict[str, PoolMetrics], client: PoolMetrics | None = None
) -> dict[str, Any]:
    """p95s in ms for the printer columns, and where the TTFT was read (``ttftFrom``). ITL and
    queue time from the pool that owns them. TTFT as clients see it: in disaggregated mode the
    router's, which times the whole wait (the prefill, then the decode server's first token), when
    its window holds enough first tokens; else the two pools' p95s added, as the tuner judges them,
    or the prefill pool's alone while the decode pool's is unknown. The sum leaves out the router's
    own hops (the local fleet's tiny model: 35 ms added against the router's 44-65 ms) and
    overstates where the slow prefills and the slow decode starts are not the same requests."""
    disaggregated = spec.mode == "disaggregated"
    ttft_pool = "prefill" if disaggregated else "colocated"
    itl_pool = "decode" if disaggregated else "colocated"
    out: dict[str, Any] = {}
    for key, pool, attr in (
        ("ttftP95Ms", ttft_pool, "ttft"),
        ("itlP95Ms", itl_pool, "itl"),
        ("queueP95Ms", ttft_pool, "queue_time"),
    ):
        m = metrics.get(pool)
        value = getattr(m, attr).p95 if m is not None else None
        if value is not None:
            out[key] = _ms(value)
    if client is not None and client.ttft.p95 is not None:
        return out | {"ttftP95Ms": _ms(client.ttft.p95), "ttftFrom": ROUTER}
    if "ttftP95Ms" not in out:
        return out
    decode = metrics.get("decode")
    added = decode.ttft.p95 if decode is not None and disaggregated else None
    if added is None:
        return out | {"ttftFrom": ttft_pool}
    return out | {"ttftP95Ms": round(out["ttftP95Ms"] + added * 1000.0, 1), "ttftFrom": "prefill+decode"}


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 1)


def _condition(decision: Decision, observe: bool = False) -> Condition:
    c = decision.condition()
    if observe and c["reason"] in ("Adjusted", "Steady"):
        reason = "Observing" if c["reason"] == "Adjusted" else "Steady"
        return Condition(c["type"], c["status"], reason, ("observe mode, nothing changed: " + c["message"]))
    return Condition(c["type"], c["status"], c["reason"], c["message"])


def _scaling_condition(decision: Decision) -> Condition | None:
    c = decision.scaling_condition()
    return None if c is None else Condition(c["type"], c["status"], c["reason"], c["message"])


LIMITS_TO_WARN = (TOO_MANY, OUT_OF_REACH)  # what a user acts on; an idle pool at its minimum is not news


def scaling_event(scaling: Condition | None, previous_reason: str | None) -> tuple[str, str, str] | None:
    """A Warning as a pool's replicas come to be held from what its SLOs ask (above maxReplicas,
    or an SLO no count meets), once per such reason rather than every run: ``previous_reason``
    is the last ScalingLimited reason while it was True, None otherwise."""
    if scaling is None or scaling.status != "True" or scaling.reason not in LIMITS_TO_WARN:
        return None
    if scaling.reason == previous_reason:
        return None
    return ("Warning", scaling.reason, scaling.message)


def _events(decision: Decision, observe: bool = False) -> list[tuple[str, str, str]]:
    """A ``Tuned`` event per change; in observe mode ``WouldTune``, saying it was not made."""
    if observe:
        events = [("Normal", "WouldTune", f"{c} (observe mode: not made): {c.reason}") for c in decision.changes]
    else:
        events = [("Normal", "Tuned", f"{c}: {c.reason}") for c in decision.changes]
    if decision.hold:
        events.append(("Warning", "TunerHolding", decision.hold_reason))
    return events
