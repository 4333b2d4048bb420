"""The tuner over time: stabilization windows, cooldowns, anti-flapping, and memory round trips."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest

from llmfleet.operator.tuner.law import (
    MAX_BATCH,
    REPLICAS,
    TIMEOUT,
    Decision,
    PoolInput,
    PoolSettings,
    Tuner,
    TunerConfig,
)
from llmfleet.operator.tuner.memory import KeyHistory, TunerMemory
from tests.operator.tuner.scenarios import SLO, metrics, pool_input, settings

INTERVAL = 30.0


def run_loop(
    tuner: Tuner,
    make: Callable[[int, float, PoolSettings], PoolInput],
    runs: int,
    start: PoolSettings | None = None,
    pool: str = "colocated",
) -> list[Decision]:
    """Closed loop on one pool: each run sees the settings and memory the previous run left."""
    current, memory, decisions = start or settings(), TunerMemory(), []
    for i in range(runs):
        now = 1000.0 + i * INTERVAL
        decision = tuner.decide({pool: make(i, now, current)}, SLO, memory, now)
        decisions.append(decision)
        current, memory = decision.settings[pool], TunerMemory.load(decision.memory.to_json())
    return decisions


def moves(decisions: list[Decision], knob: str) -> list[tuple[float, int]]:
    """(time, direction) of every change of one knob."""
    return [(d.at, 1 if c.new > c.old else -1) for d in decisions for c in d.changes if c.knob == knob]


def direction_change_times(history: list[tuple[float, int]]) -> list[float]:
    return [t for (_, prev), (t, d) in itertools.pairwise(history) if d != prev]


def test_alternating_noise_flips_direction_at_most_once_per_window() -> None:
    """ITL is now and then just over the SLO, otherwise well under it with a full batch: the batch
    goes down and up, but never reverses twice within the stabilization (anti-flap) window."""
    config = TunerConfig()

    def noisy(i: int, now: float, current: PoolSettings) -> PoolInput:
        itl = 105.0 if i % 4 == 0 else 60.0
        batch = current.knobs[MAX_BATCH]
        m = metrics(
            itl_ms=itl,
            ttft_ms=300,
            mean_batch=batch,
            step_tokens=batch,
            waiting=2,
            prompt_tps=100,
            gen_tps=20,
            pods=current.replicas,
            at=now,
        )
        return pool_input(m, current)

    decisions = run_loop(Tuner(config), noisy, runs=80)
    for knob in (MAX_BATCH, TIMEOUT, REPLICAS):
        flips = direction_change_times(moves(decisions, knob))
        gaps = [b - a for a, b in itertools.pairwise(flips)]
        assert all(gap >= config.flap_window_s for gap in gaps), (knob, flips)
    assert moves(decisions, MAX_BATCH), "the batch should still move under sustained pressure"
    assert any("one direction change per 300 s" in r for d in decisions for r in d.reasons)


def test_relaxing_moves_wait_for_the_stabilization_window() -> None:
    config = TunerConfig(knob_relax_stabilization_s=60.0)

    def spare(i: int, now: float, current: PoolSettings) -> PoolInput:
        return pool_input(metrics(itl_ms=50, ttft_ms=300, waiting=3, prompt_tps=100, gen_tps=20, at=now), current)

    decisions = run_loop(Tuner(config), spare, runs=4)
    batch_moves = [(d.at, c.old, c.new) for d in decisions for c in d.changes if c.knob == MAX_BATCH]
    assert batch_moves[0] == (1060.0, 32, 36)  # the first run that has 60 s of agreeing recommendations
    assert any("span less than the 60 s stabilization window" in r for r in decisions[0].reasons)


def test_protective_moves_are_immediate_then_cool_down() -> None:
    config = TunerConfig(cooldown_s=60.0)

    def over(i: int, now: float, current: PoolSettings) -> PoolInput:
        batch = current.knobs[MAX_BATCH]
        return pool_input(metrics(itl_ms=150, mean_batch=batch, prompt_tps=100, gen_tps=20, at=now), current)

    decisions = run_loop(Tuner(config), over, runs=5)
    batch_moves = [(d.at, c.old, c.new) for d in decisions for c in d.changes if c.knob == MAX_BATCH]
    assert batch_moves == [(1000.0, 32, 24), (1060.0, 24, 18), (1120.0, 18, 13)]
    assert any("cooldown, last changed 30 s ago (< 60 s)" in r for r in decisions[1].reasons)


def test_replicas_scale_up_at_once_and_down_after_the_window() -> None:
    """HPA behaviour: scale-up takes the lowest recommendation of a 0 s window (now); scale-down
    the highest of the last 300 s, so a dip must last the whole window."""
    config = TunerConfig(scale_up_stabilization_s=0.0, scale_down_stabilization_s=300.0, cooldown_s=60.0)

    def demand(i: int, now: float, current: PoolSettings) -> PoolInput:
        pods = current.replicas
        prompt = 6000.0 if i < 4 else 400.0  # high for 2 minutes, then low
        return pool_input(metrics(prompt_tps=prompt, gen_tps=10, pods=pods, at=now), current)

    decisions = run_loop(Tuner(config), demand, runs=30, start=settings(replicas=1))
    replica_moves = [(d.at, c.old, c.new) for d in decisions for c in d.changes if c.knob == REPLICAS]
    assert replica_moves[0][0] == 1000.0 and replica_moves[0][2] > 1  # up at once
    downs = [m for m in replica_moves if m[2] < m[1]]
    assert downs, replica_moves
    last_high = 1000.0 + 3 * INTERVAL
    assert downs[0][0] >= last_high + 300.0, (downs, replica_moves)


def test_regrets_are_scale_downs_of_several_undone_within_the_window() -> None:
    history = KeyHistory()
    history.moved(1000.0, -1)
    history.last_fall = 3
    history.rising(1050.0, by=3, within_s=120.0, min_fall=2, keep_s=600.0)
    history.moved(1050.0, 1)
    assert history.regrets == [(1050.0, 50.0)]
    history.rising(1070.0, by=2, within_s=120.0, min_fall=2, keep_s=600.0)  # a rise after a rise is none
    history.moved(1100.0, -1)
    history.last_fall = 1
    history.rising(1130.0, by=2, within_s=120.0, min_fall=2, keep_s=600.0)  # one pod: the projection's knife edge
    history.moved(1130.0, 1)
    history.moved(1200.0, -1)
    history.last_fall = 4
    history.rising(1400.0, by=4, within_s=120.0, min_fall=2, keep_s=600.0)  # undone after the window: new load
    assert history.regrets == [(1050.0, 50.0)]
    history.moved(1400.0, 1)
    history.moved(1500.0, -1)
    history.last_fall = 2
    history.rising(1530.0, by=2, within_s=120.0, min_fall=2, keep_s=600.0)
    assert history.regret_within(1600.0, 600.0) == (1050.0, 50.0)  # the longest spell within the memory
    assert history.regret_within(1700.0, 600.0) == (1530.0, 30.0)
    history.rising(1700.0, by=2, within_s=120.0, min_fall=2, keep_s=100.0)
    assert history.regrets == []  # those older than keep_s are dropped


def test_a_scale_down_in_steps_undone_is_one_regret_of_its_whole_fall() -> None:
    """12 -> 6 -> 2 -> 1 within a minute, then back to 12: a fall of 11 undone, though its last
    step was one pod. Falls a window apart are separate scale-downs, and a rise of one pod after
    a fall of three undoes one pod: the projection's knife edge, no regret."""
    history, window = KeyHistory(), 120.0
    for at, by in ((760.0, -6), (790.0, -4), (820.0, -1)):
        history.moved_replicas(at, by, window, min_fall=2, keep_s=1800.0)
    assert history.last_fall == 11
    history.moved_replicas(890.0, 11, window, min_fall=2, keep_s=1800.0)
    assert history.regrets == [(890.0, 70.0)]

    history = KeyHistory()
    history.moved_replicas(290.0, -1, window, min_fall=2, keep_s=1800.0)
    history.moved_replicas(590.0, -1, window, min_fall=2, keep_s=1800.0)  # 300 s on: a fall of its own
    history.moved_replicas(650.0, 5, window, min_fall=2, keep_s=1800.0)
    assert history.regrets == []

    history = KeyHistory()
    history.moved_replicas(530.0, -2, window, min_fall=2, keep_s=1800.0)
    history.moved_replicas(600.0, -1, window, min_fall=2, keep_s=1800.0)
    history.moved_replicas(640.0, 1, window, min_fall=2, keep_s=1800.0)  # 9 -> 7 -> 6 -> 7
    assert history.regrets == []


