"""The forecast read as replicas: each run feeds a pool's rates to its trends and its season
(forecast.py, season.py) and says what they add to demand one pod start-up and one interval
ahead, in replica-equivalents, and what the season asks a scale-down to keep."""

from __future__ import annotations

from llmfleet.operator.tuner.capacity import PerReplica
from llmfleet.operator.tuner.decision import PoolInput, TunerConfig
from llmfleet.operator.tuner.forecast import Outlook, PoolForecast, level_noise
from llmfleet.operator.tuner.per_request import offered
from llmfleet.operator.tuner.season import SeasonalRise, bin_seconds


def _season_in_replicas(readings: list[tuple[SeasonalRise | None, float]]) -> tuple[float, float, int] | None:
    """Seasonal readings of a pool's series, each over its per-replica capacity, summed in
    replica-equivalents: (rise, spread, periods seen), or None where a series is not yet known."""
    read = [(r, cap) for r, cap in readings if r is not None]
    if not read or len(read) < len(readings):
        return None
    rise = sum(max(0.0, r.rise) / cap for r, cap in read)
    return rise, sum(r.spread / cap for r, cap in read), min(r.periods for r, _ in read)


class Prediction:
    """The trend's and the season's outlook per pool and run."""

    def __init__(self, config: TunerConfig) -> None:
        self.config = config

    def outlook(
        self, name: str, pool: PoolInput, capacity: PerReplica, state: PoolForecast, requests_s: float | None
    ) -> Outlook | None:
        """Feed this run's rates to the pool's trends (and its season's profile) and say what they
        add over one pod start-up and one interval: the trend's rise, or the season's where that
        is larger. A rise counts only where it stands out of its noise (the trend's: the spread
        its smoothed level keeps, forecast.level_noise; the season's: how far its bins stray from
        period to period), only while no queue is draining (the queue terms speak for a ramp
        already here, and a draining backlog lifts served rates), and the trend's never more than
        ``forecast_max_rise`` of today's demand (the season's goes no further than the periods
        before it went)."""
        c, m = self.config, pool.metrics
        rates = {
            "request_rate": m.request_rate,
            "prompt_tokens_per_s": m.uncached_prompt_tokens_per_s(),
            "generation_tokens_per_s": m.generation_tokens_per_s,
        }
        state.ready(m.at, m.ready_pods or 0)
        state.observe(m.at, rates, c.forecast_alpha, c.forecast_beta)
        if not c.predictive:
            return None
        horizon = (state.startup_s if state.startup_s is not None else c.startup_guess_s) + c.interval_s
        series = []
        if name in ("colocated", "prefill"):
            series.append(("prompt_tokens_per_s", capacity.prompt_tps))
        if name in ("colocated", "decode"):
            series.append(("generation_tokens_per_s", capacity.generation_tps))
        # a rate measured over a window shows a rise a window after it came, and so does the profile
        ahead = horizon + m.window_s
        # served rates under a queue are the pods' capacity, not the load: the profile learns the
        # load from them and the queue's growth (offered), and the forecast leaves it to the queue
        # terms (below)
        queued = (m.waiting or 0.0) / max(m.ready_pods or 0, 1) >= c.queue_per_pod
        load = offered(m, rates, requests_s) if queued else rates
        seasonal = self._seasonal(state, m.at, ahead, {s: (load[s], cap) for s, cap in series})
        peak, peak_why = (0.0, "") if queued else self._seasonal_peak(state, m.at, c.flap_window_s + ahead, series)
        held = [(state.series[s], cap, rates[s]) for s, cap in series if s in state.series and cap > 0]
        if not held or any(rate is None for _, _, rate in held):
            return None
        now_units = sum(rate / cap for _, cap, rate in held)  # type: ignore[operator]
        rise = sum(max(0.0, h.rise(horizon)) / cap for h, cap, _ in held)
        noise = sum(h.error / cap for h, cap, _ in held) * level_noise(c.forecast_alpha)
        trends = {s: state.series[s].trend for s in (*(x for x, _ in series), "request_rate") if s in state.series}
        source = "startup measured" if state.startup_s is not None else "startup guessed"
        why, term = f"trend +{rise:.2f} replicas over {horizon:.0f} s ({source}; noise {noise:.2f})", "trend"
        # the season's rise clears its spreads and, as the trend's does, the level's noise
        if seasonal is not None:
            ahead_rise, spread, periods = seasonal
            if ahead_rise > max(c.season_spreads * spread, noise) and (rise <= noise or ahead_rise > rise):
                why = (
                    f"the {c.season_s:.0f} s season's profile +{ahead_rise:.2f} replicas over {horizon:.0f} s and "
                    f"the {m.window_s:.0f} s rate window ({source}; seen over {periods} periods, spread {spread:.2f}); "
                    f"{why}"
                )
                rise, noise, term = ahead_rise, max(spread, noise), "season"
        if rise <= noise or rise <= 0:
            return Outlook(horizon, 0.0, noise, trends, why + ": within the noise", term, peak, peak_why)
        if queued or (m.waiting_growth_per_s or 0.0) < 0:
            return Outlook(horizon, 0.0, noise, trends, why + ": a queue speaks for the load instead", term)
        # the season rises no further than the periods it has seen went; a trend, unbounded, is capped
        capped = rise if term == "season" else min(rise, c.forecast_max_rise * now_units)
        if capped < rise:
            why += f", at most {c.forecast_max_rise:g}x today's {now_units:.2f}"
        return Outlook(horizon, capped, noise, trends, why, term, peak, peak_why)

    def _seasonal_peak(
        self, state: PoolForecast, now: float, within: float, series: list[tuple[str, float]]
    ) -> tuple[float, str]:
        """The season's highest rise within ``within`` ahead, in replica-equivalents, where it clears
        ``season_spreads`` of the largest spread among the bins it compared; (0, '') where not."""
        c = self.config
        if c.season_s <= 0 or state.season is None:
            return 0.0, ""
        read = _season_in_replicas([(state.season.peak(s, now, within), cap) for s, cap in series if cap > 0])
        if read is None or read[0] <= c.season_spreads * read[1]:
            return 0.0, ""
        return read[0], f"the {c.season_s:.0f} s season's profile rises +{read[0]:.2f} replicas within {within:.0f} s"

    def _seasonal(
        self, state: PoolForecast, now: float, horizon: float, series: dict[str, tuple[float | None, float]]
    ) -> tuple[float, float, int] | None:
        """Add this run's rates to the pool's season and read its rise over the horizon, in
        replica-equivalents: (rise, spread, periods seen), or None where the season is off or not
        yet known for every series."""
        c = self.config
        if c.season_s <= 0:
            return None
        season = state.seasonal(c.season_s, bin_seconds(c.season_s, c.interval_s))
        season.observe(now, {s: rate for s, (rate, _) in series.items()})
        return _season_in_replicas([(season.rise(s, now, horizon), cap) for s, (_, cap) in series.items() if cap > 0])
