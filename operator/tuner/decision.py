"""The tuner's inputs and outputs: limits, current settings, SLOs, configuration, and the decision.

Plain frozen dataclasses; knob names are camelCase as in the CRD and ``status.tuner``
(``maxBatchSize``, ``batchTimeoutMs``, ``maxNumBatchedTokens``), plus ``replicas``. The law that
maps inputs to a decision is in law.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from llmfleet.operator.metrics.source import PoolMetrics
from llmfleet.operator.resource.conditions import SCALING_LIMITED
from llmfleet.operator.resource.spec import TUNABLE_KNOBS, is_integer_knob, knob_range
from llmfleet.operator.tuner.memory import TunerMemory

MAX_BATCH, TIMEOUT, TOKEN_BUDGET, REPLICAS = "maxBatchSize", "batchTimeoutMs", "maxNumBatchedTokens", "replicas"
KNOB_FIELDS = TUNABLE_KNOBS  # camelCase knob -> EngineConfig field
INTEGER_KNOBS = frozenset(filter(is_integer_knob, KNOB_FIELDS))
POOL_ORDER = ("colocated", "prefill", "decode")
POOL_KNOBS = {  # which knobs each pool's tuner moves, in the order they are decided
    "colocated": (TOKEN_BUDGET, MAX_BATCH, TIMEOUT),
    "prefill": (TOKEN_BUDGET, TIMEOUT),
    "decode": (MAX_BATCH,),
}
DEFAULT_RANGES = {MAX_BATCH: (1.0, 256.0), TIMEOUT: (0.0, 100.0), TOKEN_BUDGET: (64.0, 16384.0)}


# --- inputs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Range:
    low: float
    high: float

    def __post_init__(self) -> None:
        if self.low > self.high:
            raise ValueError(f"empty range [{self.low}, {self.high}]")

    def clamp(self, value: float) -> float:
        return min(self.high, max(self.low, value))

    def __contains__(self, value: float) -> bool:
        return self.low <= value <= self.high


@dataclass(frozen=True)
class SLOTargets:
    ttft_p95_ms: float
    itl_p95_ms: float

    @classmethod
    def from_spec(cls, slo: Any) -> SLOTargets:
        return cls(ttft_p95_ms=float(slo.ttft_p95_ms), itl_p95_ms=float(slo.itl_p95_ms))


@dataclass(frozen=True)
class PoolLimits:
    """What the spec allows one pool: replicas (never fewer than 1) and a range per knob (camelCase names)."""

    min_replicas: int
    max_replicas: int
    knobs: Mapping[str, Range] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"minReplicas {self.min_replicas} > maxReplicas {self.max_replicas}")

    def knob(self, name: str) -> Range:
        return self.knobs.get(name) or Range(*DEFAULT_RANGES[name])

    @classmethod
    def from_spec(cls, pool: Any, engine: Any | None = None) -> PoolLimits:
        """From a spec ``Pool``: its ``bounds`` where given, else a default range widened to take
        in the pool's initial engine value. The side a one-sided bound leaves out is the default's,
        or the engine's own limit where the given side lies beyond the default (``{min: 300}`` on
        maxBatchSize: [300, 4096], not the empty [300, 256]); always within what EngineConfig accepts."""
        engine = engine if engine is not None else pool.engine_config()
        ranges: dict[str, Range] = {}
        for knob, field_name in KNOB_FIELDS.items():
            bound = pool.bounds.get(knob)
            given_low, given_high = bound.limits() if bound is not None else (-math.inf, math.inf)
            initial = float(getattr(engine, field_name))
            default_low, default_high = DEFAULT_RANGES[knob]
            low, high = given_low, given_high  # an infinite side: the engine's limit, by knob_range
            if not math.isfinite(low) and given_high >= default_low:
                low = min(default_low, initial)
            if not math.isfinite(high) and given_low <= default_high:
                high = max(default_high, initial)
            low, high = knob_range(knob, low, high)
            if low > high:  # spec validation rejects such bounds; the tuner reports it if one gets here
                raise ValueError(f"bounds.{knob}: no valid value in [{num(low)}, {num(high)}]")
            ranges[knob] = Range(low, high)
        # At least one pod: a pool of none reports no metrics, so the law could never bring it back.
        # A pool with minReplicas 0 goes to zero, and comes back, outside the law (zero.py).
        return cls(min_replicas=max(1, pool.min_replicas), max_replicas=pool.max_replicas, knobs=ranges)


@dataclass(frozen=True)
class PoolSettings:
    """A pool's current replicas and knobs (camelCase names, as in ``status.tuner``)."""

    replicas: int
    knobs: Mapping[str, float]

    @classmethod
    def from_engine(cls, replicas: int, engine: Any) -> PoolSettings:
        return cls(replicas, {knob: float(getattr(engine, name)) for knob, name in KNOB_FIELDS.items()})

    def with_value(self, knob: str, value: float) -> PoolSettings:
        if knob == REPLICAS:
            return PoolSettings(int(value), self.knobs)
        return PoolSettings(self.replicas, {**self.knobs, knob: value})

    def value(self, knob: str) -> float:
        return float(self.replicas) if knob == REPLICAS else float(self.knobs[knob])


