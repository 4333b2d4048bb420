"""The forecast's season: a profile of each pool's rates over a period (a day by default) that
asks for a rise's pods a start-up ahead once the rise has repeated, and never for a burst the
next period did not repeat."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from llmfleet.operator.resource.spec import SpecError, parse_spec
from llmfleet.operator.tuner.law import REPLICAS, Decision, PoolInput, PoolSettings, Tuner, TunerConfig
from llmfleet.operator.tuner.memory import TunerMemory
from llmfleet.operator.tuner.season import MIN_PERIODS, Season, bin_seconds
from tests.operator.tuner.scenarios import SLO, limits, metrics, pool_input, settings

INTERVAL = 10.0
PERIOD = 600.0
STEP_AT, STEP_S = 300.0, 150.0  # into each period: a step from 4000 to 16000 prompt tok/s, this long
CONFIG = TunerConfig(
    scale_down_stabilization_s=120.0,
    flap_window_s=120.0,
    cooldown_s=30.0,
    knob_relax_stabilization_s=30.0,
    interval_s=INTERVAL,
    season_s=PERIOD,
)


def test_a_bin_predicts_once_it_has_seen_two_periods() -> None:
    season = Season(period_s=100.0, bin_s=10.0)
    for at in range(0, 300, 5):  # three periods of a load that is 1 in the first half and 5 in the second
        season.observe(float(at), {"x": 1.0 if at % 100 < 50 else 5.0})
    # the open bin (295 s) has not been folded; every other bin has seen 2 or 3 periods
    assert season.profile["x"][4] == (1.0, 0.0, 3) and season.profile["x"][5] == (5.0, 0.0, 3)
    rise = season.rise("x", 340.0, 15.0)
    assert rise is not None and (rise.rise, rise.spread, rise.periods) == (4.0, 0.0, 3)
    assert season.rise("x", 350.0, 15.0).rise == 0.0  # both bins in the high half
    young = Season(period_s=100.0, bin_s=10.0)
    for at in range(0, 120, 5):
        young.observe(float(at), {"x": 1.0})
    assert MIN_PERIODS == 2 and young.rise("x", 110.0, 5.0) is None  # bin 1 has seen one period
    peak = season.peak("x", 325.0, 25.0)  # bins 3, 4 and 5: the highest, 5, is 4 over now's
    assert peak is not None and (peak.rise, peak.periods) == (4.0, 3)
    assert season.peak("x", 325.0, 5.0).rise == 0.0  # within one bin: still the low half
    assert young.peak("x", 110.0, 30.0) is None


def test_a_burst_the_next_period_did_not_repeat_leaves_a_spread_as_large() -> None:
    season = Season(period_s=100.0, bin_s=10.0)
    for at in range(0, 300, 5):
        burst = at < 100 and 50 <= at < 60
        season.observe(float(at), {"x": 9.0 if burst else 1.0})
    rise = season.rise("x", 245.0, 10.0)
    assert rise is not None and rise.rise > 0 and rise.spread >= rise.rise


def test_bins_are_no_shorter_than_two_runs() -> None:
    assert bin_seconds(86400.0, 30.0) == 300.0 and bin_seconds(600.0, 10.0) == 20.0


def repeating_step(every_period: bool = True) -> Callable[[int, float, dict[str, PoolSettings]], dict[str, PoolInput]]:
    """Prompt load of 4000 tok/s (1 replica-equivalent) that steps to 16000 for 150 s at 300 s
    into each 600 s period (or only in the first, ``every_period`` False)."""

    def make(i: int, now: float, current: dict[str, PoolSettings]) -> dict[str, PoolInput]:
        phase = now % PERIOD
        stepped = STEP_AT <= phase < STEP_AT + STEP_S and (every_period or now < PERIOD)
        prompt = 16000.0 if stepped else 4000.0
        m = metrics(ttft_ms=100.0, itl_ms=30.0, prompt_tps=prompt, gen_tps=0.0, pods=current["colocated"].replicas)
        m = m.__class__(**{**m.__dict__, "at": now, "window_s": 30.0})
        return {"colocated": pool_input(m, current["colocated"], limits(max_replicas=16))}

    return make


def run_periods(config: TunerConfig, make: Callable, periods: int) -> list[Decision]:
    current = {"colocated": settings(replicas=2, timeout=0, budget=512)}
    memory, decisions = TunerMemory(), []
    for i in range(int(periods * PERIOD / INTERVAL)):
        now = i * INTERVAL
        decision = Tuner(config).decide(make(i, now, current), SLO, memory, now)
        decisions.append(decision)
        current, memory = dict(decision.settings), TunerMemory.load(decision.memory.to_json())
    return decisions


def first_rise(decisions: list[Decision], period: int) -> tuple[float, str]:
    """(seconds into the period, driver) of its first scale-up."""
    start = period * PERIOD
    ups = [
        (d.at - start, c.driver)
        for d in decisions
        for c in d.changes
        if c.knob == REPLICAS and c.new > c.old and start <= d.at < start + PERIOD
    ]
    return ups[0]


def test_a_repeated_step_gets_its_pods_a_start_up_ahead_and_says_the_season_drove_it() -> None:
    seasonal = run_periods(CONFIG, repeating_step(), periods=4)
    alone = run_periods(TunerConfig(**{**CONFIG.__dict__, "season_s": 0.0}), repeating_step(), periods=4)
    # the first two periods teach the profile; from the third the pods come before the step
    for period in (2, 3):
        at, driver = first_rise(seasonal, period)
        assert STEP_AT - CONFIG.startup_guess_s - INTERVAL <= at < STEP_AT and driver == "season", (period, at)
        assert first_rise(alone, period)[0] >= STEP_AT
    assert first_rise(seasonal, 0)[0] >= STEP_AT and first_rise(seasonal, 1)[1] != "season"
    at = 2 * PERIOD + STEP_AT - INTERVAL
    before, reactive = (next(d for d in run if d.at == at) for run in (seasonal, alone))
    outlook = before.inputs["colocated"]["forecast"]
    assert outlook["term"] == "season" and outlook["riseReplicas"] > 0
    assert before.settings["colocated"].replicas > reactive.settings["colocated"].replicas
    change = next(c for d in seasonal for c in d.changes if c.driver == "season")
    assert "season's profile" in change.reason and "seen over 2 periods" in change.reason


def test_pods_the_season_wants_back_within_the_window_are_not_let_go() -> None:
    """Demand says 1 of 4 pods, 100 s before a step the profile has seen twice: a scale-down to 1
    would be undone within the 120 s window, where anti-flapping refuses the season's pods. The
    recommendation is what the step needs, 2; far from the step it is demand's."""
    memory = run_periods(CONFIG, repeating_step(), periods=2)[-1].memory

    def reasons(into_period: float) -> str:
        now = 2 * PERIOD + into_period
        m = metrics(ttft_ms=100.0, itl_ms=30.0, prompt_tps=4000.0, gen_tps=0.0, pods=4)
        m = m.__class__(**{**m.__dict__, "at": now, "window_s": 30.0})
        pools = {"colocated": pool_input(m, settings(replicas=4, timeout=0, budget=512), limits(max_replicas=16))}
        decision = Tuner(CONFIG).decide(pools, SLO, TunerMemory.load(memory.to_json()), now)
        peaks.append(decision.inputs["colocated"]["forecast"]["seasonPeakReplicas"])
        return "\n".join(decision.reasons)

    peaks: list[float] = []

    before = reasons(STEP_AT - 100.0)
    assert "= 1; the 600 s season's profile rises +0.75 replicas within 170 s" in before
    assert "fewer pods now would be wanted back within the window -> 2" in before
    assert "wanted back" not in reasons(STEP_AT + STEP_S + 60.0)
    assert peaks == [0.75, 0.0]  # and the decision's forecast input says so


