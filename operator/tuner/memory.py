"""What the tuner remembers between runs, and the HPA-style stabilization it applies with it.

``TunerMemory`` is small and JSON-serializable (it is stored on the InferenceService, in an
annotation or status). For every controlled quantity, keyed ``pool/knob`` (``decode/maxBatchSize``,
``prefill/replicas``), it keeps the recent runs' recommendations (as their changes), when the
quantity last changed and in which direction, when that direction last flipped, and for replicas
the scale-downs that had to be undone (regrets, which stretch the scale-down window). Per pool it
keeps the measured per-replica capacity, its load's trend (forecast.py), its spend against its
need (spend.py) and how many requests it has finished (per_request.py).
A memory that cannot be read back starts fresh: the tuner then only acts
once new recommendations span its stabilization windows, so forgetting errs on the side of holding.

This is not reconcile's ``TunerState`` (the replicas and knobs the tuner owns, in ``status.tuner``).
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from llmfleet.operator.tuner.forecast import PoolForecast
from llmfleet.operator.tuner.per_request import Finished
from llmfleet.operator.tuner.spend import Spend
from llmfleet.operator.tuner.step_model import StepModel

MAX_RECOMMENDATIONS = 64
MAX_CHANGES = 256  # recommendations are kept as changes: a window of any length holds few
MAX_RECENT_DECISIONS = 10


class KeyHistory(BaseModel):
    """One controlled quantity: recent recommendations and its change history."""

    recommendations: list[tuple[float, float]] = Field(default_factory=list)  # (since when, value)
    recorded_at: float | None = None  # the last run that recorded one
    last_change_at: float | None = None
    last_direction: Literal[-1, 0, 1] = 0
    direction_since: float | None = None  # when the current run of moves in last_direction began
    direction_changes: int = 0
    # replicas: (when, what a run judged the pool to need, at how many pods) where its latency was measured
    floors: list[tuple[float, float, int]] = Field(default_factory=list)
    # replicas: (when, at how many pods, at what load level) the owned SLO broke with every knob
    # spent, or a busy window projected ITL far past it
    breaks: list[tuple[float, int, float]] = Field(default_factory=list)
    # replicas: (when, at how many pods, at what requests/s) the owned SLOs held, well within, over
    # a window measured at that count
    holds: list[tuple[float, int, float]] = Field(default_factory=list)
    # replicas: (as of when, the pool's requests/s smoothed over the scale-down window)
    load_level: tuple[float, float] | None = None
    # replicas: (as of when, the p95 prompt's computed tokens, their prefill alone in seconds),
    # smoothed over the scale-down window (projection.first_token_floor)
    first_token_floor: tuple[float, float, float] | None = None
    # replicas: (as of when, a decode step of one sequence in seconds), smoothed over the
    # scale-down window (projection.decode_step_floor)
    decode_step_floor: tuple[float, float] | None = None
    # replicas: how many the last scale-down took off (moved_replicas), and (when, how long after
    # it) a scale-down of several was undone within the scale-down window
    last_fall: float = 0.0
    regrets: list[tuple[float, float]] = Field(default_factory=list)

    def judged(self, now: float, needed: float, pods: int, keep_s: float) -> None:
        self.floors = [f for f in self.floors if now - f[0] <= keep_s and f[0] < now]
        self.floors.append((now, needed, pods))
        del self.floors[:-MAX_RECOMMENDATIONS]

    def floor_within(self, now: float, window_s: float, pods: int) -> float | None:
        """The most any run within the window judged the pool to need, at this many pods or fewer:
        a need judged at more pods extrapolated further, and that pool is gone."""
        return max((v for t, v, n in self.floors if now - t <= window_s and n <= pods), default=None)

    def follow_load(self, now: float, load: float, window_s: float) -> float:
        """The load level: an exponential average with the window as its time constant, so a busy
        or quiet minute moves it little and a fall of the whole load moves it within a window or
        two."""
        self.load_level = _follow(self.load_level, now, load, window_s)
        return self.load_level[1]

    def follow_first_token_floor(
        self, now: float, floor: tuple[float, float] | None, window_s: float
    ) -> tuple[float, float] | None:
        """The (tokens, seconds) of the p95 prompt's own prefill, averaged as the load level is: a
        window's p95 rests on the few dozen prompts that finished in it (or on none), the step
        costs on a fit that trades its terms from run to run, and a workload's prompts change
        slowly. The last average where this run has none."""
        last = self.first_token_floor
        if floor is None:
            return None if last is None else (last[1], last[2])
        at, tokens, seconds = last or (now, *floor)
        weight = _followed(now - at, window_s)
        tokens, seconds = tokens + (floor[0] - tokens) * weight, seconds + (floor[1] - seconds) * weight
        self.first_token_floor = (now, tokens, seconds)
        return tokens, seconds

    def follow_decode_step_floor(self, now: float, seconds: float | None, window_s: float) -> float | None:
        """A decode step of one sequence, averaged as the first-token floor is: the step costs'
        fit trades its overhead against its per-sequence cost from run to run (3 to 146 ms of
        overhead over a start-up), and their sum at one sequence moves with it."""
        if seconds is not None:
            self.decode_step_floor = _follow(self.decode_step_floor, now, seconds, window_s)
        return None if self.decode_step_floor is None else self.decode_step_floor[1]

    def broke(self, now: float, pods: int, level: float, keep_s: float) -> None:
        """Note a break; an earlier one at as many pods and no lower a level says nothing more."""
        self.breaks = [
            b for b in self.breaks if now - b[0] <= keep_s and b[0] < now and not (b[1] == pods and b[2] >= level)
        ]
        self.breaks.append((now, pods, level))
        del self.breaks[:-MAX_RECOMMENDATIONS]

    def broken_within(self, now: float, window_s: float, level: float) -> tuple[float, int, float] | None:
        """The break at the most pods (the latest of them) within the window at a load level no
        higher than ``level``: evidence that so few do not hold it, which no projection outweighs."""
        held = [b for b in self.breaks if now - b[0] <= window_s and b[2] <= level]
        return max(held, key=lambda b: (b[1], b[0]), default=None)

    def held(self, now: float, pods: int, load: float, keep_s: float) -> None:
        """Note a count that held ``load`` requests/s; an earlier one at as many pods and no more
        load says nothing more."""
        self.holds = [
            h for h in self.holds if now - h[0] <= keep_s and h[0] < now and not (h[1] == pods and h[2] <= load)
        ]
        self.holds.append((now, pods, load))
        del self.holds[:-MAX_RECOMMENDATIONS]

    def held_within(self, now: float, window_s: float, level: float, below: int) -> tuple[float, int, float] | None:
        """The hold at the fewest pods (under ``below``) within the window at a load no lower than
        ``level``: evidence that so few held today's load, which outweighs a projection."""
        held = [h for h in self.holds if now - h[0] <= window_s and h[2] >= level and h[1] < below]
        return min(held, key=lambda h: (h[1], -h[0]), default=None)

    def rising(self, now: float, by: float, within_s: float, min_fall: float, keep_s: float) -> None:
        """Note a scale-up of ``by`` pods that undoes ``min_fall`` or more of a scale-down made less
        than ``within_s`` before (a regret); before ``moved`` records the rise."""
        self.regrets = [r for r in self.regrets if now - r[0] <= keep_s and r[0] < now]
        since = None if self.last_change_at is None else now - self.last_change_at
        undone = min(self.last_fall, by)
        if self.last_direction < 0 and undone >= min_fall and since is not None and since <= within_s:
            self.regrets.append((now, since))
            del self.regrets[:-MAX_RECOMMENDATIONS]

    def regret_within(self, now: float, window_s: float) -> tuple[float, float] | None:
        """The regret within the window whose scale-up came the longest after its scale-down."""
        return max((r for r in self.regrets if now - r[0] <= window_s), key=lambda r: (r[1], r[0]), default=None)

    def record(self, now: float, value: float, keep_s: float) -> None:
        """Add this run's recommendation where it differs from the one in force (a recommendation
        stands until the next, so a window of any length costs only its changes), dropping those
        too old to matter but the one in force since before. After a gap in the runs longer than
        ``keep_s`` (the tuner stopped, or its metrics went stale) nothing earlier is kept."""
        recs = [] if self.recorded_at is not None and now - self.recorded_at > keep_s else self.recommendations
        recs = [(t, v) for t, v in recs if t < now]
        older = [r for r in recs if now - r[0] > keep_s][-1:]
        recs = older + [r for r in recs if now - r[0] <= keep_s]
        if not recs or recs[-1][1] != value:
            recs.append((now, value))
        self.recommendations, self.recorded_at = recs[-MAX_CHANGES:], now

    def reverses_within(self, now: float, direction: int, window_s: float) -> bool:
        """Would a move in ``direction`` reverse a run of moves begun less than ``window_s`` ago?"""
        since = self.direction_since
        return self.last_direction not in (0, direction) and since is not None and now - since < window_s

    def moved(self, now: float, direction: int) -> bool:
        """Note a change; True when it reversed the previous direction."""
        reversed_ = self.last_direction not in (0, direction)
        if self.last_direction != direction:
            self.direction_since = now
        if reversed_:
            self.direction_changes += 1
        self.last_direction = direction  # type: ignore[assignment]
        self.last_change_at = now
        self.last_fall = 0.0  # a fall's size is kept by moved_replicas alone
        return reversed_

    def moved_replicas(self, now: float, by: float, within_s: float, min_fall: float, keep_s: float) -> bool:
        """``moved`` for a replica count changed by ``by`` pods: a rise first notes whether it
        undoes a recent scale-down (``rising``), and a fall keeps its size for the rise that may,
        added to the falls each within ``within_s`` of the next just before it: 12 -> 6 -> 2 -> 1
        in a minute, then 1 -> 12, undoes a fall of 11, not of 1 (and 9 -> 7 -> 6 -> 7 one pod).
        Replica moves made through ``moved`` alone (spec bounds, the P:D ratio, a scale to zero)
        keep none, so no rise counts as undoing them."""
        if by > 0:
            self.rising(now, by, within_s, min_fall, keep_s)
        since = None if self.last_change_at is None else now - self.last_change_at
        falling = by < 0 and self.last_direction < 0 and since is not None and since <= within_s
        fallen = self.last_fall if falling else 0.0
        reversed_ = self.moved(now, 1 if by > 0 else -1)
        self.last_fall = fallen + max(-by, 0.0)
        return reversed_


