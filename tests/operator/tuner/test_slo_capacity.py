"""Rules from the second round of the simulator's tuner evaluation (`llm-fleet bench tuner`):
a batch that grows when prompts wait for a slot (before any replica is added), capacity measured
only at knobs that held and will hold, the first measurement replacing the default guess, and a
scale-down only when the latency measured now projects under the SLO at the lower count."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest

from llmfleet.operator.tuner.law import MAX_BATCH, REPLICAS, TOKEN_BUDGET, Tuner
from llmfleet.operator.tuner.memory import Capacity, TunerMemory
from tests.operator.tuner.scenarios import ONE_SHOT, SLO, metrics, pool_input, settings

# SLO: TTFT p95 500 ms, ITL p95 100 ms. Slot-bound TTFT: queueing dominates, ITL has room, the
# steps do not fill the budget, and the mean batch is within 3 sd of the cap.
SLOT_BOUND = dict(ttft_ms=600, queue_ms=500, itl_ms=50, mean_batch=6, step_tokens=20, waiting=0.4)


@dataclass
class Case:
    name: str
    kw: dict
    current: dict = field(default_factory=dict)
    expect: dict[str, tuple[float, float]] = field(default_factory=dict)  # knob: (old, new)
    unchanged: list[str] = field(default_factory=list)
    says: list[str] = field(default_factory=list)


SLOT_CASES = [
    Case(
        "prompts waiting for a slot with ITL to spare: the batch grows at once, no replica",
        SLOT_BOUND,
        current=dict(batch=8, timeout=0),
        expect={MAX_BATCH: (8, 12)},
        unchanged=[REPLICAS],
        says=[
            "queue p95 500 ms is 83% of TTFT p95 600 ms",
            "mean batch 6.0 of 8 (+3 sd reaches it)",
            "prompts wait for a batch slot -> maxBatchSize 8 -> 12 (+4)",
        ],
    ),
    Case(
        "queue-bound below the SLO (>= 0.5 x SLO) already grows it",
        SLOT_BOUND | dict(ttft_ms=300, queue_ms=200),
        current=dict(batch=8),
        expect={MAX_BATCH: (8, 12)},
    ),
    Case(
        "a cap far above the mean batch is not what requests wait for",
        SLOT_BOUND | dict(mean_batch=1.0),
        current=dict(batch=8, timeout=0),
        unchanged=[MAX_BATCH],
        says=["SLO violated with batchTimeoutMs at its limit -> 2, where the owned latency projects within it"],
    ),
    Case(
        "no ITL to spend: the batch holds",
        SLOT_BOUND | dict(itl_ms=85),
        current=dict(batch=8),
        unchanged=[MAX_BATCH],
    ),
    Case(
        "steps that fill the budget: the budget, not the slots, holds prompts back",
        SLOT_BOUND | dict(step_tokens=500),
        current=dict(batch=8, budget=512),
        unchanged=[MAX_BATCH],
    ),
    Case(
        "the KV cache under pressure: no bigger batch",
        SLOT_BOUND | dict(kv_max=0.97),
        current=dict(batch=8),
        unchanged=[MAX_BATCH],
    ),
    Case(
        "TTFT mostly prefill, not queue: the batch holds",
        SLOT_BOUND | dict(queue_ms=100),
        current=dict(batch=8),
        unchanged=[MAX_BATCH],
    ),
]


@pytest.mark.parametrize("case", SLOT_CASES, ids=lambda c: c.name)
def test_slot_bound_ttft(case: Case) -> None:
    pools = {"colocated": pool_input(metrics(**case.kw), settings(**case.current))}
    decision = Tuner(ONE_SHOT).decide(pools, SLO, TunerMemory(), now=1000.0)
    text = "\n".join(decision.reasons)
    for knob, move in case.expect.items():
        change = decision.changed("colocated", knob)
        assert change is not None and (change.old, change.new) == move, text
    for knob in case.unchanged:
        assert decision.changed("colocated", knob) is None, text
    for phrase in case.says:
        assert phrase in text, text


def test_a_slot_bound_batch_rise_skips_the_relaxation_window() -> None:
    """Growing the batch for TTFT protects an SLO: it does not wait for the 60 s window that
    relaxing moves (a batch grown because it is full) wait for."""
    config = Tuner().config
    assert config.knob_relax_stabilization_s > 0
    pools = {"colocated": pool_input(metrics(**SLOT_BOUND), settings(batch=8))}
    decision = Tuner(config).decide(pools, SLO, TunerMemory(), now=1000.0)
    assert decision.changed("colocated", MAX_BATCH).new == 12


def test_the_slot_rule_is_colocated_only() -> None:
    decode = pool_input(metrics("decode", **SLOT_BOUND), settings(batch=8))
    decision = Tuner(ONE_SHOT).decide({"decode": decode}, SLO, TunerMemory(), now=1000.0)
    assert decision.changed("decode", MAX_BATCH) is None


# --- capacity at the knobs that hold ----------------------------------------------------------

SATURATED = dict(waiting=4, prompt_tps=600, gen_tps=120, itl_ms=90, ttft_ms=300, mean_batch=8)


def _memory_with_change(knob: str, at: float) -> TunerMemory:
    memory = TunerMemory()
    memory.key("colocated", knob).moved(at, 1)
    return memory


@pytest.mark.parametrize(
    ("memory", "current", "measured", "says"),
    [
        (TunerMemory(), settings(batch=8), True, "first measurement: replaces the default guess"),
        (
            _memory_with_change(MAX_BATCH, 980.0),
            settings(batch=8),
            False,
            "not the pool's capacity: maxBatchSize changed 20 s ago (< the 60 s window)",
        ),
        (
            _memory_with_change(TOKEN_BUDGET, 990.0),
            settings(batch=8),
            False,
            "not the pool's capacity: maxNumBatchedTokens changed 10 s ago",
        ),
        (_memory_with_change(MAX_BATCH, 900.0), settings(batch=8), True, "first measurement"),
        # a full batch with ITL to spare and a queue: the batch rises this run
        (TunerMemory(), settings(batch=8), False, "maxBatchSize rises this run (8 -> 12)"),
    ],
    ids=["steady knobs", "batch just changed", "budget just changed", "changed a window ago", "batch rising"],
)
def test_saturation_measures_capacity_only_at_knobs_that_hold(memory, current, measured, says) -> None:
    kw = dict(SATURATED)
    if "rises" in says:
        kw |= dict(itl_ms=50)  # ITL < 0.8 x SLO with a queue: the batch grows
    pools = {"colocated": pool_input(metrics(**kw), current)}
    decision = Tuner(ONE_SHOT).decide(pools, SLO, memory, now=1000.0)
    capacity = decision.memory.capacity["colocated"]
    assert capacity.measured is measured
    if measured:  # 600 / 4000 + 120 / 400 = 0.45 replicas busy -> the guess x 0.45
        assert capacity.prompt_tps == pytest.approx(1800) and capacity.generation_tps == pytest.approx(180)
    else:  # the throughput is below the guess: a lower bound that changes nothing
        assert (capacity.prompt_tps, capacity.generation_tps) == (4000, 400)
    assert any(says in r for r in decision.reasons), decision.reasons


def test_a_broken_slo_also_counts_as_a_measurement() -> None:
    pools = {"colocated": pool_input(metrics(ttft_ms=800, queue_ms=600, mean_batch=2), settings(timeout=0))}
    decision = Tuner(ONE_SHOT).decide(pools, SLO, TunerMemory(), now=1000.0)
    assert decision.memory.capacity["colocated"].measured


# --- scale-down projected at the lower count --------------------------------------------------


MEAN_LOAD = replace(ONE_SHOT, surge_sd=0.0)  # projected at the mean load, not a busy window's


def _measured(prompt: float, generation: float) -> TunerMemory:
    memory = TunerMemory()
    memory.capacity["colocated"] = Capacity(
        prompt_tps=prompt, generation_tps=generation, measured=True, observations=1, pods=3, pods_since=0.0
    )
    return memory


@pytest.mark.parametrize(
    ("ttft_ms", "itl_ms", "expect", "says"),
    [
        # demand 0.6 on 3 replicas (rho 0.2). TTFT is 10 ms queued + the rest prefill; the wait
        # grows by rho / (1 - rho): x6 at 1 pod (rho 0.6), x1.71 at 2 (rho 0.3).
        # TTFT 150 ms: 140 + 60 = 200 ms at 1 pod: down to 1
        (150, 20, 1, ""),
        # TTFT 350 ms: 340 + 60 = 400 ms at 1 pod, within 0.95x the 500 ms SLO: down to 1
        (350, 20, 1, ""),
        # TTFT 450 ms: 500 ms at 1 pod (1.00x > 0.95), 457 ms at 2 (0.91x): down to 2 only
        (450, 20, 2, "at 1 the owned latency is projected at 1.00x its SLO (M/M/1; now 0.90x, utilization 0.20"),
        # ITL is owned too: 0.8x now, 1.6x at 1 pod, 0.91x at 2
        (100, 80, 2, "at 1 the owned latency is projected at 1.60x"),
    ],
)
def test_scale_down_only_where_the_latency_projects_under_the_slo(ttft_ms, itl_ms, expect, says) -> None:
    pods = 3
    m = metrics(
        ttft_ms=ttft_ms, queue_ms=10, itl_ms=itl_ms, prompt_tps=600, gen_tps=0.0, pods=pods, mean_batch=2, waiting=0
    )
    pools = {"colocated": pool_input(m, settings(replicas=pods, timeout=0))}
    decision = Tuner(MEAN_LOAD).decide(pools, SLO, _measured(1000.0, 100.0), now=1000.0)
    change = decision.changed("colocated", REPLICAS)
    got = pods if change is None else change.new
    assert got == expect, decision.reasons
    assert says in "\n".join(decision.reasons)


def test_a_ttft_without_its_queue_time_is_projected_as_all_wait() -> None:
    """TTFT 350 ms, queue time unknown: x6 at 1 pod, x1.71 (600 ms) at 2: the three pods stay."""
    m = metrics(ttft_ms=350, queue_ms=None, itl_ms=20, prompt_tps=600, gen_tps=0.0, pods=3, mean_batch=2, waiting=0)
    pools = {"colocated": pool_input(m, settings(replicas=3, timeout=0))}
    decision = Tuner(MEAN_LOAD).decide(pools, SLO, _measured(1000.0, 100.0), now=1000.0)
    assert decision.changed("colocated", REPLICAS) is None, decision.reasons
    assert "at 1 the owned latency is projected at 4.20x its SLO" in "\n".join(decision.reasons)


def test_the_projection_waits_for_the_pods_it_counts() -> None:
    """Pods still starting (3 wanted, 2 ready): the latency measured is not that of the count."""
    m = metrics(ttft_ms=450, queue_ms=10, itl_ms=20, prompt_tps=200, gen_tps=0.0, pods=2, mean_batch=2)
    pools = {"colocated": pool_input(m, settings(replicas=3, timeout=20))}
    decision = Tuner(ONE_SHOT).decide(pools, SLO, _measured(1000.0, 100.0), now=1000.0)
    assert decision.changed("colocated", REPLICAS).new == 1
    assert not any("projected" in r for r in decision.reasons)


def test_an_slo_broken_while_pods_start_holds_the_count() -> None:
    """ITL over its SLO with the batch and the budget at their minimums, a queue, 2 of 5 pods ready
    and little throughput: the pods starting are what the SLO waits for, so the count neither
    grows nor falls to the demand (a fall would be reversed as soon as they showed)."""
    m = metrics(ttft_ms=300, itl_ms=300, prompt_tps=50, gen_tps=20, waiting=6, pods=2, mean_batch=1)
    pools = {"colocated": pool_input(m, settings(replicas=5, batch=1, timeout=0, budget=64))}
    decision = Tuner(ONE_SHOT).decide(pools, SLO, TunerMemory(), now=1000.0)
    assert decision.changed("colocated", REPLICAS) is None, decision.reasons
    assert "but 2 of 5 pods ready: waiting for them" in "\n".join(decision.reasons)
