"""The latency projection behind scale-down and latency scale-up (operator/tuner/projection.py):
steps that lengthen with the load a pod carries, ITL's tail as steps with prompt work grow common,
the wait for a batch slot (Erlang C), a busy window's surge, and the M/M/1 fallback where no step
times are reported."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from llmfleet.operator.metrics.source import Quantiles
from llmfleet.operator.tuner.decision import TunerConfig
from llmfleet.operator.tuner.projection import StepCosts, erlang_c, itl_tail, project, surge
from llmfleet.operator.tuner.proposal import busy_surge
from tests.operator.tuner.scenarios import latency, metrics

# Four pods, each busy 20% of the time with its sequences' and prompt tokens' work:
# 20 generated tok/s x 5 ms + 100 prompt tok/s x 1 ms. One request in a batch of up to 32 slots.
COSTS = StepCosts(per_seq_s=0.005, per_prompt_token_s=0.001, slots=32, budget=None)
FOUR_PODS = dict(pods=4, gen_tps=80.0, prompt_tps=400.0, rate=4.0, running=4.0, mean_batch=1.0, step_tokens=3.0)


def test_erlang_c_matches_the_textbook_values() -> None:
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: an arrival waits with probability rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert erlang_c(8, 0.0) == 0.0
    assert erlang_c(8, 8.0) == 1.0


def test_steps_lengthen_as_one_over_the_idle_share() -> None:
    m = metrics(ttft_ms=300.0, itl_ms=50.0, **FOUR_PODS)
    # half the pods: each busy 40%, so steps take (1 - 0.2) / (1 - 0.4) = 4/3 as long; a request's
    # own prompt work (100 tokens x 1 ms) takes as long as before, the other 200 ms of TTFT stretch
    projected = project("colocated", m, 400.0, 100.0, rho=0.3, k=2.0, steps=COSTS)
    assert projected.ratio == pytest.approx((200.0 * 4 / 3 + 100.0) / 400.0)
    assert "pods busy 20% -> 40% of the time, steps x1.33" in projected.how
    # the decode pool owns only ITL (and a TTFT share where the law gives it one), the prefill pool only TTFT
    assert project("decode", m, math.inf, 100.0, 0.3, 2.0, COSTS).ratio == pytest.approx(50.0 * 4 / 3 / 100.0)
    assert project("decode", m, 400.0, 100.0, 0.3, 2.0, COSTS).ratio == pytest.approx(projected.ratio)
    assert project("prefill", m, 400.0, 100.0, 0.3, 2.0, COSTS).ratio == pytest.approx(projected.ratio)
    # twice the pods: the whole TTFT shrinks with the steps (a scale-up short of it adds one later)
    assert project("prefill", m, 400.0, 100.0, 0.3, 0.5, COSTS).ratio < 300.0 * 0.9 / 400.0


def test_pods_are_busy_with_the_prompt_tokens_they_computed() -> None:
    """A decode server counts each request's whole prompt in vllm:prompt_tokens_total, though its
    KV came from a prefill server (as a prefix-cache hit's does): its steps carry one token per
    sequence, and only those cost it time."""
    sent = dict(FOUR_PODS, prompt_tps=4000.0, step_tokens=1.0)  # 4000 x 1 ms over 4 pods: busy 100%
    projected = project("decode", metrics("decode", **sent, steps_per_s=80.0), 400.0, 100.0, 0.3, 2.0, COSTS)
    assert "pods busy 10% -> 20% of the time" in projected.how  # 80 generated tok/s x 5 ms over 4 pods
    # without step counts the prompt tokens sent stand in: the pods read as full now (M/M/1 then)
    assert project("decode", metrics("decode", **sent), 400.0, 100.0, 0.3, 2.0, COSTS).how == "M/M/1"


def test_a_load_that_would_keep_the_pods_busy_cannot_hold() -> None:
    m = metrics(**FOUR_PODS)
    projected = project("colocated", m, 400.0, 100.0, rho=0.3, k=5.0, steps=COSTS)
    assert projected.ratio == math.inf and "saturated" in projected.how


def test_the_wait_for_a_batch_slot_is_added_where_the_batch_fills() -> None:
    few_slots = StepCosts(0.005, 0.001, slots=4, budget=None)
    m = metrics(ttft_ms=300.0, itl_ms=50.0, **FOUR_PODS | dict(running=4.0))
    plain = project("colocated", m, 400.0, 100.0, 0.3, 2.0, COSTS)
    crowded = project("colocated", m, 400.0, 100.0, 0.3, 2.0, few_slots)
    assert "slot wait p95" not in plain.how
    assert "slot wait p95" in crowded.how and crowded.ratio > plain.ratio


def test_a_batch_or_budget_full_now_falls_back_to_m_m_1() -> None:
    full = StepCosts(0.005, 0.001, slots=1, budget=None)  # one request per pod in one slot
    m = metrics(ttft_ms=300.0, queue_ms=100.0, itl_ms=50.0, **FOUR_PODS)
    projected = project("colocated", m, 400.0, 100.0, rho=0.5, k=1.5, steps=full)
    # queue 100 ms grows by (0.75 / 0.25) / (0.5 / 0.5) = 3; ITL by (1 - 0.5) / (1 - 0.75) = 2
    assert projected.how == "M/M/1"
    assert projected.ratio == pytest.approx(max((200.0 + 300.0) / 400.0, 100.0 / 100.0))


def test_without_step_times_an_unknown_queue_time_counts_ttft_as_all_wait() -> None:
    m = metrics(ttft_ms=200.0, queue_ms=None, itl_ms=10.0)
    projected = project("colocated", m, 400.0, 100.0, rho=0.2, k=2.0, steps=None)
    assert projected.ratio == pytest.approx(200.0 * (0.4 / 0.6) / (0.2 / 0.8) / 400.0)


def test_a_busy_window_surges_more_at_low_rates() -> None:
    assert surge(4.0, 60.0, 2.0) == pytest.approx(1 + 2 / math.sqrt(240))
    assert surge(0.5, 60.0, 2.0) == pytest.approx(1 + 2 / math.sqrt(30))
    assert surge(None, 60.0, 2.0) == 3.0  # nothing known: the sd itself


def test_a_busy_window_counts_the_requests_in_flight_not_only_its_arrivals() -> None:
    """Requests that live long against the window carry its work: 0.5 requests/s over a minute
    with 20 running swings as 50 requests do, not as the minute's 30 arrivals."""
    assert surge(0.5, 60.0, 2.0, in_flight=20.0) == pytest.approx(1 + 2 / math.sqrt(50))
    assert busy_surge(metrics(rate=0.5, running=16.0, waiting=4.0), TunerConfig()) == pytest.approx(
        1 + 2 / math.sqrt(50)
    )


def test_a_lone_prompt_fills_its_step_whatever_the_load() -> None:
    """A prefill pod that idles between prompts runs each alone: 240 of its 512 budget tokens per
    step at any load it keeps up with. What grows with the load is the prompt tokens that come in
    while a step runs, 240 x the 3% of the time it steps: 8x that load is far from the budget."""
    budget = StepCosts(per_seq_s=0.005, per_prompt_token_s=0.0004, slots=8, budget=512)
    idle = dict(pods=4, rate=1.2, prompt_tps=288.0, gen_tps=1.2, running=0.12, mean_batch=1.0, step_tokens=241.0)
    m = metrics("prefill", ttft_ms=100.0, **idle, steps_per_s=1.2, step_ms=100.0)
    projected = project("prefill", m, 400.0, 100.0, rho=0.03, k=8.0, steps=budget)
    assert math.isfinite(projected.ratio) and "saturated" not in projected.how
    # the same steps back to back (no step times known: taken so) would fill the budget at 8x
    busy = metrics("prefill", ttft_ms=100.0, **idle)
    projected = project("prefill", busy, 400.0, 100.0, rho=0.03, k=8.0, steps=budget)
    assert projected.ratio == math.inf and "budget tokens per step: saturated" in projected.how


def test_itl_p95_moves_up_the_tail_as_steps_with_prompt_work_grow_common() -> None:
    """The slow gaps are steps that carry prompt work; with 1.5x as many of them per step, the
    p95 is today's p96.7 (simulated chat, 4 -> 3 pods: 0.143 -> 0.198 s, where p95 x the step
    ratio said 0.16), read linearly between the p95 and the p99."""
    itl = Quantiles(p50=0.074, p95=0.143, p99=0.234, samples=8000)
    assert itl_tail(itl, 1.5) == pytest.approx(0.143 + 0.091 * (0.05 - 0.05 / 1.5) / 0.04)
    assert itl_tail(itl, 10.0) == pytest.approx(0.143 + 0.091 * 0.045 / 0.04)  # past p99: its slope
    assert itl_tail(itl, 1.0) == itl_tail(itl, 0.5) == 0.143  # fewer: the p95 stands
    assert itl_tail(replace(itl, samples=4000), 1.5) == 0.143  # a p99 that 40 gaps decide is noise


def test_a_measured_tail_is_read_through_the_quantiles_between_p95_and_p99() -> None:
    """1.5% of the gaps are prompt steps of seconds: p98 is still a decode step's, p99 is theirs.
    Read through the measured quantiles, growth 2 (p97.5) sits between p97 and p98, where the line
    from p95 to p99 reads 2.6 s; without them, or asked for the line, it stays the line."""
    ladder = ((0.96, 0.15), (0.97, 0.16), (0.98, 0.18))
    itl = Quantiles(p50=0.1, p95=0.14, p99=4.0, samples=8000, between=ladder)
    assert itl_tail(itl, 2.0, measured=True) == pytest.approx(0.17)
    line = 0.14 + (4.0 - 0.14) * 0.025 / 0.04
    assert itl_tail(itl, 2.0) == pytest.approx(line)
    assert itl_tail(replace(itl, between=()), 2.0, measured=True) == pytest.approx(line)
    assert itl_tail(itl, 1.0, measured=True) == 0.14  # no more prompt steps: the p95 stands
    assert itl_tail(itl, 10.0, measured=True) == itl_tail(itl, 10.0)  # past p99: the slope, either way


def test_the_projection_reads_itl_up_its_tail_by_the_growth_of_prompts_per_step() -> None:
    m = replace(metrics(ttft_ms=300.0, itl_ms=50.0, **FOUR_PODS), itl=latency(50.0, samples=6000.0))
    # half the pods: arrivals x2, steps x4/3, so prompts per step x8/3: the p98.1 (p99 = 1.2 x p95)
    projected = project("decode", m, math.inf, 100.0, 0.3, 2.0, COSTS)
    tail = 0.05 * 3 / 8
    assert projected.ratio == pytest.approx(50.0 * (1 + 0.2 * (0.05 - tail) / 0.04) * 4 / 3 / 100.0)


def test_a_busy_window_stretches_the_steps_as_far_as_its_requests_turn_over() -> None:
    """Steps stretch with the requests in flight, which climb to a busier load's level as fast as
    they turn over. Requests of a second (four pods, one running each) get there within the
    minute, and a 1.25x window is a steady 1.25x load; requests that live a minute (60 running
    each) get 1 - exp(-60 s / relaxation) of the way: a life of 60 s x 4/3 at half the pods, over
    their idle share of 0.6, is 133 s, so 36% of the way from steps x4/3 to x1.6."""
    unbounded = replace(COSTS, slots=None)
    short = metrics(ttft_ms=300.0, itl_ms=50.0, **FOUR_PODS)
    busy = project("colocated", short, 400.0, 100.0, 0.3, 2.0, unbounded, surge=1.25)
    steady = project("colocated", short, 400.0, 100.0, 0.3, 2.5, unbounded)
    assert busy.ratio == pytest.approx(steady.ratio, rel=1e-6)
    assert "pods busy 20% -> 40% of the time (50% in a busy window), steps x1.60" in busy.how

    long = metrics(ttft_ms=300.0, itl_ms=50.0, **FOUR_PODS | dict(running=240.0))
    busy = project("colocated", long, 400.0, 100.0, 0.3, 2.0, unbounded, surge=1.25)
    reached = 1.0 - math.exp(-60.0 * 0.6 / (60.0 * 4 / 3))
    step = 4 / 3 + (1.6 - 4 / 3) * reached
    assert f"steps x{step:.2f}" in busy.how and reached == pytest.approx(0.363, abs=1e-3)
    assert busy.ratio == pytest.approx((200.0 * step + 100.0) / 400.0)
    mean = project("colocated", long, 400.0, 100.0, 0.3, 2.0, unbounded)
    assert mean.ratio < busy.ratio < project("colocated", long, 400.0, 100.0, 0.3, 2.5, unbounded).ratio
    # a busy window whose arrivals' work alone would fill the pods' time saturates them, however
    # long the requests live
    full = project("colocated", long, 400.0, 100.0, 0.3, 4.0, unbounded, surge=1.25)
    assert full.ratio == math.inf and "pods busy 100% of the time: saturated" in full.how


def test_a_first_token_waits_behind_the_steps_a_prefill_pod_idles_between() -> None:
    """A prefill pod between prompts runs each in a step of its own, overhead and all: two pods
    whose token work keeps them busy 18% of the time step 33% of it (4 steps/s of 165 ms). At one
    pod a prompt finds the pod stepping 66% of the time, and its first token waits as behind
    steps at that load, not at the token work's 35%: one pod would break the TTFT that the token
    work alone projects it within."""
    costs = StepCosts(per_seq_s=0.0085, per_prompt_token_s=0.0015, slots=8, budget=256)
    chat = dict(pods=2, rate=4.0, prompt_tps=212.0, gen_tps=4.0, running=0.0, mean_batch=1.0, step_tokens=54.0)
    m = metrics("prefill", ttft_ms=250.0, queue_ms=None, **chat, steps_per_s=4.0, step_ms=165.0)
    projected = project("prefill", m, 430.0, 150.0, rho=0.2, k=2.0, steps=costs)
    assert "pods busy 18% -> 35% of the time" in projected.how
    assert "stepping 33% -> 66% of the time, first tokens wait x1.97" in projected.how
    assert projected.ratio > 1.0
    # the token work alone, as the steps of a colocated pod (which a prompt joins) are read
    assert project("colocated", m, 430.0, 150.0, 0.2, 2.0, costs).ratio < 0.9
    # pods stepping back to back (no step counts: taken so) share each step's overhead: unchanged
    busy = metrics("prefill", ttft_ms=250.0, queue_ms=None, **chat, step_ms=165.0)
    assert "stepping" not in project("prefill", busy, 430.0, 150.0, 0.2, 2.0, costs).how
    # a load that would keep one pod stepping all the time cannot hold
    full = project("prefill", m, 430.0, 150.0, 0.2, 3.0, costs)
    assert full.ratio == math.inf and full.how == "pods stepping 99% of the time: saturated"
