"""The step-time plane and what the tuner does with it: capacity that follows the knobs, a first
estimate from the first window instead of a default guess, and demand that counts a growing queue."""

from __future__ import annotations

import pytest

from llmfleet.operator.tuner.law import MAX_BATCH, REPLICAS, TOKEN_BUDGET, Tuner
from llmfleet.operator.tuner.memory import Capacity, TunerMemory
from llmfleet.operator.tuner.step_model import MAX_POINTS, StepModel
from tests.operator.tuner.scenarios import ONE_SHOT, SLO, metrics, pool_input, settings

# a CPU-like step: 25 ms, 1.5 ms per decoding sequence, 0.2 ms per prompt token
OVERHEAD_S, PER_SEQ_S, PER_PROMPT_S = 0.025, 0.0015, 0.0002
SPREAD = ((2, 0), (8, 0), (8, 200), (16, 40), (32, 0), (4, 400))  # (seqs, prompt tokens) per step


def step_s(seqs: float, prompt: float = 0.0) -> float:
    return OVERHEAD_S + PER_SEQ_S * seqs + PER_PROMPT_S * prompt


def model(points=SPREAD) -> StepModel:
    steps = StepModel()
    for i, (seqs, prompt) in enumerate(points):
        steps.observe(float(i), seqs, seqs + prompt, step_s(seqs, prompt))
    return steps


def plane(steps: StepModel):
    return steps.plane(overhead_seqs=16, prompt_token_share=0.25)


def test_points_that_spread_give_the_plane() -> None:
    fitted = plane(model())
    assert fitted.overhead_s == pytest.approx(OVERHEAD_S, rel=0.02)
    assert fitted.per_seq_s == pytest.approx(PER_SEQ_S, rel=0.02)
    assert fitted.per_prompt_token_s == pytest.approx(PER_PROMPT_S, rel=0.02)
    assert fitted.decode_tokens_per_s(32) == pytest.approx(32 / step_s(32), rel=0.02)
    assert fitted.prompt_tokens_per_s(512) == pytest.approx(512 / step_s(1, 512), rel=0.02)
    assert "fit over 6 windows, 2-32 seqs per step" in fitted.describe()


def test_one_operating_point_is_split_by_the_priors() -> None:
    one = plane(model([(8, 40)]))
    assert one.overhead_s + 8 * one.per_seq_s + 40 * one.per_prompt_token_s == pytest.approx(step_s(8, 40))
    assert one.overhead_s == pytest.approx(16 * one.per_seq_s) and one.per_prompt_token_s == pytest.approx(
        0.25 * one.per_seq_s
    )
    assert plane(StepModel()) is None


def test_a_band_keeps_its_newest_point_and_the_model_its_newest_bands() -> None:
    steps = StepModel()
    steps.observe(1.0, 16.0, 16.0, 0.050)
    steps.observe(2.0, 17.0, 17.0, 0.030)  # same band: replaces the first
    assert steps.points == [(2.0, 17.0, 17.0, 0.030)]
    for i in range(MAX_POINTS + 5):
        steps.observe(10.0 + i, 1.3**i, 1.3**i, step_s(1.3**i))
    assert len(steps.points) == MAX_POINTS and steps.points[-1][0] == 10.0 + MAX_POINTS + 4


def test_a_fit_with_a_negative_cost_falls_back_to_the_prior_split() -> None:
    steps = StepModel()
    for i, seqs in enumerate((2.0, 8.0, 32.0, 64.0)):
        steps.observe(float(i), seqs, seqs, 0.100 - 0.001 * seqs)  # faster with more sequences
    fitted = plane(steps)
    assert min(fitted.overhead_s, fitted.per_seq_s, fitted.per_prompt_token_s) > 0 and "prior split" in fitted.basis


# -- in the tuner -------------------------------------------------------------------------------


def with_plane() -> TunerMemory:
    memory = TunerMemory()
    memory.capacity["colocated"] = Capacity(prompt_tps=4000, generation_tps=400, steps=model())
    return memory


