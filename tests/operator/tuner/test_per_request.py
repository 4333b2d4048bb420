"""What a waiting request weighs: the window's tokens over the requests they belong to, the
running ones counted while few have finished, so that a start-up's queue buys the pods it needs
and not several times as many."""

from __future__ import annotations

import math

from llmfleet.operator.tuner.law import REPLICAS, Tuner
from llmfleet.operator.tuner.memory import Capacity, TunerMemory
from llmfleet.operator.tuner.per_request import Finished, offered, requests_per_s
from tests.operator.tuner.scenarios import ONE_SHOT, SLO, limits, metrics, pool_input, settings


def test_finished_requests_count_the_first_window_then_accrue_run_to_run() -> None:
    finished = Finished()
    finished.observe(metrics(rate=2.0, at=1000.0))  # the window's 60 s: 120 finished
    finished.observe(metrics(rate=2.0, at=1010.0))
    finished.observe(metrics(rate=2.0, at=1010.0))  # the same snapshot again adds nothing
    finished.observe(metrics(rate=1.0, at=2000.0))  # after a gap, at most one window's worth
    assert finished.count == 120.0 + 20.0 + 60.0


def test_running_requests_weigh_in_while_few_have_finished_and_fade_as_they_accrue() -> None:
    m = metrics(rate=1.0 / 60.0, running=8.0)  # one request finished in the window, eight running
    start = requests_per_s(m, Finished(count=1.0))
    assert math.isclose(start, (1.0 + 8.0 * 8.0 / 9.0) / 60.0)
    later = requests_per_s(m, Finished(count=10_000.0))
    assert math.isclose(later, 1.0 / 60.0, rel_tol=0.01)
    assert requests_per_s(metrics(rate=0.0, running=8.0), Finished()) == 0.0  # nothing finished: no price


def test_the_load_a_queue_holds_back_is_the_served_rates_plus_its_growth_in_requests() -> None:
    rates = {"prompt": 4000.0, "generation": 1000.0, "unknown": None}
    grows, drains = metrics(growth=2.0), metrics(growth=-2.0)
    assert offered(grows, rates, 10.0) == {"prompt": 4800.0, "generation": 1200.0, "unknown": None}
    assert offered(drains, rates, 10.0) == {"prompt": 3200.0, "generation": 800.0, "unknown": None}
    assert offered(metrics(growth=-20.0), rates, 10.0)["prompt"] == 0.0  # never below nothing
    assert offered(metrics(growth=None), rates, 10.0) == dict.fromkeys(rates)  # growth unknown: no reading
    assert offered(grows, rates, 0.0) == dict.fromkeys(rates)  # no finished requests to weigh one by


def _start_up(finished: float) -> int:
    """Two pods a minute after a start from one: one request finished, eight running, seven
    waiting and the queue growing 0.4 requests/s; 30 generated and 400 prompt tokens/s."""
    m = metrics(
        rate=1.0 / 60.0,
        running=8.0,
        waiting=7.0,
        growth=0.4,
        prompt_tps=400.0,
        gen_tps=30.0,
        mean_batch=4.0,
        ttft_ms=None,
        itl_ms=None,
        queue_ms=None,
        pods=2,
    )
    memory = TunerMemory()
    memory.capacity["colocated"] = Capacity(prompt_tps=500.0, generation_tps=30.0, measured=True, observations=1)
    memory.finished["colocated"] = Finished(count=finished, at=900.0)
    pools = {"colocated": pool_input(m, settings(replicas=2), limits(max_replicas=64))}
    decision = Tuner(ONE_SHOT).decide(pools, SLO, memory, now=1000.0)
    change = decision.changed("colocated", REPLICAS)
    return 2 if change is None else int(change.new)


def test_a_start_ups_queue_is_priced_at_the_requests_in_flight_not_the_few_finished() -> None:
    """Priced over the one finished request, each waiting request weighs the window's 24000
    prompt tokens and 1800 generated: 74 pods' worth (64, the bound). Over the nine requests
    they belong to, 13; the same window after thousands have finished prices it as before."""
    assert _start_up(finished=1.0) == 13
    assert _start_up(finished=10_000.0) == 64
