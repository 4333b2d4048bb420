"""What the tuner owns of an InferenceService (``status.tuner``), and what each pool runs once the
tuner's values meet the spec's bounds: the one answer the reconcile pass, the tuner, the local
fleet and the simulator all read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmfleet.operator.resource.spec import TUNABLE_KNOBS, InferenceServiceSpec, knob_range
from llmfleet.server.config import EngineConfig, ValidationError


@dataclass
class TunerState:
    """What the tuner owns: current replicas and knobs per pool (spec bounds still win).

    It lives in the InferenceService's ``status.tuner``: {replicas: {pool: n}, knobs: {pool:
    {maxBatchSize: 48, batchTimeoutMs: 5, maxNumBatchedTokens: 2048}}}.
    """

    replicas: dict[str, int] = field(default_factory=dict)
    knobs: dict[str, dict[str, float]] = field(default_factory=dict)  # pool -> camelCase knob -> value

    @classmethod
    def from_status(cls, status: dict[str, Any] | None) -> TunerState:
        tuner = (status or {}).get("tuner") or {}
        return cls(replicas=dict(tuner.get("replicas") or {}), knobs=dict(tuner.get("knobs") or {}))


def effective_engine(spec: InferenceServiceSpec, pool: str, tuner: TunerState | None) -> EngineConfig:
    """The pool's engine config: spec knobs, overridden by the tuner's, clamped to spec bounds."""
    pool_spec = spec.pool(pool)
    config = pool_spec.engine_config()  # validate_assignment: each setattr below is checked
    tuned = (tuner.knobs.get(pool) if tuner else None) or {}
    for knob, attr in TUNABLE_KNOBS.items():
        for value in (tuned.get(knob), getattr(config, attr)):  # the tuner's value, else the spec's
            if value is None:
                continue
            bound = pool_spec.bounds.get(knob)
            try:
                if bound is not None:  # whole numbers within a fractional bound, as the tuner reads it
                    low, high = knob_range(knob, *bound.limits())
                    value = min(max(value, low), high)
                setattr(config, attr, type(getattr(config, attr))(value))
                break
            except (ValidationError, TypeError, ValueError):  # outside what the engine accepts
                continue
    return config


def effective_replicas(spec: InferenceServiceSpec, pool: str, tuner: TunerState | None) -> int:
    pool_spec = spec.pool(pool)
    wanted = tuner.replicas.get(pool) if tuner and pool in tuner.replicas else pool_spec.initial_replicas
    return max(pool_spec.min_replicas, min(pool_spec.max_replicas, int(wanted)))


def pools_to_wake(spec: InferenceServiceSpec, tuner: TunerState | None) -> dict[str, int]:
    """Each pool at zero now, and the replicas a request at the router wakes it to: its floor, at
    least one (the operator's wake handler, the local fleet and the simulator do so at once)."""
    return {
        pool: max(1, spec.pool(pool).min_replicas)
        for pool in spec.active_pools
        if effective_replicas(spec, pool, tuner) == 0
    }