def decide(memory: TunerMemory, current, now: float = 1000.0, **kw):
    kw = {
        "itl_ms": 90,
        "prompt_tps": 60,
        "gen_tps": 600,
        "rate": 1.0,
        "mean_batch": 8,
        "step_tokens": 8,
        "step_ms": step_s(8) * 1000,
    } | kw
    pools = {"colocated": pool_input(metrics("colocated", at=now, **kw), current)}
    return Tuner(ONE_SHOT).decide(pools, SLO, memory, now=now)


def test_capacity_follows_the_batch_cap() -> None:
    # 400 generated tok/s: at maxBatchSize 8 a replica serves 8 / 37 ms = 216 tok/s, at 32 it
    # serves 32 / 73 ms = 438: two replicas' worth of demand against one
    small = decide(with_plane(), settings(replicas=2, batch=8), pods=2, gen_tps=400)
    large = decide(with_plane(), settings(replicas=2, batch=32), pods=2, gen_tps=400)
    assert small.inputs["colocated"]["capacity"]["generationTokensPerS"] == pytest.approx(216, rel=0.02)
    assert large.inputs["colocated"]["capacity"]["generationTokensPerS"] == pytest.approx(438, rel=0.02)
    assert large.inputs["colocated"]["capacity"]["basis"] == (
        "at maxBatchSize 32, maxNumBatchedTokens 512: step 24.6 ms + 1513 us/seq + 202 us/prompt token "
        "(fit over 6 windows, 2-32 seqs per step)"  # the prior pulls a little
    )
    assert small.changed("colocated", REPLICAS).new == 3
    assert large.changed("colocated", REPLICAS) is None


def test_the_replica_count_projects_the_batch_cap_this_run_sets() -> None:
    # a full batch with ITL to spare: the cap rises 8 -> 12 and the demand is judged at 12
    decision = decide(with_plane(), settings(replicas=2, batch=8), pods=2, itl_ms=50, gen_tps=400)
    assert decision.changed("colocated", MAX_BATCH).new == 12
    assert decision.inputs["colocated"]["capacity"]["generationTokensPerS"] == pytest.approx(12 / step_s(12), rel=0.02)


def test_the_first_window_with_step_times_replaces_the_default_guess() -> None:
    decision = decide(TunerMemory(), settings(batch=32), mean_batch=8, step_tokens=8, step_ms=36, gen_tps=100)
    capacity = decision.inputs["colocated"]["capacity"]
    per_seq = 0.036 / (16 + 8)  # the priors: overhead worth 16 sequences
    assert capacity["generationTokensPerS"] == pytest.approx(32 / (16 * per_seq + 32 * per_seq), rel=1e-3)
    assert "the prior split" in capacity["basis"]


def test_with_a_plane_a_queue_is_not_read_as_the_capacity() -> None:
    # 4 waiting per pod behind a batch cap of 8 serving 180 tok/s: the queue may be the cap's or a
    # window's doing, so the plane (216 tok/s at 8) stands; the cap rises this run, judged at 12
    decision = decide(with_plane(), settings(batch=8), waiting=4, itl_ms=50, prompt_tps=0, gen_tps=180)
    assert decision.changed("colocated", MAX_BATCH).new == 12
    assert decision.memory.capacity["colocated"].scale == 1.0
    assert any("not the pool's capacity: the step plane gives it" in r for r in decision.reasons)
    # a pod serving more than the plane says raises it at once
    faster = decide(with_plane(), settings(batch=8), waiting=4, itl_ms=50, prompt_tps=0, gen_tps=300)
    assert faster.memory.capacity["colocated"].scale == pytest.approx(300 / (8 / step_s(8)), rel=0.02)


@pytest.mark.parametrize(("growth", "counted"), [(0.5, True), (0.01, False)])
def test_a_growing_queue_counts_as_demand(growth: float, counted: bool) -> None:
    decision = decide(
        with_plane(), settings(batch=8, timeout=0), waiting=6, growth=growth, rate=2.0, prompt_tps=400, gen_tps=200
    )
    reasons = " ".join(decision.reasons)
    assert ("queue growing" in reasons) is counted
    if counted:
        assert "queue growing 0.50 req/s" in reasons