class Capacity(BaseModel):
    """What one replica of a pool sustains (tokens/s).

    Where the pods report their step times, ``steps`` learns the step-time plane and the
    capacity at any knobs is that plane's throughput times ``scale`` (what saturated or
    SLO-breaking windows showed the plane to miss: KV limits, gaps between steps). Elsewhere
    ``prompt_tps`` and ``generation_tps`` are the estimate itself, seeded with a default guess.
    """

    prompt_tps: float
    generation_tps: float
    steps: StepModel = Field(default_factory=StepModel)
    scale: float = 1.0
    observations: int = 0
    measured: bool = False  # a saturated pool or a broken SLO has replaced the default guess
    updated_at: float | None = None
    pods: int | None = None  # ready pods at the last run, and since when (per-pod rates need a steady count)
    pods_since: float | None = None
    pods_before: int | None = None  # the count before that

    def window_pods(self, at: float, window_s: float) -> float | None:
        """The ready pods a window of ``window_s`` up to ``at`` saw on average (pod-seconds over
        seconds), from the last change of the count: the pods its latencies were measured with.
        An earlier change within the window counts as the one before it."""
        if self.pods is None:
            return None
        if self.pods_since is None or self.pods_before is None or window_s <= 0:
            return float(self.pods)
        share = min(1.0, max(0.0, (at - self.pods_since) / window_s))
        return self.pods_before + (self.pods - self.pods_before) * share