def test_a_scale_down_window_of_an_hour_scales_down_after_the_hour() -> None:
    """HPA allows stabilization windows up to an hour: 120 runs of 30 s. Recommendations are kept
    as their changes, so such a window is covered and the pool comes down once it has passed."""
    config = TunerConfig(scale_up_stabilization_s=0.0, scale_down_stabilization_s=3600.0, cooldown_s=60.0)

    def demand(i: int, now: float, current: PoolSettings) -> PoolInput:
        prompt = 6000.0 if i < 4 else 400.0
        return pool_input(metrics(prompt_tps=prompt, gen_tps=10, pods=current.replicas, at=now), current)

    decisions = run_loop(Tuner(config), demand, runs=160, start=settings(replicas=1))
    replica_moves = [(d.at, c.old, c.new) for d in decisions for c in d.changes if c.knob == REPLICAS]
    last_high = 1000.0 + 3 * INTERVAL
    assert replica_moves == [(1000.0, 1, 2), (last_high + 3600.0 + INTERVAL, 2, 1)]
    assert len(decisions[-1].memory.key("colocated", REPLICAS).recommendations) <= 3


def test_recommendations_are_kept_as_changes_and_forgotten_after_a_gap() -> None:
    history = KeyHistory()
    for t, v in ((0.0, 2.0), (10.0, 2.0), (20.0, 3.0), (30.0, 3.0), (40.0, 2.0)):
        history.record(t, v, keep_s=100.0)
    assert history.recommendations == [(0.0, 2.0), (20.0, 3.0), (40.0, 2.0)]
    history.record(200.0, 2.0, keep_s=100.0)  # 160 s since the last run: a gap, nothing earlier counts
    assert history.recommendations == [(200.0, 2.0)]
    for t in range(210, 400, 10):
        history.record(float(t), 2.0, keep_s=100.0)
    assert history.recommendations == [(200.0, 2.0)]  # in force since 200 s, however old
    history.record(400.0, 1.0, keep_s=100.0)
    history.record(490.0, 1.0, keep_s=100.0)
    assert history.recommendations == [(200.0, 2.0), (400.0, 1.0)]  # the first was in force 100 s ago
    history.record(550.0, 1.0, keep_s=100.0)
    assert history.recommendations == [(400.0, 1.0)]