def test_a_draining_queue_counts_its_backlog_once() -> None:
    """A queue shrinking 0.5 requests/s while 6 still wait: of the 200 tokens/s served, a quarter
    (0.5 of 2 requests/s) was backlog, which the backlog term prices too; the arrivals are the
    rest. Never below none, however fast the queue empties (requests cancelled while waiting)."""

    def demand(growth: float) -> str:
        decision = decide(
            with_plane(), settings(batch=8, timeout=0), waiting=6, growth=growth, rate=2.0, prompt_tps=0, gen_tps=200
        )
        return next(r for r in decision.reasons if "demand " in r)

    steady, draining = demand(0.0), demand(-0.5)
    served = float(steady.split("demand ")[1].split(" replicas")[0])
    backlog = float(steady.split("= ")[1].split(";")[0].split(")")[0])
    assert f"- queue draining 0.50 req/s = {0.25 * (served - backlog):.2f}" in draining
    assert f"demand {served - 0.25 * (served - backlog):.2f} replicas" in draining
    emptied = demand(-50.0)
    assert f"demand {backlog:.2f} replicas" in emptied, emptied


@pytest.mark.parametrize(("ttft_ms", "recovers"), [(200, True), (450, False)])
def test_a_latency_cut_capacity_recovers_once_the_slos_are_met_with_margin(ttft_ms: float, recovers: bool) -> None:
    """A capacity cut to half the plane (saturated for latency, once) moves 30% of the way back per
    window while every owned latency is under 0.8x its SLO; at 0.9x it stays cut."""
    memory = TunerMemory()
    memory.capacity["colocated"] = Capacity(
        prompt_tps=4000.0, generation_tps=400.0, steps=model(), scale=0.5, measured=True, pods=2, pods_since=0.0
    )
    m = metrics(
        ttft_ms=ttft_ms,
        queue_ms=20,
        itl_ms=40,
        prompt_tps=100,
        gen_tps=20,
        pods=2,
        waiting=0,
        mean_batch=4,
        step_tokens=8,
        step_ms=1000 * step_s(4, 4),
    )
    pools = {"colocated": pool_input(m, settings(replicas=2, timeout=0))}
    decision = Tuner(ONE_SHOT).decide(pools, SLO, memory, now=1000.0)
    scale = decision.memory.capacity["colocated"].scale
    if recovers:
        assert scale == pytest.approx(0.65)
        assert any("(< 0.8): back towards the step plane" in r for r in decision.reasons)
    else:
        assert scale == pytest.approx(0.5)


def itl_over_with_prompt_chunks(budget: float, prompt_tokens: float, prompt_p95: float | None = None, **queue):
    """Steps of 8 sequences and 192 prompt tokens take 75 ms, ITL p95 is 130 ms against 100 ms,
    and a request a second brings ``prompt_tokens`` (``prompt_p95``: the p95 prompt). ``queue``:
    the TTFT and waiting requests, where not the defaults (TTFT within its SLO, none waiting)."""
    return decide(
        with_plane(),
        settings(batch=16, budget=budget),
        **queue,
        itl_ms=130,
        mean_batch=8,
        step_tokens=200,
        step_ms=step_s(8, 192) * 1000,
        rate=1.0,
        prompt_tps=prompt_tokens,
        prompt_p95=prompt_p95,
        gen_tps=100,
    )


