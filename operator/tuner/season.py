"""A pool's load that repeats each period (a day, by default): the seasonal term of the forecast.

Holt's trend (forecast.py) sees a ramp once it has begun. A load that rises at the same time
every day (a team's working hours, a nightly batch job) has begun the day before, so a profile
of the period, one mean per bin, says where the load goes next before today's rates show it, as
Holt-Winters' additive season does. The profile keeps, per bin, the mean of its rates over the
periods seen (each new period weighted ``PERIOD_WEIGHT``), how far a period's mean strayed from
the profile it met (its spread), and how many periods it has seen; the law feeds it, for runs
with a queue, the load offered (served plus the queue's growth), not the pods' capacity. A rise
counts only at a bin that has seen two periods or more, so a season is used once it has
repeated, and only where it clears two spreads (the larger of both bins' and the series' mean
one; law.py): a one-off burst, which the next period does not repeat, leaves a spread as large
as itself, and a flat load's bins differ by about a spread. Pure: the state lives in
``TunerMemory``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import BaseModel, Field

MAX_BINS = 288  # five-minute bins over a day
PERIOD_WEIGHT = 0.5  # a new period's share of a bin's mean and spread
MIN_PERIODS = 2  # a bin predicts once it has seen this many periods


def bin_seconds(period_s: float, interval_s: float) -> float:
    """A bin per ``period_s / MAX_BINS``, but no shorter than two tuner runs, so each bin's mean
    is read from more than one run."""
    return max(period_s / MAX_BINS, 2.0 * interval_s)


class Season(BaseModel):
    """One pool's profile of its rates over the period, and the bin the runs are filling now."""

    period_s: float = 86400.0
    bin_s: float = 300.0
    # series -> slot -> (mean, spread, periods seen): tuples, as the profile lives in the status
    profile: dict[str, dict[int, tuple[float, float, int]]] = Field(default_factory=dict)
    open_bin: int | None = None  # bins since the epoch: the one this period's runs fill now
    sums: dict[str, float] = Field(default_factory=dict)
    counts: dict[str, int] = Field(default_factory=dict)

    @property
    def slots(self) -> int:
        return max(1, round(self.period_s / self.bin_s))

    def slot(self, at: float) -> int:
        return math.floor(at / self.bin_s) % self.slots

    def observe(self, at: float, rates: dict[str, float | None]) -> None:
        """Add one run's rates to the bin ``at`` falls in, folding the bin before into the profile."""
        now = math.floor(at / self.bin_s)
        if self.open_bin is not None and now != self.open_bin:
            self._fold()
        self.open_bin = now
        for name, value in rates.items():
            if value is not None and math.isfinite(value):
                self.sums[name] = self.sums.get(name, 0.0) + value
                self.counts[name] = self.counts.get(name, 0) + 1

    def _fold(self) -> None:
        slot = (self.open_bin or 0) % self.slots
        for name, total in self.sums.items():
            mean = total / max(self.counts.get(name, 0), 1)
            bins = self.profile.setdefault(name, {})
            seen = bins.get(slot)
            if seen is None:
                bins[slot] = (_rounded(mean), 0.0, 1)
                continue
            before, spread, periods = seen
            strayed = abs(mean - before)
            spread = strayed if periods == 1 else PERIOD_WEIGHT * strayed + (1 - PERIOD_WEIGHT) * spread
            mean = PERIOD_WEIGHT * mean + (1 - PERIOD_WEIGHT) * before
            bins[slot] = (_rounded(mean), _rounded(spread), min(periods + 1, 99))
        self.sums, self.counts = {}, {}

    def rise(self, name: str, at: float, horizon_s: float) -> SeasonalRise | None:
        """What the profile says ``name`` does between now and ``horizon_s`` ahead, where both
        bins have seen ``MIN_PERIODS`` periods; None where the season is not yet known there."""
        bins = self.profile.get(name) or {}
        now, ahead = bins.get(self.slot(at)), bins.get(self.slot(at + horizon_s))
        if now is None or ahead is None or min(now[2], ahead[2]) < MIN_PERIODS:
            return None
        seen = [spread for _, spread, periods in bins.values() if periods >= MIN_PERIODS]
        typical = sum(seen) / len(seen)  # two bins' spreads, from a period or two each, can be small by chance
        return SeasonalRise(ahead[0] - now[0], max(now[1], ahead[1], typical), min(now[2], ahead[2]))

    def peak(self, name: str, at: float, within_s: float) -> SeasonalRise | None:
        """The profile's highest rise over now's bin within the next ``within_s``: ``rise`` to each
        bin ahead that is known, with the largest spread among them; None where none is."""
        steps = max(1, math.ceil(within_s / self.bin_s))
        known = [r for k in range(1, steps + 1) if (r := self.rise(name, at, k * self.bin_s)) is not None]
        if not known:
            return None
        top = max(known, key=lambda r: r.rise)
        return SeasonalRise(top.rise, max(r.spread for r in known), top.periods)


@dataclass(frozen=True)
class SeasonalRise:
    rise: float  # the profile's change over the horizon, in the series' units
    spread: float  # the largest of the two bins' period-to-period spreads and the series' mean one
    periods: int  # periods the two bins have both seen


def _rounded(value: float) -> float:
    """Four significant digits: the profile lives in the InferenceService's status (about 7 KB a
    series over a day's 288 bins)."""
    return float(f"{value:.4g}")