def test_reversal_inside_the_window_needs_a_badly_violated_slo() -> None:
    config = TunerConfig(knob_relax_stabilization_s=0.0, cooldown_s=30.0, flap_window_s=300.0)
    tuner = Tuner(config)
    low = dict(prompt_tps=100, gen_tps=20, ttft_ms=300)
    up = tuner.decide({"colocated": pool_input(metrics(itl_ms=50, waiting=3, at=1000.0, **low))}, SLO, None, 1000.0)
    assert up.changed("colocated", MAX_BATCH).new == 36
    current = up.settings["colocated"]

    slight = tuner.decide(
        {"colocated": pool_input(metrics(itl_ms=105, mean_batch=36, at=1060.0, **low), current)},
        SLO,
        up.memory,
        1060.0,
    )
    assert slight.changed("colocated", MAX_BATCH) is None
    assert any("reversing the rise begun 60 s ago" in r for r in slight.reasons)

    bad = tuner.decide(
        {"colocated": pool_input(metrics(itl_ms=150, mean_batch=36, at=1060.0, **low), current)},
        SLO,
        up.memory,
        1060.0,
    )
    change = bad.changed("colocated", MAX_BATCH)
    assert change is not None and change.new == 27
    assert "allowed: 1.50x over target (>= 1.2)" in change.reason


def test_identical_inputs_give_identical_decisions() -> None:
    pools = {"colocated": pool_input(metrics(itl_ms=142, mean_batch=32, at=5.0))}
    memory = TunerMemory()
    first = Tuner().decide(pools, SLO, memory, 5.0)
    second = Tuner().decide(pools, SLO, memory, 5.0)
    assert first == second
    assert memory == TunerMemory()  # the input memory is never mutated