@dataclass(frozen=True)
class PoolInput:
    metrics: PoolMetrics
    current: PoolSettings
    limits: PoolLimits
    # Devices one replica runs on (tensor x pipeline parallel): what a replica costs. Capacity and
    # step times stay per replica, as its pods report them.
    devices: int = 1


@dataclass(frozen=True)
class TunerConfig:
    # HPA-like behaviour (from spec.autotune)
    scale_up_stabilization_s: float = 0.0
    scale_down_stabilization_s: float = 300.0
    cooldown_s: float = 60.0
    headroom: float = 0.2
    knob_relax_stabilization_s: float = 60.0
    flap_window_s: float = 300.0
    override_ratio: float = 1.2
    # maxBatchSize: AIMD against ITL
    batch_decrease_factor: float = 0.75
    batch_increase_step: int = 4
    itl_low_water: float = 0.8
    batch_full_fraction: float = 0.9
    # At maxReplicas with a queue, the batch grows within ITL's 0.8-1x band as far as the step
    # plane puts ITL's p95 under this share of its SLO (BatchRule._batch_at_max_replicas).
    itl_headroom_at_max: float = 0.9
    queue_per_pod: float = 0.5  # mean waiting requests per pod that count as "a queue"
    kv_pressure: float = 0.95
    # batchTimeoutMs: against TTFT and queue time
    timeout_shrink_factor: float = 0.5
    timeout_step_ms: float = 5.0
    timeout_snap_ms: float = 1.0
    ttft_low_water: float = 0.5
    queue_dominant_fraction: float = 0.5
    window_coalesce_min: float = 0.2  # grow the window only if it expects this many more prompts per pod
    # maxNumBatchedTokens
    budget_increase_factor: float = 2.0
    budget_decrease_factor: float = 0.75
    prefill_heavy_ratio: float = 2.0
    # per-replica capacity (tokens/s): default guesses, then measured
    prefill_capacity_tps: float = 4000.0
    decode_capacity_tps: float = 400.0
    capacity_ewma: float = 0.3
    latency_margin: float = 0.8  # owned latencies under this share of their SLOs: a latency-cut capacity recovers
    # A replica count is chosen for latency only where its projection is this far within the SLOs:
    # a minute's p95 swings around the projection, and the projection errs by a few percent.
    projected_latency_limit: float = 0.95
    # A count at which the owned SLO broke with every knob spent is not returned to within this
    # long, while today's load level with headroom reaches the level it broke at
    # (Evidence.above_counts_that_broke).
    break_memory_s: float = 1800.0
    # ... and a count at which they held, within this share of the SLOs over a window measured at
    # it, outweighs a projection that fewer would not hold, for as long, while today's load level
    # is no higher than the rate it held (Evidence._below_projection_where_held).
    hold_latency_ratio: float = 0.8
    # A scale-down of this many replicas or more, undone within the scale-down window, stretches
    # that window by the time it took to undo it, for break_memory_s (Tuner._act): load that comes
    # back after quiet spells longer than the window. One replica undone is the latency
    # projection's knife edge, which the remembered break answers.
    regret_min_fall: int = 2
    # A scale-up for a broken SLO is sized to project back within the SLO itself: it projects from
    # the window that broke it, which reads high (the next minute's p95 regresses toward the mean),
    # and a count that falls short adds one more once the window has seen the new pods.
    scale_up_latency_limit: float = 1.0
    # ... at the load of a busy window: its arrivals surge_sd standard deviations above their mean
    # (Poisson), so that a count chosen at the mean load holds through the windows the tuner reads.
    surge_sd: float = 2.0
    # A colocated pool whose ITL, within its SLO now, a busy window projects past this multiple of
    # it gets one more pod (LatencySizing.busy_itl). Against a break within the next two minutes
    # at that count (fixed fleets, docs/tuner.md), 2.5x caught more breaks and added fewer pods
    # for none than the 3x that the line from p95 to p99 needed.
    busy_itl_limit: float = 2.5
    # priors of the step-time plane until its points spread: a step's fixed cost in decoding
    # sequences' worth, and a prompt token's cost as a share of a decoding sequence's
    step_overhead_seqs: float = 16.0
    step_prompt_token_share: float = 0.25
    saturation_queue_per_pod: float = 1.0
    backlog_drain_s: float = 60.0  # waiting requests count as demand to be served within this time
    # Disaggregated: a client's TTFT is the prefill server's plus what the decode server adds, so
    # the prefill pool is held to the TTFT SLO less that (Disaggregated.ttft_budgets); never to
    # less than this share of it.
    prefill_ttft_min_share: float = 0.25
    # Predictive scale-up (forecast.py): Holt's smoothing of the pools' rates, looking one pod
    # start-up and one interval ahead; the start-up is measured, this is the guess until then.
    interval_s: float = 30.0
    predictive: bool = True
    forecast_alpha: float = 0.3
    forecast_beta: float = 0.1
    startup_guess_s: float = 60.0
    forecast_max_rise: float = 1.0  # a forecast adds at most this share of today's demand
    # The period the load repeats over (spec.autotune.seasonSeconds; 0: no season): season.py
    # keeps the pools' rates over it and the forecast reads where they go next.
    season_s: float = 86400.0
    # ... and a rise of its profile counts where it clears this many of its spreads (adjacent bins
    # of a flat load differ by about one), as a forecast priced in latency must clear two noises.
    season_spreads: float = 2.0
    # A rise priced through the latency projection (LatencySizing.ahead) must clear this many of
    # its level's spreads, not one: a latency past its knee turns a little load into a pod.
    forecast_latency_spreads: float = 2.0
    # The fleet's spend against its need (spend.py), over this trailing window.
    cost_window_s: float = 600.0
    # Disaggregated: prefill:decode replicas stay within [low, high] (spec.autotune.prefillDecodeRatio).
    prefill_decode_ratio: tuple[float, float] | None = None
    # ... and one pool scales down only for a demand this share of a replica clear of the count
    # above it, so the ratio does not follow every wobble of one pool's demand.
    ratio_hysteresis: float = 0.25

    def __post_init__(self) -> None:
        if not 0.0 <= self.headroom < 1.0:
            raise ValueError(f"headroom must be in [0, 1), got {self.headroom}")
        if (
            self.prefill_decode_ratio is not None
            and not 0 < self.prefill_decode_ratio[0] <= self.prefill_decode_ratio[1]
        ):
            raise ValueError(f"prefill:decode ratio bounds must be 0 < min <= max, got {self.prefill_decode_ratio}")

    @classmethod
    def from_autotune(cls, autotune: Any, **overrides: Any) -> TunerConfig:
        """From a spec ``Autotune``, as HPA ``behavior``: the anti-flap window is the scale-down
        stabilization window, and a knob's relaxation waits one cooldown (no longer than that window)."""
        values: dict[str, Any] = {
            "scale_up_stabilization_s": float(autotune.scale_up_stabilization_seconds),
            "scale_down_stabilization_s": float(autotune.scale_down_stabilization_seconds),
            "cooldown_s": float(autotune.cooldown_seconds),
            "headroom": float(autotune.headroom),
            "flap_window_s": float(autotune.scale_down_stabilization_seconds),
            "knob_relax_stabilization_s": float(
                min(autotune.cooldown_seconds, autotune.scale_down_stabilization_seconds)
            ),
            "interval_s": float(autotune.interval_seconds),
            "predictive": bool(autotune.predictive),
            "season_s": float(autotune.season_seconds),
            "prefill_decode_ratio": ratio_bounds(autotune),
        }
        return cls(**(values | overrides))

    def windows(self, knob: str) -> tuple[float, float]:
        """(rise, fall) stabilization windows of one quantity."""
        if knob == REPLICAS:
            return self.scale_up_stabilization_s, self.scale_down_stabilization_s
        return self.knob_relax_stabilization_s, 0.0

    @property
    def forecast_horizon_default_s(self) -> float:
        return self.startup_guess_s + self.interval_s

    @property
    def memory_horizon_s(self) -> float:
        longest = max(self.scale_up_stabilization_s, self.scale_down_stabilization_s, self.knob_relax_stabilization_s)
        return 2 * max(longest, self.flap_window_s) + 60.0