def test_a_step_that_did_not_repeat_buys_no_pods_later() -> None:
    decisions = run_periods(CONFIG, repeating_step(every_period=False), periods=4)
    assert all(c.driver != "season" for d in decisions for c in d.changes)


def test_the_season_comes_from_the_spec_and_zero_turns_it_off() -> None:
    def spec(**autotune):
        return parse_spec(
            {
                "model": {"builtin": "tiny"},
                "slo": {"ttftP95Ms": 1000, "itlP95Ms": 100},
                "pools": {"colocated": {"replicas": 1}},
                "autotune": autotune,
            }
        )

    assert TunerConfig.from_autotune(spec().autotune).season_s == 86400.0
    assert TunerConfig.from_autotune(spec(seasonSeconds=0).autotune).season_s == 0.0
    assert TunerConfig.from_autotune(spec(seasonSeconds=3600).autotune).season_s == 3600.0
    with pytest.raises(SpecError, match="seasonSeconds 300 is shorter than 600 s: 0 turns the season off") as refused:
        spec(seasonSeconds=300)
    assert refused.value.reason == "InvalidSpec"


def test_runs_with_a_queue_count_at_the_load_they_offer() -> None:
    """Under a queue the served rates are the pods' capacity: a step met with too few pods would
    never enter the profile, and the season would never learn the step it is for. What the load
    offered is the served rate plus the queue's growth, each request weighing the window's
    tokens over the requests they belong to (a draining queue's growth is negative, so the backlog
    it drains does not read as load). Where the growth is unknown the run is left out."""

    def season_after(waiting: float, growth: float | None):
        m = metrics(prompt_tps=4000.0, gen_tps=1000.0, rate=10.0, waiting=waiting, growth=growth, pods=2, at=100.0)
        pools = {"colocated": pool_input(m, settings(replicas=2), limits(max_replicas=16))}
        return Tuner(CONFIG).decide(pools, SLO, TunerMemory(), 100.0).memory.forecast["colocated"].season

    assert season_after(0.0, 2.0).sums == {"prompt_tokens_per_s": 4000.0, "generation_tokens_per_s": 1000.0}
    rising, draining = season_after(8.0, 2.0).sums, season_after(8.0, -2.0).sums
    assert rising["prompt_tokens_per_s"] == pytest.approx(4800.0, rel=1e-3)  # 2 req/s more, 400 tokens each
    assert rising["generation_tokens_per_s"] == pytest.approx(1200.0, rel=1e-3)
    assert draining["prompt_tokens_per_s"] == pytest.approx(3200.0, rel=1e-3)
    assert season_after(8.0, None).counts == {}
