"""Where a pool's load is heading: Holt's linear trend over its request and token rates, one
point per tuner run, so that a ramp's pods are asked for a pod start-up ahead of it.

Each series keeps a level and a trend (per second), updated as the rates come in, and the mean
absolute error of its one-run-ahead forecasts: a rise counts only where the trend carries the
series further over the horizon than that error leaves the smoothed level uncertain
(``level_noise``: noise does not buy pods). The horizon is one pod start-up and one interval,
the start-up as measured from the pool's own scale-ups (a first guess until one has been seen).
Pure: the state lives in ``TunerMemory``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field

from llmfleet.operator.tuner.season import Season

SERIES = ("request_rate", "prompt_tokens_per_s", "generation_tokens_per_s")


def level_noise(alpha: float) -> float:
    """The smoothed level's spread against one reading's, for white noise: sqrt(alpha / (2 -
    alpha)). The trend carries the level, not the last reading, so a rise stands out of the noise
    once it clears the level's spread; against a single reading's error, a rise over a short
    horizon (a pod start-up of 30 s and one interval) never could."""
    return math.sqrt(alpha / (2.0 - alpha))


class Holt(BaseModel):
    """Holt's linear (double exponential) smoothing over irregularly spaced points."""

    level: float | None = None
    trend: float = 0.0  # per second
    at: float | None = None
    error: float = 0.0  # mean absolute one-step error, smoothed
    points: int = 0

    def observe(self, at: float, value: float, alpha: float, beta: float) -> None:
        if self.level is None or self.at is None or at <= self.at:
            if self.level is None:
                self.level, self.at, self.points = value, at, 1
            return
        dt = at - self.at
        expected = self.level + self.trend * dt
        level = alpha * value + (1.0 - alpha) * expected
        self.trend = beta * (level - self.level) / dt + (1.0 - beta) * self.trend
        self.error = (
            alpha * abs(value - expected) + (1.0 - alpha) * self.error if self.points > 1 else abs(value - expected)
        )
        self.level, self.at = level, at
        self.points += 1

    def rise(self, horizon_s: float) -> float:
        """How far the trend carries the series over ``horizon_s`` (0 without a trend yet)."""
        return self.trend * horizon_s if self.points >= 3 else 0.0


class PoolForecast(BaseModel):
    """One pool's forecast state, and what its scale-ups showed of pod start-up."""

    series: dict[str, Holt] = Field(default_factory=dict)
    startup_s: float | None = None  # measured: a scale-up's decision to its pods ready
    rising_since: float | None = None  # an unfinished scale-up: when, and to how many
    rising_to: int | None = None
    season: Season | None = None  # where the spec's season is on: the rates' profile over it

    def seasonal(self, period_s: float, bin_s: float) -> Season:
        """The season at this period and bin (a new one where the spec changed them)."""
        if self.season is None or (self.season.period_s, self.season.bin_s) != (period_s, bin_s):
            self.season = Season(period_s=period_s, bin_s=bin_s)
        return self.season

    def observe(self, at: float, rates: dict[str, float | None], alpha: float, beta: float) -> None:
        for name, value in rates.items():
            if value is not None:
                self.series.setdefault(name, Holt()).observe(at, value, alpha, beta)

    def scaled_up(self, at: float, to: int) -> None:
        if self.rising_since is None:
            self.rising_since = at
        self.rising_to = to

    def ready(self, at: float, pods: int) -> None:
        """Measure start-up when the pods of a scale-up are all ready (an EWMA of what is seen)."""
        if self.rising_since is None or self.rising_to is None or pods < self.rising_to:
            return
        took = at - self.rising_since
        self.startup_s = took if self.startup_s is None else 0.5 * self.startup_s + 0.5 * took
        self.rising_since = self.rising_to = None


@dataclass(frozen=True)
class Outlook:
    """What the trend or the season adds to a pool's demand over the horizon, in
    replica-equivalents."""

    horizon_s: float
    rise_units: float  # 0 where the rise does not stand out of the noise
    noise_units: float  # the smoothed level's spread (level_noise), or the season's, in replica-equivalents
    trends: dict[str, float]  # per series, per second
    why: str
    term: str = "trend"  # what the rise is: Holt's trend, or the season's profile
    # the season's highest rise within the scale-down window ahead (0 where none clears its
    # spreads): fewer pods now would be wanted back within the window
    peak_units: float = 0.0
    peak_why: str = ""

    @property
    def driver(self) -> str:
        """The term a replica change it drives is said to be driven by."""
        return "season" if self.term == "season" else "forecast"

    def summary(self) -> dict[str, Any]:
        return {
            "horizonSeconds": round(self.horizon_s),
            "term": self.term,
            "riseReplicas": round(self.rise_units, 2),
            "noiseReplicas": round(self.noise_units, 2),
            "seasonPeakReplicas": round(self.peak_units, 2),
            "trendsPerMinute": {k: round(v * 60.0, 3) for k, v in self.trends.items()},
        }
