"""The tuner's decisions as Prometheus metrics of the operator process, so Grafana can plot them
next to the latencies they answer (annotations from the decision counter, knob and replica lines)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from llmfleet.operator.resource.spec import SLO as SLO_SPEC
from llmfleet.operator.tuner.decision import OUT_OF_REACH, TOO_FEW, TOO_MANY
from llmfleet.operator.tuner.decision import REPLICAS as REPLICAS_KNOB
from llmfleet.operator.tuner.run import AutotuneOutcome

REGISTRY = CollectorRegistry()
SCALING_LIMIT_REASONS = (TOO_MANY, TOO_FEW, OUT_OF_REACH)

DECISIONS = Counter(
    "llmfleet_tuner_decisions",
    "Changes the tuner made, by pool, knob (or replicas) and direction.",
    ["namespace", "inference_service", "pool", "knob", "direction"],
    registry=REGISTRY,
)
KNOB_VALUE = Gauge(
    "llmfleet_tuner_knob_value",
    "The tuner's current value of each knob.",
    ["namespace", "inference_service", "pool", "knob"],
    registry=REGISTRY,
)
REPLICAS = Gauge(
    "llmfleet_tuner_replicas",
    "The tuner's replica count per pool.",
    ["namespace", "inference_service", "pool"],
    registry=REGISTRY,
)
HOLD = Gauge(
    "llmfleet_tuner_hold",
    "1 while the tuner holds (stale or missing metrics), else 0.",
    ["namespace", "inference_service"],
    registry=REGISTRY,
)
OBSERVING = Gauge(
    "llmfleet_tuner_observe_mode",
    "1 while autotune.mode is observe: the decisions, knob and replica series are what the tuner would do.",
    ["namespace", "inference_service"],
    registry=REGISTRY,
)
REPLICA_MINUTES = Gauge(
    "llmfleet_tuner_replica_minutes",
    "Per pool, over the tuner's trailing cost window: replica-minutes run (kind=spent) and those its "
    "own demand estimate said were needed (kind=needed).",
    ["namespace", "inference_service", "pool", "kind"],
    registry=REGISTRY,
)
EXCESS = Gauge(
    "llmfleet_tuner_excess_ratio",
    "Per pool: replica-minutes run over those needed, over the tuner's trailing cost window.",
    ["namespace", "inference_service", "pool"],
    registry=REGISTRY,
)
SCALING_LIMITED = Gauge(
    "llmfleet_tuner_scaling_limited",
    "Per pool, 1 while its replicas are held from what its SLOs ask, by reason (the ScalingLimited "
    "condition's: TooManyReplicas, TooFewReplicas, SLOOutOfReach), else 0.",
    ["namespace", "inference_service", "pool", "reason"],
    registry=REGISTRY,
)
SLO = Gauge(
    "llmfleet_slo_seconds",
    "The InferenceService's p95 SLOs (kind: ttft, itl), for dashboards and alerts.",
    ["namespace", "inference_service", "kind"],
    registry=REGISTRY,
)
RUNS = Counter(
    "llmfleet_tuner_runs",
    "Tuner runs, by outcome (the TunerActive reason: Adjusted, Steady, MetricsUnavailable).",
    ["namespace", "inference_service", "outcome"],
    registry=REGISTRY,
)


def record(namespace: str, name: str, outcome: AutotuneOutcome, slo: SLO_SPEC) -> None:
    decision = outcome.decision
    SLO.labels(namespace, name, "ttft").set(slo.ttft_p95_ms / 1000.0)
    SLO.labels(namespace, name, "itl").set(slo.itl_p95_ms / 1000.0)
    RUNS.labels(namespace, name, outcome.condition.reason).inc()
    HOLD.labels(namespace, name).set(1 if decision.hold else 0)
    OBSERVING.labels(namespace, name).set(1 if outcome.observed else 0)
    for pool, inputs in decision.inputs.items():
        cost = inputs.get("cost")
        if cost:
            REPLICA_MINUTES.labels(namespace, name, pool, "spent").set(cost["replicaMinutes"])
            REPLICA_MINUTES.labels(namespace, name, pool, "needed").set(cost["neededReplicaMinutes"])
            if cost.get("excess") is not None:
                EXCESS.labels(namespace, name, pool).set(cost["excess"])
    # Every decision series exists at 0 from the first run: one born at 1 is invisible to
    # increase()/changes(), so a pool's first decision would never show on a dashboard.
    for pool, settings in decision.settings.items():
        for knob in (*settings.knobs, REPLICAS_KNOB):
            for direction in ("up", "down"):
                DECISIONS.labels(namespace, name, pool, knob, direction)
    for change in decision.changes:
        direction = "up" if change.new > change.old else "down"
        DECISIONS.labels(namespace, name, change.pool, change.knob, direction).inc()
    if not decision.hold:  # a hold judged nothing: the last run's word stands
        for pool in decision.settings:
            limit = decision.limits.get(pool)
            for reason in SCALING_LIMIT_REASONS:
                SCALING_LIMITED.labels(namespace, name, pool, reason).set(
                    1 if limit is not None and limit.reason == reason else 0
                )
    for pool, settings in decision.settings.items():
        REPLICAS.labels(namespace, name, pool).set(settings.replicas)
        for knob, value in settings.knobs.items():
            KNOB_VALUE.labels(namespace, name, pool, knob).set(value)
    _forget_pools(namespace, name, keep=set(decision.settings))


def _forget_pools(namespace: str, name: str, keep: set[str]) -> None:
    """Drop the series of pools the InferenceService no longer runs (a mode switch), which would
    otherwise stay frozen at their last value on every dashboard."""
    for metric in (DECISIONS, KNOB_VALUE, REPLICAS, REPLICA_MINUTES, EXCESS, SCALING_LIMITED):
        for labels in list(metric._metrics):
            if labels[:2] == (namespace, name) and labels[2] not in keep:
                metric.remove(*labels)


def forget(namespace: str, name: str) -> None:
    """Drop an InferenceService's series: deleted, or its tuner turned off."""
    for metric in (
        DECISIONS,
        KNOB_VALUE,
        REPLICAS,
        HOLD,
        RUNS,
        SLO,
        OBSERVING,
        REPLICA_MINUTES,
        EXCESS,
        SCALING_LIMITED,
    ):
        for labels in list(metric._metrics):
            if labels[:2] == (namespace, name):
                metric.remove(*labels)