def test_memory_round_trips_through_json_and_bad_memory_starts_fresh() -> None:
    decisions = run_loop(
        Tuner(),
        lambda i, now, cur: pool_input(metrics(itl_ms=150, mean_batch=32, at=now), cur),
        runs=3,
    )
    memory = decisions[-1].memory
    text = memory.to_json()
    assert TunerMemory.load(text) == memory
    assert TunerMemory.load(memory.model_dump(mode="json")) == memory
    assert len(text) < 8000  # small enough for an annotation
    assert [r.at for r in memory.recent] == [1000.0, 1030.0, 1060.0]
    for bad in ("{not json", '{"version": 7}', "", None, {"keys": "nope"}):
        assert TunerMemory.load(bad) == TunerMemory()


def test_the_load_level_moves_a_window_at_a_time_and_breaks_are_kept_as_long_as_asked() -> None:
    history = KeyHistory()
    assert history.follow_load(1000.0, 10.0, 120.0) == 10.0  # the first reading is the level
    assert history.follow_load(1010.0, 0.0, 120.0) == pytest.approx(10.0 * math.exp(-10.0 / 120.0))
    assert history.follow_load(1130.0, 0.0, 120.0) == pytest.approx(10.0 * math.exp(-130.0 / 120.0))
    assert history.follow_load(1140.0, 4.0, 0.0) == 4.0  # no window: the reading itself
    history.broke(1000.0, 3, 10.0, keep_s=600.0)
    history.broke(1100.0, 2, 6.0, keep_s=600.0)
    assert history.broken_within(1200.0, 600.0, 12.0) == (1000.0, 3, 10.0)  # most pods, at this level or below
    assert history.broken_within(1200.0, 600.0, 8.0) == (1100.0, 2, 6.0)
    assert history.broken_within(1200.0, 600.0, 5.0) is None
    assert history.broken_within(1650.0, 600.0, 12.0) == (1100.0, 2, 6.0)  # the first is older than the window
    history.broke(1750.0, 4, 9.0, keep_s=600.0)
    assert [n for _, n, _ in history.breaks] == [4]  # those older than keep_s are dropped
    history.broke(1760.0, 4, 8.0, keep_s=600.0)  # a newer break at as many pods and a lower level replaces it
    history.broke(1770.0, 4, 8.5, keep_s=600.0)  # one at a higher level does not: the lower binds at less load
    assert history.breaks == [(1760.0, 4, 8.0), (1770.0, 4, 8.5)]


def test_counts_that_held_are_kept_at_the_most_load_they_held() -> None:
    history = KeyHistory()
    history.held(1000.0, 3, 10.0, keep_s=600.0)
    history.held(1100.0, 2, 6.0, keep_s=600.0)
    assert history.held_within(1200.0, 600.0, 5.0, below=4) == (1100.0, 2, 6.0)  # the fewest pods
    assert history.held_within(1200.0, 600.0, 8.0, below=4) == (1000.0, 3, 10.0)  # at this level or above
    assert history.held_within(1200.0, 600.0, 8.0, below=3) is None  # only counts under the floor
    assert history.held_within(1650.0, 600.0, 8.0, below=4) is None  # older than the window
    history.held(1700.0, 2, 7.0, keep_s=600.0)  # a newer hold at as many pods and more load replaces it
    history.held(1710.0, 2, 6.5, keep_s=600.0)  # one at less load does not: the higher speaks for more
    assert history.holds == [(1700.0, 2, 7.0), (1710.0, 2, 6.5)]


def test_the_first_token_floor_is_averaged_over_the_window_and_kept_through_runs_without_one() -> None:
    history = KeyHistory()
    assert history.follow_first_token_floor(1000.0, None, 120.0) is None  # nothing read yet
    assert history.follow_first_token_floor(1000.0, (1800.0, 3.6), 120.0) == (1800.0, 3.6)
    kept = history.follow_first_token_floor(1010.0, None, 120.0)  # a window with no p95 prompt
    assert kept == (1800.0, 3.6)
    tokens, seconds = history.follow_first_token_floor(1130.0, (1200.0, 2.4), 120.0)
    share = 1.0 - math.exp(-130.0 / 120.0)  # from the last reading, not the last run
    assert (tokens, seconds) == pytest.approx((1800.0 - 600.0 * share, 3.6 - 1.2 * share))
    assert TunerMemory.load(TunerMemory(keys={"colocated/replicas": history}).to_json()).keys[
        "colocated/replicas"
    ].first_token_floor == pytest.approx((1130.0, tokens, seconds))