# --- outputs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    pool: str
    knob: str  # camelCase knob, or "replicas"
    old: float
    new: float
    reason: str
    # replicas: the term that set the count (demand, queue, forecast, season, latency, busy window,
    # floor, ratio, bounds)
    driver: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "knob": self.knob,
            "from": plain(self.old),
            "to": plain(self.new),
            "reason": self.reason,
            **({"driver": self.driver} if self.driver else {}),
        }

    def __str__(self) -> str:
        return f"{self.pool}/{self.knob} {num(self.old)} -> {num(self.new)}"


TOO_MANY, TOO_FEW, OUT_OF_REACH = "TooManyReplicas", "TooFewReplicas", "SLOOutOfReach"


@dataclass(frozen=True)
class ScalingLimit:
    """Why a pool runs other than the replicas its SLOs ask for, in HPA's terms where they fit:
    ``TooManyReplicas`` (wanted above maxReplicas), ``TooFewReplicas`` (below minReplicas), and
    ours, ``SLOOutOfReach`` (an owned SLO no replica count meets, so none are added for it)."""

    reason: str
    message: str


@dataclass(frozen=True)
class Decision:
    at: float
    changes: tuple[Change, ...]
    reasons: tuple[str, ...]  # one line per change and per hold, each citing its numbers
    hold: bool  # True: data was stale or missing, nothing but bound corrections moved
    hold_reason: str
    settings: Mapping[str, PoolSettings]  # every pool after the changes
    memory: TunerMemory
    inputs: Mapping[str, dict[str, Any]] = field(default_factory=dict)  # per pool, the numbers used
    limits: Mapping[str, ScalingLimit] = field(default_factory=dict)  # per pool held from what its SLOs ask

    def changed(self, pool: str, knob: str) -> Change | None:
        return next((c for c in self.changes if c.pool == pool and c.knob == knob), None)

    def tuner_status(self) -> dict[str, Any]:
        """``status.tuner``: the replicas and knobs the tuner owns."""
        return {
            "replicas": {pool: s.replicas for pool, s in self.settings.items()},
            "knobs": {pool: {k: plain(v) for k, v in s.knobs.items()} for pool, s in self.settings.items()},
        }

    def last_decision_status(self) -> dict[str, Any]:
        """``status.lastDecision``: time, changes, reason and inputs."""
        return {
            "time": datetime.fromtimestamp(self.at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "changes": [c.to_dict() for c in self.changes],
            "reason": self.hold_reason if self.hold else self._summary(),
            "inputs": dict(self.inputs),
        }

    def condition(self) -> dict[str, str]:
        """The TunerActive condition (type, status, reason, message)."""
        if self.hold:
            return {
                "type": "TunerActive",
                "status": "False",
                "reason": "MetricsUnavailable",
                "message": self.hold_reason,
            }
        reason = "Adjusted" if self.changes else "Steady"
        return {"type": "TunerActive", "status": "True", "reason": reason, "message": self._summary()}

    def scaling_condition(self) -> dict[str, str] | None:
        """The ScalingLimited condition, as HPA writes it (True while a pool's replicas are held
        from what its SLOs ask), or None on a hold, which judged nothing. Where pools differ, the
        reason is the one a user can least fix by raising a bound: SLOOutOfReach first."""
        if self.hold:
            return None
        if not self.limits:
            return {
                "type": SCALING_LIMITED,
                "status": "False",
                "reason": "DesiredWithinRange",
                "message": "every pool's desired replica count is within its minReplicas and maxReplicas",
            }
        order = (OUT_OF_REACH, TOO_MANY, TOO_FEW)
        reason = min((limit.reason for limit in self.limits.values()), key=order.index)
        message = "; ".join(limit.message for limit in self.limits.values())
        return {"type": SCALING_LIMITED, "status": "True", "reason": reason, "message": message}

    def _summary(self) -> str:
        """The changes' reasons, or when nothing changed every reason for holding."""
        return "; ".join(c.reason for c in self.changes) or "; ".join(self.reasons)


def ratio_bounds(autotune: Any) -> tuple[float, float] | None:
    """(min, max) prefill:decode replicas from ``spec.autotune.prefillDecodeRatio``, or None."""
    bound = getattr(autotune, "prefill_decode_ratio", None)
    if bound is None:
        return None
    low, high = bound.limits()
    return (max(low, 1e-9), high)


# --- formatting --------------------------------------------------------------------------------


def num(value: float) -> str:
    """A knob value as reasons show it: integers bare, others with one decimal."""
    if math.isfinite(value) and value == int(value):
        return str(int(value))
    return f"{value:.1f}"


def plain(value: float) -> int | float:
    """A JSON number: integral values as ints."""
    return int(value) if math.isfinite(value) and value == int(value) else value