class DecisionRecord(BaseModel):
    at: float
    hold: bool
    changes: list[str] = Field(default_factory=list)  # "decode/maxBatchSize 32 -> 24"


class TunerMemory(BaseModel):
    version: Literal[1] = 1
    keys: dict[str, KeyHistory] = Field(default_factory=dict)
    capacity: dict[str, Capacity] = Field(default_factory=dict)
    forecast: dict[str, PoolForecast] = Field(default_factory=dict)  # per pool: trends, start-up
    spend: dict[str, Spend] = Field(default_factory=dict)  # per pool: replicas run against needed
    finished: dict[str, Finished] = Field(default_factory=dict)  # per pool: requests finished, for per_request.py
    recent: list[DecisionRecord] = Field(default_factory=list)
    idle_since: dict[str, float] = Field(default_factory=dict)  # pool -> since when it is idle (zero.py)

    def key(self, pool: str, knob: str) -> KeyHistory:
        return self.keys.setdefault(f"{pool}/{knob}", KeyHistory())

    def remember(self, record: DecisionRecord) -> None:
        self.recent.append(record)
        del self.recent[:-MAX_RECENT_DECISIONS]

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), separators=(",", ":"), sort_keys=True)

    @classmethod
    def load(cls, raw: str | dict[str, Any] | None) -> TunerMemory:
        """Read a stored memory; anything unreadable (or absent) gives a fresh one."""
        if not raw:
            return cls()
        try:
            data = json.loads(raw) if isinstance(raw, str) else raw
            return cls.model_validate(data)
        except (ValueError, ValidationError):
            return cls()