@pytest.mark.parametrize(("budget", "cut"), [(512, False), (256, True)])
def test_a_budget_cut_helps_itl_only_where_its_full_steps_fit(budget: float, cut: bool) -> None:
    """Prompts of 400 tokens. At 512 the x0.75 cut to 384 leaves full steps of 75 + 0.2 x 184 =
    112 ms, still over: the prompts would only take more steps each, so the budget holds, spent,
    the batch holds with it (the prompts make the steps long, not the batch), and replicas take
    over. At 256 the cut to 192 leaves 74 ms steps: the budget is cut."""
    decision = itl_over_with_prompt_chunks(budget, prompt_tokens=400)
    reasons = " ".join(decision.reasons)
    assert decision.changed("colocated", MAX_BATCH) is None
    if cut:
        assert decision.changed("colocated", TOKEN_BUDGET).new == 192
        assert "maxNumBatchedTokens shrinks instead" in reasons
        return
    assert decision.changed("colocated", TOKEN_BUDGET) is None
    assert "a full step at maxNumBatchedTokens 384 would take 112 ms (> 0.95 x SLO)" in reasons
    assert "no maxNumBatchedTokens brings them within it: maxBatchSize stays 16" in reasons
    assert decision.changed("colocated", REPLICAS).new > 1
    assert "SLO violated with maxNumBatchedTokens at its limit, maxBatchSize at its limit" in reasons


def test_a_budget_whose_chunks_break_itl_anyway_grows_where_prompts_span_several_steps() -> None:
    """As above at 512 (a cut to 384 would leave 112 ms steps), but prompts of 800 tokens: each
    takes two steps over the SLO at 512 and would take one at 1024, so the budget doubles. It
    cannot restore ITL alone (the step that carries the prompt is still over), so replicas are
    added beside it, and the batch holds."""
    decision = itl_over_with_prompt_chunks(512, prompt_tokens=800)
    reasons = " ".join(decision.reasons)
    assert decision.changed("colocated", TOKEN_BUDGET).new == 1024
    assert "a mean prompt (800 tokens) spans more than one step at 512" in reasons
    assert "larger chunks put prompts over fewer gaps" in reasons
    assert decision.changed("colocated", MAX_BATCH) is None
    assert "maxNumBatchedTokens grows to put each prompt over fewer of them" in reasons
    assert decision.changed("colocated", REPLICAS).new > 1
    assert "SLO violated with maxNumBatchedTokens short of the excess" in reasons


@pytest.mark.parametrize(("budget", "prompt_tokens", "new"), [(512, 800, 1024), (256, 400, None)])
def test_a_queue_blocks_only_the_budget_cuts_that_would_help_itl(budget, prompt_tokens, new) -> None:
    """TTFT over its SLO with 3 waiting as well (a cold start's queue). Where a cut would help ITL
    (256 -> 192: 74 ms steps), it would move the excess onto TTFT, so the budget holds. Where no
    cut would (512 -> 384: 112 ms steps) and prompts span two steps, the budget doubles as without
    a queue: fewer, larger chunks serve both the queue and ITL."""
    decision = itl_over_with_prompt_chunks(budget, prompt_tokens, ttft_ms=2000, waiting=3)
    reasons = " ".join(decision.reasons)
    if new is None:
        assert decision.changed("colocated", TOKEN_BUDGET) is None
        assert "a smaller budget would move the excess onto TTFT" in reasons
    else:
        assert decision.changed("colocated", TOKEN_BUDGET).new == new
        assert "larger chunks put prompts over fewer gaps" in reasons
    assert decision.changed("colocated", REPLICAS).new > 1


@pytest.mark.parametrize(("p95", "grows"), [(900, True), (480, False)])
def test_the_longer_prompts_decide_whether_the_budget_grows(p95: float, grows: bool) -> None:
    """The hold case above (prompts of 400 tokens on average at 512), where the prompt-length
    histogram says the longer ones take two steps: a p95 of 900 tokens doubles the budget, one
    of 480 fits a step and the budget holds."""
    decision = itl_over_with_prompt_chunks(512, prompt_tokens=400, prompt_p95=p95)
    budget = decision.changed("colocated", TOKEN_BUDGET)
    if grows:
        assert budget.new == 1024
        assert "a p95 prompt (900 tokens) spans more than one step at 512" in " ".join(decision.reasons)
    else:
        assert budget is None
    assert decision.changed("colocated", REPLICAS).new > 1
