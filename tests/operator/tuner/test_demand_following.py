"""Replicas that follow demand both ways: a scale-down that reaches demand within the stabilization
window plus two intervals, in one step where the latency projection allows; a forecast that asks
for a ramp's pods a start-up ahead, never for fewer than the reactive law; the prefill:decode
ratio's bounds and hysteresis; and the spend against the need that each decision reports."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import pytest

from llmfleet.operator.tuner.forecast import Holt, PoolForecast
from llmfleet.operator.tuner.law import REPLICAS, Decision, PoolInput, PoolSettings, Tuner, TunerConfig
from llmfleet.operator.tuner.memory import Capacity, TunerMemory
from tests.operator.tuner.scenarios import SLO, latency, limits, metrics, pool_input, settings

INTERVAL = 10.0
WINDOW = 120.0
CONFIG = TunerConfig(
    scale_down_stabilization_s=WINDOW,
    flap_window_s=WINDOW,
    cooldown_s=30.0,
    knob_relax_stabilization_s=30.0,
    interval_s=INTERVAL,
)


def run_loop(
    tuner: Tuner,
    make: Callable[[int, float, dict[str, PoolSettings]], dict[str, PoolInput]],
    runs: int,
    start: dict[str, PoolSettings],
) -> list[Decision]:
    current, memory, decisions = start, TunerMemory(), []
    for i in range(runs):
        now = 1000.0 + i * INTERVAL
        decision = tuner.decide(make(i, now, current), SLO, memory, now)
        decisions.append(decision)
        current, memory = dict(decision.settings), TunerMemory.load(decision.memory.to_json())
    return decisions


def replica_moves(decisions: list[Decision], pool: str = "colocated") -> list[tuple[float, int, int, str]]:
    return [
        (d.at, int(c.old), int(c.new), c.driver)
        for d in decisions
        for c in d.changes
        if c.knob == REPLICAS and c.pool == pool
    ]


def backlog_then_quiet(ttft_ms: float = 100.0) -> Callable[[int, float, dict[str, PoolSettings]], dict[str, PoolInput]]:
    """16 pods up after a backlog; from the first run on, demand is 3.5 replica-equivalents
    (12000 prompt tok/s over 4000 per replica, 200 generated over 400): 5 pods with 20% headroom."""

    def make(i: int, now: float, current: dict[str, PoolSettings]) -> dict[str, PoolInput]:
        pods = current["colocated"].replicas
        m = metrics(ttft_ms=ttft_ms, itl_ms=20.0, prompt_tps=12000.0, gen_tps=200.0, pods=pods, at=now)
        return {"colocated": pool_input(m, current["colocated"], limits(max_replicas=16))}

    return make


def test_a_drained_backlogs_pods_go_within_the_window_plus_two_intervals_in_one_step() -> None:
    """HPA's default scale-down policy may drop all the excess once its window agrees: so does the
    tuner, where the latency projection says the SLOs hold at the lower count."""
    decisions = run_loop(Tuner(CONFIG), backlog_then_quiet(), runs=30, start={"colocated": settings(replicas=16)})
    moves = replica_moves(decisions)
    assert moves == [(moves[0][0], 16, 5, "demand")], moves
    assert moves[0][0] - 1000.0 <= WINDOW + 2 * INTERVAL
    assert decisions[-1].inputs["colocated"]["neededReplicas"] == 5


def on_off(bursts: list[float]) -> Callable[[int, float, dict[str, PoolSettings]], dict[str, PoolInput]]:
    """8 pods serving a burst (24000 prompt tok/s, 6 replica-equivalents at 4000 each); quiet (half
    a replica's worth) until two runs after the pool has scaled down, then a burst that queues on
    the pods left (each at its 4000), then quiet. ``bursts`` gets the times of the bursts."""
    fell: list[float] = []

    def make(i: int, now: float, current: dict[str, PoolSettings]) -> dict[str, PoolInput]:
        pods = current["colocated"].replicas
        if i > 0 and pods < 8 and not fell:
            fell.append(now)
        if i == 0 or (fell and len(bursts) == 1 and now == fell[0] + 2 * INTERVAL):
            bursts.append(now)
        prompt, waiting, growth = 2000.0, 0.0, None
        if now in bursts:
            prompt = min(24000.0, 4000.0 * pods)
            waiting, growth = (0.0, None) if pods >= 8 else (40.0, 5.0)
        m = metrics(
            ttft_ms=100.0,
            itl_ms=20.0,
            prompt_tps=prompt,
            gen_tps=20.0,
            running=2.0,
            mean_batch=2.0,
            waiting=waiting,
            growth=growth,
            pods=pods,
            at=now,
        )
        return {"colocated": pool_input(m, current["colocated"], limits(max_replicas=16))}

    return make


def test_a_scale_down_undone_within_the_window_stretches_it_by_the_time_it_took() -> None:
    """Load that comes back after quiet spells longer than the scale-down window (bursts shorter
    than a pod start-up) meets the pods a scale-down let go: once a scale-down of several pods has
    been undone within the window, later scale-downs wait out the window plus that spell."""
    bursts: list[float] = []
    start = {"colocated": settings(replicas=8)}
    decisions = run_loop(Tuner(CONFIG), on_off(bursts), runs=60, start=start)
    moves = replica_moves(decisions)
    down, undone, again = moves[:3]
    # each move comes the run after the window has left the last high recommendation behind
    assert down[0] == bursts[0] + WINDOW + INTERVAL and down[1] - down[2] >= CONFIG.regret_min_fall, moves
    assert undone[0] == bursts[1] and undone[2] > undone[1]  # within the window: a regret
    gap = bursts[1] - down[0]
    assert again[0] == bursts[1] + WINDOW + gap + INTERVAL and again[2] < again[1], moves
    reason = next(c.reason for d in decisions for c in d.changes if d.at == again[0])
    assert f"the {WINDOW:.0f} s window stretched by {gap:.0f} s: a scale-down was undone {gap:.0f} s after" in reason

    # a regret needs a fall of regret_min_fall pods or more: the window holds
    bursts.clear()
    decisions = run_loop(Tuner(replace(CONFIG, regret_min_fall=7)), on_off(bursts), runs=60, start=start)
    assert replica_moves(decisions)[2][0] == bursts[1] + WINDOW + INTERVAL


def test_the_latency_projection_is_the_floor_and_says_so() -> None:
    """TTFT near its SLO: the projection holds more pods than throughput asks for, and the move
    that goes as far as it allows says the floor drove it. Further steps wait until the SLO's
    window has seen the fewer pods."""
    decisions = run_loop(
        Tuner(CONFIG), backlog_then_quiet(ttft_ms=300.0), runs=40, start={"colocated": settings(replicas=16)}
    )
    moves = replica_moves(decisions)
    assert moves and moves[0][1] == 16 and moves[0][2] > 5 and moves[0][3] == "floor", moves
    assert all(new < old for _, old, new, _ in moves)  # down only: no flapping
    later = [t for t, *_ in moves[1:]]
    assert all(b - a >= 60.0 for a, b in zip([moves[0][0], *later], later, strict=False))
    assert any("(the latency floor)" in c.reason for d in decisions for c in d.changes)


def test_a_latency_no_pod_count_lowers_does_not_hold_the_pods() -> None:
    """TTFT at 98% of its SLO with 20 ms of it queueing: its own work, which 16 pods do no faster
    than 5. Judged against the limit alone, every count fewer projects past it and all 16 pods
    stay; judged by what a count adds, the pool steps down to its demand."""
    decisions = run_loop(
        Tuner(CONFIG), backlog_then_quiet(ttft_ms=490.0), runs=40, start={"colocated": settings(replicas=16)}
    )
    moves = replica_moves(decisions)
    assert moves and moves[0][1] == 16 and moves[-1][2] == 5, moves
    assert all(new < old for _, old, new, _ in moves)


def broke_at_three(waiting: float = 0.0) -> Callable[[int, float, dict[str, PoolSettings]], dict[str, PoolInput]]:
    """TTFT over its SLO at 3 pods with the batching window spent, at 10 requests/s; then, at the
    same request rate, requests a quarter the size (demand 0.75 replicas) that hold the SLO at
    any count; from the 40th run on, 4 requests/s."""

    def make(i: int, now: float, current: dict[str, PoolSettings]) -> dict[str, PoolInput]:
        pods, tokens = current["colocated"].replicas, 1.0 if i < 2 else 0.25
        m = metrics(
            ttft_ms=800.0 if i < 2 else 250.0,
            itl_ms=20.0,
            rate=10.0 if i < 40 else 4.0,
            prompt_tps=4000.0 * tokens,
            gen_tps=200.0 * tokens,
            waiting=waiting if i < 2 else 0.0,
            pods=pods,
            at=now,
        )
        return {"colocated": pool_input(m, current["colocated"], limits(budget=(64, 512)))}

    return make


def test_a_count_that_broke_the_slo_is_not_returned_to_at_the_load_it_broke_at() -> None:
    """A projection extrapolates from the pods there are; a count that broke the SLO measured
    fewer. While the load level (requests/s over the scale-down window) stays within the headroom
    of the one it broke at, the pool holds one pod above it and says why; once the level has
    fallen further, it comes down to what the projection and demand allow."""
    start = {"colocated": settings(replicas=3, timeout=0, budget=512)}
    decisions = run_loop(Tuner(CONFIG), broke_at_three(), runs=70, start=start)
    moves = replica_moves(decisions)
    assert moves[0][1:] == (3, 4, "latency"), moves
    at_load = [d for d in decisions if 1100.0 <= d.at < 1400.0]
    assert all(d.settings["colocated"].replicas == 4 for d in at_load)
    assert all(d.inputs["colocated"]["neededReplicas"] == 4 for d in at_load)  # the need, so no scale-down lag
    assert "3 pods fell short of the SLO 390 s ago at 10.00 requests/s" in " ".join(at_load[-1].reasons)
    assert moves[-1][2] == 1 and moves[1][0] > 1400.0, moves

    # without the memory the pool would go as low as demand and the projection say, at once
    forgetful = TunerConfig(**{**CONFIG.__dict__, "break_memory_s": 0.0})
    early = replica_moves(run_loop(Tuner(forgetful), broke_at_three(), runs=40, start=start))
    assert len(early) > 1 and early[1][0] < 1400.0 and early[1][2] < 4, early


def test_a_break_under_a_backlog_is_not_remembered() -> None:
    """An SLO broken while requests queue says the pods were behind, not that the count cannot
    hold the load once they catch up: the pool comes down as before."""
    start = {"colocated": settings(replicas=3, timeout=0, budget=512)}
    moves = replica_moves(run_loop(Tuner(CONFIG), broke_at_three(waiting=6.0), runs=40, start=start))
    assert len(moves) > 1 and moves[1][0] < 1400.0 and moves[-1][2] < 4, moves


def ramp(predictive: bool) -> list[Decision]:
    """Prompt load rising 1500 tok/s a minute from 4000 (1.25 replicas' worth) on pods that keep
    up: the reactive law follows the served rate; the forecast asks for the pods a start-up ahead."""

    def make(i: int, now: float, current: dict[str, PoolSettings]) -> dict[str, PoolInput]:
        pods = current["colocated"].replicas
        prompt = 4000.0 + 25.0 * i * INTERVAL
        m = metrics(ttft_ms=100.0, itl_ms=30.0, prompt_tps=prompt, gen_tps=0.0, pods=pods, at=now)
        return {"colocated": pool_input(m, current["colocated"], limits(max_replicas=16))}

    config = TunerConfig(**{**CONFIG.__dict__, "predictive": predictive})
    return run_loop(Tuner(config), make, runs=40, start={"colocated": settings(replicas=2)})


def test_a_ramp_is_met_a_start_up_ahead_and_the_decision_says_the_forecast_drove_it() -> None:
    reactive, predictive = ramp(False), ramp(True)
    ups = [m for m in replica_moves(predictive) if m[2] > m[1]]
    assert any(driver == "forecast" for *_, driver in ups), ups
    assert all(driver != "forecast" for *_, driver in replica_moves(reactive))
    # at every run the predictive pool holds at least the reactive one's replicas, and often more
    pairs = [
        (p.settings["colocated"].replicas, r.settings["colocated"].replicas)
        for p, r in zip(predictive, reactive, strict=True)
    ]
    assert all(p >= r for p, r in pairs) and sum(p > r for p, r in pairs) >= 5, pairs
    outlook = predictive[-1].inputs["colocated"]["forecast"]
    # one start-up and one interval: here pods are ready at the next run, so 10 s measured + 10 s
    assert outlook["horizonSeconds"] == 20 and ramp(True)[0].inputs["colocated"]["forecast"]["horizonSeconds"] == 70


def ramp_with_itl(itl_ms: float) -> list[Decision]:
    """The ramp above, its ITL p95 ``itl_ms`` against the 100 ms SLO on every run."""

    def make(i: int, now: float, current: dict[str, PoolSettings]) -> dict[str, PoolInput]:
        prompt = 4000.0 + 25.0 * i * INTERVAL
        m = metrics(ttft_ms=100.0, itl_ms=itl_ms, prompt_tps=prompt, gen_tps=0.0, pods=current["colocated"].replicas)
        return {"colocated": pool_input(replace(m, at=now), current["colocated"], limits(max_replicas=16))}

    return run_loop(Tuner(CONFIG), make, runs=40, start={"colocated": settings(replicas=2)})


def test_a_ramp_that_would_break_a_latency_near_its_slo_is_priced_in_latency() -> None:
    """ITL at 90% of its SLO: the ramp's load a start-up ahead projects it past the SLO at
    today's count well before demand with headroom asks for a pod, so the forecast adds the pods
    that hold it, and says so. With ITL at 30% the forecast waits for demand."""
    near, far = ramp_with_itl(90.0), ramp_with_itl(30.0)
    first_up = [next(m for m in replica_moves(d) if m[2] > m[1]) for d in (near, far)]
    assert first_up[0][3] == "forecast" and first_up[0][0] < first_up[1][0], first_up
    reasons = [c.reason for d in near for c in d.changes if c.knob == REPLICAS]
    assert any("that load projects the owned latency at" in r for r in reasons), reasons
    pairs = [
        (a.settings["colocated"].replicas, b.settings["colocated"].replicas) for a, b in zip(near, far, strict=True)
    ]
    assert all(a >= b for a, b in pairs), pairs


def rising_at_four_pods(ready_since: float, now: float = 1000.0) -> Decision:
    """4 pods, the fourth ready since ``ready_since`` (three before it), ITL p95 95 ms against the
    100 ms SLO over a 60 s window, and prompt load rising 480 tok/s a minute: about 0.37 replicas
    over the 40 s horizon, short of a pod by demand with headroom."""
    capacity = Capacity(
        prompt_tps=1000.0, generation_tps=100.0, measured=True, observations=1, pods=4, pods_since=ready_since
    )
    capacity.pods_before = 3
    for at, seqs, prompt in ((700.0, 2.0, 10.0), (800.0, 8.0, 40.0), (900.0, 16.0, 5.0)):
        capacity.steps.observe(at, seqs, seqs + prompt, 0.060 + 0.005 * seqs + 0.001 * prompt)
    memory = TunerMemory()
    memory.capacity["colocated"] = capacity
    memory.key("colocated", REPLICAS).moved(ready_since - 40.0, 1)
    forecast = PoolForecast(startup_s=30.0)
    for series, value, trend in (("prompt_tokens_per_s", 1600.0, 8.0), ("generation_tokens_per_s", 100.0, 0.0)):
        forecast.series[series] = Holt(level=value - trend * INTERVAL, trend=trend, at=now - INTERVAL, points=10)
    memory.forecast["colocated"] = forecast
    m = metrics(itl_ms=95.0, prompt_tps=1600.0, gen_tps=100.0, rate=8.0, step_ms=100.0, steps_per_s=32.0, pods=4)
    m = replace(m, at=now, slo_window_s=60.0, slo_ttft=latency(200.0), slo_itl=latency(95.0))
    pools = {"colocated": pool_input(m, settings(replicas=4, timeout=0), limits(max_replicas=16))}
    return Tuner(CONFIG).decide(pools, SLO, memory, now)


def test_a_ramp_is_priced_in_latency_at_the_pods_that_measured_it() -> None:
    """Once the window has seen 4 pods at 95% of the ITL SLO, the ramp projects it past the SLO
    and the forecast adds a fifth. With the fourth pod ready only this run, that latency was
    measured on three: read as four's, it asked for the pod that had just come all over again
    (the diurnal ramp climbed to 7 pods where 5 held it)."""
    held = rising_at_four_pods(ready_since=900.0)
    assert held.changed("colocated", REPLICAS).new == 5, held.reasons
    assert any("at 4 pods that load projects the owned latency at" in r for r in held.reasons), held.reasons
    fresh = rising_at_four_pods(ready_since=1000.0)
    assert fresh.changed("colocated", REPLICAS) is None, fresh.reasons


def test_the_window_pods_are_its_pod_seconds_over_its_seconds() -> None:
    capacity = Capacity(prompt_tps=1.0, generation_tps=1.0, pods=4, pods_since=1000.0)
    assert capacity.window_pods(1000.0, 60.0) == 4.0  # no earlier count known: the one there is
    capacity.pods_before = 3
    assert [capacity.window_pods(at, 60.0) for at in (1000.0, 1030.0, 1060.0, 1200.0)] == [3.0, 3.5, 4.0, 4.0]


def test_a_ramp_stands_out_of_the_noise_its_level_keeps_not_a_single_readings() -> None:
    """The ramp above with every reading 1000 tok/s off, up and down in turn: one run's forecast
    error (1000 tok/s and more) dwarfs the 250 tok/s the trend adds over a 20 s horizon, yet the
    smoothed level it carries is four times steadier. The forecast still asks for the pods first."""

    def make(i: int, now: float, current: dict[str, PoolSettings]) -> dict[str, PoolInput]:
        prompt = 4000.0 + 25.0 * i * INTERVAL + (1000.0 if i % 2 else -1000.0)
        m = metrics(ttft_ms=100.0, itl_ms=30.0, prompt_tps=prompt, gen_tps=0.0, pods=current["colocated"].replicas)
        return {
            "colocated": pool_input(
                m.__class__(**{**m.__dict__, "at": now}), current["colocated"], limits(max_replicas=16)
            )
        }

    decisions = run_loop(Tuner(CONFIG), make, runs=40, start={"colocated": settings(replicas=2)})
    ups = [m for m in replica_moves(decisions) if m[2] > m[1]]
    assert ups and ups[0][3] == "forecast", ups


@pytest.mark.parametrize("itl_ms", [30.0, 90.0])  # far from its SLO, and where a little load would break it
def test_noise_without_a_trend_buys_no_pods(itl_ms: float) -> None:
    def make(i: int, now: float, current: dict[str, PoolSettings]) -> dict[str, PoolInput]:
        prompt = 8000.0 + (600.0 if i % 2 else -600.0)
        m = metrics(ttft_ms=100.0, itl_ms=itl_ms, prompt_tps=prompt, gen_tps=0.0, pods=current["colocated"].replicas)
        return {"colocated": pool_input(m.__class__(**{**m.__dict__, "at": now}), current["colocated"])}

    decisions = run_loop(Tuner(CONFIG), make, runs=30, start={"colocated": settings(replicas=3)})
    assert all(driver != "forecast" for *_, driver in replica_moves(decisions))


def test_pod_start_up_is_measured_from_the_pools_own_scale_ups() -> None:
    from llmfleet.operator.tuner.forecast import PoolForecast

    state = PoolForecast()
    state.scaled_up(100.0, 4)
    state.ready(120.0, 3)
    assert state.startup_s is None  # not all of them yet
    state.ready(145.0, 4)
    assert state.startup_s == 45.0 and state.rising_since is None


def disaggregated(prefill_tps: float, decode_gen_tps: float) -> Callable:
    def make(i: int, now: float, current: dict[str, PoolSettings]) -> dict[str, PoolInput]:
        return {
            "prefill": pool_input(
                metrics("prefill", prompt_tps=prefill_tps, gen_tps=None, pods=current["prefill"].replicas, at=now),
                current["prefill"],
            ),
            "decode": pool_input(
                metrics(
                    "decode",
                    itl_ms=30.0,
                    prompt_tps=None,
                    gen_tps=decode_gen_tps,
                    pods=current["decode"].replicas,
                    at=now,
                ),
                current["decode"],
            ),
        }

    return make


def test_the_prefill_decode_ratio_stays_within_its_spec_bounds() -> None:
    """Decode needs 6 pods, prefill 1: with prefillDecodeRatio min 0.5 the prefill pool is raised
    to 3, and the change says the ratio drove it."""
    config = TunerConfig(**{**CONFIG.__dict__, "prefill_decode_ratio": (0.5, 2.0)})
    start = {"prefill": settings(replicas=1), "decode": settings(replicas=6)}
    decisions = run_loop(Tuner(config), disaggregated(2000.0, 1900.0), runs=3, start=start)
    final = decisions[-1].settings
    assert final["decode"].replicas == 6 and final["prefill"].replicas == 3
    assert ("prefill", "ratio") in {(c.pool, c.driver) for d in decisions for c in d.changes}
    unbounded = run_loop(Tuner(CONFIG), disaggregated(2000.0, 1900.0), runs=3, start=start)
    assert unbounded[-1].settings["prefill"].replicas == 1


def test_a_pools_demand_at_the_edge_of_a_count_does_not_move_the_ratio() -> None:
    """Decode demand 3.9 replica-equivalents with 20% headroom is 4.875 pods: at 6 pods the
    hysteresis keeps 6 where demand alone would take 5 (it needs a quarter replica of margin)."""
    start = {"prefill": settings(replicas=1), "decode": settings(replicas=6)}
    decisions = run_loop(Tuner(CONFIG), disaggregated(2000.0, 1560.0), runs=20, start=start)
    assert decisions[-1].settings["decode"].replicas == 6
    assert any("the P:D ratio holds" in line for d in decisions for line in d.reasons)
    clear = run_loop(Tuner(CONFIG), disaggregated(2000.0, 1400.0), runs=20, start=start)
    assert clear[-1].settings["decode"].replicas == 5


def test_each_decision_reports_the_fleets_spend_against_its_need() -> None:
    decisions = run_loop(Tuner(CONFIG), backlog_then_quiet(), runs=30, start={"colocated": settings(replicas=16)})
    cost = decisions[-1].inputs["colocated"]["cost"]
    spent = sum(d.settings["colocated"].replicas for d in decisions[:-1]) * INTERVAL / 60.0
    needed = sum(float(d.inputs["colocated"]["neededReplicas"]) for d in decisions[:-1]) * INTERVAL / 60.0
    assert cost["replicaMinutes"] == round(spent, 2) and cost["neededReplicaMinutes"] == round(needed, 2)
    assert math.isclose(cost["excess"], cost["replicaMinutes"] / cost["neededReplicaMinutes"], rel_tol=1e-2)
    assert cost["excess"] > 1.5  # 16 pods for two minutes where 5 would do


def test_a_break_at_todays_count_keeps_it_where_one_below_broke_too() -> None:
    """3 pods broke, then 4 (the scale-up it asked for refused as a reversal): the break at the
    most pods is 4's, one above it is a scale-up, which is not the floor's to make. Fewer than
    today's 4 break sooner than 4 did, so the floor keeps 4 (long-prompt seed 11 went to 3 and
    missed a minute where this returned the proposal unfloored)."""
    from llmfleet.operator.tuner.proposal import Proposal

    mem = TunerMemory()
    history = mem.key("colocated", REPLICAS)
    history.follow_load(1000.0, 0.5, CONFIG.scale_down_stabilization_s)
    history.broke(700.0, 3, 0.42, CONFIG.break_memory_s)
    history.broke(760.0, 4, 0.48, CONFIG.break_memory_s)
    pool = pool_input(metrics(rate=0.5, pods=4, at=1000.0), settings(replicas=4))
    proposal = Proposal(2.0, "demand", driver="demand", load=0.5)
    floored = Tuner(CONFIG).evidence.above_counts_that_broke("colocated", pool, proposal, mem, 1000.0)
    assert floored.floor == 4.0 and floored.needed == 4.0
    assert "4 pods fell short of the SLO 240 s ago at 0.48 requests/s" in floored.why