def _followed(elapsed_s: float, window_s: float) -> float:
    """How far an exponential average with the window as its time constant moves toward a
    reading ``elapsed_s`` after the last one (all the way without a window)."""
    return 1.0 if window_s <= 0 else 1.0 - math.exp(-max(elapsed_s, 0.0) / window_s)


def _follow(last: tuple[float, float] | None, now: float, value: float, window_s: float) -> tuple[float, float]:
    """(now, the level): ``last``'s level moved toward ``value`` as _followed says; ``value``
    itself where there is no last."""
    at, level = last or (now, value)
    return now, level + (value - level) * _followed(now - at, window_s)


def stabilize(
    history: KeyHistory, now: float, current: float, rise_window_s: float, fall_window_s: float
) -> tuple[float, str]:
    """HPA ``behavior`` stabilization over recorded recommendations (this run's included).

    Rising takes the lowest recommendation of the rise window, falling the highest of the fall
    window: a move happens only if every recommendation in its window agrees. A window longer
    than zero must also be covered by recommendations (after a restart or a stale spell the tuner
    first collects a window's worth). Returns the value and, when it holds back, why.
    """
    recs = history.recommendations
    latest = recs[-1][1] if recs else current

    def within(window: float) -> list[float]:
        # A recommendation stands until the next one, so the one in force at the window's start counts.
        if window <= 0:
            return [latest]
        inside = [v for t, v in recs if t > now - window]
        return inside + [v for t, v in recs if t <= now - window][-1:]

    def covered(window: float) -> bool:
        return window <= 0 or (bool(recs) and recs[0][0] <= now - window)

    rise_to = min(within(rise_window_s), default=current)
    fall_to = max(within(fall_window_s), default=current)
    if rise_to > current and covered(rise_window_s):
        return rise_to, ""
    if fall_to < current and covered(fall_window_s):
        return fall_to, ""
    if latest > current:
        if not covered(rise_window_s):
            return current, f"recommendations span less than the {rise_window_s:.0f} s stabilization window"
        return current, f"lowest recommendation over {rise_window_s:.0f} s is {_num(rise_to)}"
    if latest < current:
        if not covered(fall_window_s):
            return current, f"recommendations span less than the {fall_window_s:.0f} s stabilization window"
        return current, f"highest recommendation over {fall_window_s:.0f} s is {_num(fall_to)}"
    return current, ""


def _num(value: float) -> str:
    return str(int(value)) if math.isfinite(value) and value == int(value) else f"{value:.1f}"
