"""The control law, one run at a time: tables of scenarios and the change (or hold) each must give."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from llmfleet.operator.tuner.law import MAX_BATCH, REPLICAS, TIMEOUT, TOKEN_BUDGET, PoolInput, Tuner, TunerConfig
from llmfleet.operator.tuner.memory import TunerMemory
from tests.operator.tuner.scenarios import ONE_SHOT, SLO, limits, metrics, pool_input, settings


@dataclass
class Case:
    name: str
    pools: dict[str, PoolInput]
    expect: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)  # (pool, knob): (old, new)
    unchanged: list[tuple[str, str]] = field(default_factory=list)
    says: list[str] = field(default_factory=list)  # substrings the reasons must contain


def colocated(**kw) -> dict[str, PoolInput]:
    current = kw.pop("current", None)
    lim = kw.pop("lim", None)
    return {"colocated": pool_input(metrics("colocated", **kw), current, lim)}


# prompts of 60 tokens queue (400 of 600 ms TTFT) with the window at 0 and the batch far from its cap
QUEUED_SHORT_PROMPTS = dict(
    ttft_ms=600, queue_ms=400, itl_ms=40, rate=4, prompt_tps=240, gen_tps=80, mean_batch=2, step_tokens=20
)
# a queue that kept 100-token prompts waiting for longer than the TTFT SLO
BACKLOG = dict(ttft_ms=4000, queue_ms=3800, itl_ms=40, rate=4, prompt_tps=400, gen_tps=80, mean_batch=4, step_tokens=60)
# 4000-token prompts, one per 20 s, each waiting 3.5-7 s behind the one before: a live queue
# that holds about 0.1 requests on average
FEW_LONG_PROMPTS = dict(
    ttft_ms=14000, queue_ms=7000, itl_ms=40, rate=0.05, prompt_tps=200, gen_tps=2, mean_batch=1, step_tokens=256
)

CASES = [
    Case(
        "ITL over SLO lowers the batch (x0.75)",
        colocated(itl_ms=142, mean_batch=32, step_tokens=40, prompt_tps=400, gen_tps=80),
        expect={("colocated", MAX_BATCH): (32, 24)},
        unchanged=[("colocated", TIMEOUT), ("colocated", TOKEN_BUDGET), ("colocated", REPLICAS)],
        says=["colocated: ITL p95 142 ms > SLO 100 ms -> maxBatchSize 32 -> 24 (x0.75)"],
    ),
    Case(
        "ITL over SLO decreases from the batch that actually ran",
        colocated(itl_ms=130, mean_batch=11.3, step_tokens=20),
        expect={("colocated", MAX_BATCH): (32, 9)},
        says=["x0.75 of the observed batch 12"],
    ),
    Case(
        "ITL over SLO at maxReplicas, where the cut batch's slots on every pod allowed are fewer than "
        "the requests running: it holds (cut 6 -> 2 on 10 pods, 1 request/s of creative queued for the "
        "rest of the run, TTFT p95 10-25 s)",
        colocated(
            itl_ms=116,
            mean_batch=3,
            running=30,
            step_tokens=4,
            pods=10,
            current=settings(replicas=10, batch=6),
            lim=limits(max_replicas=10),
        ),
        unchanged=[("colocated", MAX_BATCH)],
        says=["2 slots on each of at most 10 pods (maxReplicas) are fewer than the 30 requests running"],
    ),
    Case(
        "the same where pods may still come: the cut, and demand at the new cap sizes the pool",
        colocated(
            itl_ms=116,
            mean_batch=3,
            running=30,
            step_tokens=4,
            pods=10,
            current=settings(replicas=10, batch=6),
            lim=limits(max_replicas=20),
        ),
        expect={("colocated", MAX_BATCH): (6, 2)},
    ),
    Case(
        "ITL under SLO with a queue raises the batch (+4)",
        colocated(itl_ms=50, ttft_ms=300, waiting=3, mean_batch=20),
        expect={("colocated", MAX_BATCH): (32, 36)},
        unchanged=[("colocated", TIMEOUT)],
        says=["ITL p95 50 ms < 0.8 x SLO 100 ms and 3.0 requests wait per pod -> maxBatchSize 32 -> 36 (+4)"],
    ),
    Case(
        "ITL under SLO with a full batch raises it",
        colocated(itl_ms=50, ttft_ms=300, mean_batch=31.5, prompt_tps=400, gen_tps=80),
        expect={("colocated", MAX_BATCH): (32, 36)},
        unchanged=[("colocated", REPLICAS)],
        says=["the batch is full (mean 31.5 of 32)"],
    ),
    Case(
        "ITL under SLO but the batch is not the limit: hold",
        colocated(itl_ms=50, ttft_ms=300, mean_batch=8, waiting=0),
        unchanged=[("colocated", MAX_BATCH)],
        says=["the batch is not the limit (mean batch 8.0 of 32, 0.0 waiting per pod)"],
    ),
    Case(
        "ITL under SLO but the KV cache is nearly full: hold",
        colocated(itl_ms=50, ttft_ms=300, waiting=3, kv_max=0.97),
        unchanged=[("colocated", MAX_BATCH)],
        says=["KV cache is under pressure (max usage 97%"],
    ),
    Case(
        "ITL inside the dead band: hold",
        colocated(itl_ms=90, ttft_ms=300),
        unchanged=[("colocated", MAX_BATCH)],
        says=["ITL p95 90 ms within 0.8-1x SLO 100 ms: maxBatchSize stays 32"],
    ),
    Case(
        "TTFT over SLO by less than the window: the window shrinks (x0.5), replicas wait",
        colocated(ttft_ms=510, queue_ms=100, itl_ms=90),
        expect={("colocated", TIMEOUT): (20, 10)},
        unchanged=[("colocated", MAX_BATCH), ("colocated", TOKEN_BUDGET), ("colocated", REPLICAS)],
        says=["colocated: TTFT p95 510 ms > SLO 500 ms -> batchTimeoutMs 20 -> 10 (x0.5)"],
    ),
    Case(
        "TTFT over SLO by more than the whole window: it shrinks, and a replica is added too",
        colocated(ttft_ms=800, queue_ms=100, itl_ms=90),
        expect={("colocated", TIMEOUT): (20, 10), ("colocated", REPLICAS): (1, 2)},
        unchanged=[("colocated", MAX_BATCH), ("colocated", TOKEN_BUDGET)],
        says=[
            "TTFT p95 800 ms > SLO 500 ms, more than the whole 20 ms window -> batchTimeoutMs 20 -> 10 (x0.5)",
            "SLO violated with batchTimeoutMs short of the excess -> one more replica",
        ],
    ),
    Case(
        "TTFT over SLO while the window shrinks to protect it: replicas hold, though demand asks fewer",
        colocated(ttft_ms=510, queue_ms=100, itl_ms=90, prompt_tps=400, gen_tps=40, current=settings(replicas=4)),
        expect={("colocated", TIMEOUT): (20, 10)},
        unchanged=[("colocated", REPLICAS)],
        says=["SLO violated (1.02x) while batchTimeoutMs moves to protect it: replicas hold"],
    ),
    Case(
        "a window under 1 ms snaps to its minimum",
        colocated(ttft_ms=800, queue_ms=100, current=settings(timeout=1.5)),
        expect={("colocated", TIMEOUT): (1.5, 0)},
    ),
    Case(
        "TTFT over SLO with the window at its minimum adds a replica",
        colocated(ttft_ms=800, queue_ms=400, current=settings(timeout=0)),
        expect={("colocated", REPLICAS): (1, 2)},
        unchanged=[("colocated", TIMEOUT)],
        says=["batchTimeoutMs at its minimum 0", "at its limit -> 2, where the owned latency projects within it"],
    ),
    Case(
        "TTFT over SLO in a window whose traffic has ended: no replica for an idle pool",
        colocated(
            ttft_ms=800,
            queue_ms=600,
            rate=0,
            prompt_tps=0,
            gen_tps=0,
            running=0,
            mean_batch=None,
            current=settings(timeout=0),
        ),
        unchanged=[("colocated", REPLICAS)],
        says=["over a window whose traffic has ended: no replica for that"],
    ),
    Case(
        "TTFT far over SLO, mostly queueing, with the window at its minimum: the replicas that project within it",
        # demand 0.75 on 1 pod; TTFT 1500 = 1300 queued + 200 prefill: at 2 pods (rho 0.375) the
        # wait shrinks by (0.375 / 0.625) / (0.75 / 0.25) = 0.2 -> 460 ms, within the 500 ms SLO.
        # A live queue: 2 requests/s waiting 0.65-1.3 s hold 0.9 (none waiting would be a drained one)
        colocated(ttft_ms=1500, queue_ms=1300, rate=2, waiting=0.9, current=settings(timeout=0)),
        expect={("colocated", REPLICAS): (1, 2)},
        says=["-> 2, where the owned latency projects within it"],
    ),
    Case(
        "TTFT over SLO and the pods busier: more than one replica at once",
        # demand 2.74 on 3 pods (2.7 served, 0.04 to drain its queue; rho 0.913): 2000 ms queued,
        # 100 ms prefill; 4 pods (rho 0.685) project 100 + 2000 x 2.17 / 10.5 = 514 ms, 5 pods
        # (rho 0.548) 100 + 2000 x 1.21 / 10.5 = 331 ms
        colocated(
            ttft_ms=2100,
            queue_ms=2000,
            rate=3,
            waiting=2.4,  # live: 1 request/s per pod waiting 1-2 s holds 0.5-1
            prompt_tps=5400,
            gen_tps=540,
            pods=3,
            current=settings(replicas=3, timeout=0),
        ),
        expect={("colocated", REPLICAS): (3, 5)},
        says=["-> 5, where the owned latency projects within it"],
    ),
    Case(
        "ITL over SLO at the minimum batch with no queue: more replicas would not help",
        colocated(
            itl_ms=150, mean_batch=1, step_tokens=1.2, waiting=0, prompt_tps=100, gen_tps=20, current=settings(batch=1)
        ),
        unchanged=[("colocated", MAX_BATCH), ("colocated", REPLICAS)],
        says=["more replicas would not lower it"],
    ),
    Case(
        "chat shape (short prompts, queueing is most of TTFT): a shorter window",
        colocated(ttft_ms=300, queue_ms=240, itl_ms=40, rate=5, prompt_tps=300, gen_tps=150, mean_batch=4),
        expect={("colocated", TIMEOUT): (20, 10)},
        unchanged=[("colocated", MAX_BATCH), ("colocated", TOKEN_BUDGET), ("colocated", REPLICAS)],
        says=["queue p95 240 ms is 80% of TTFT p95 300 ms"],
    ),
    Case(
        "long-prompt shape (prefill-bound TTFT, full batches): bigger batches, the window stays",
        colocated(
            ttft_ms=300,
            queue_ms=30,
            itl_ms=40,
            rate=10,
            prompt_tps=20000,
            gen_tps=200,
            mean_batch=31.5,
            pods=7,
            current=settings(replicas=7),
        ),
        expect={("colocated", MAX_BATCH): (32, 36)},
        unchanged=[("colocated", TIMEOUT)],
    ),
    Case(
        "long prompts with TTFT over SLO while prefill-bound: a bigger token budget",
        colocated(ttft_ms=900, queue_ms=50, itl_ms=40, rate=1, prompt_tps=2000, gen_tps=100, step_tokens=480),
        expect={("colocated", TOKEN_BUDGET): (512, 1024), ("colocated", TIMEOUT): (20, 10)},
        says=["and mean prompt 2000 tokens > budget 512 -> maxNumBatchedTokens 512 -> 1024"],
    ),
    Case(
        "prompts queue behind a budget too small for two of them: the budget grows, not the replicas",
        colocated(**QUEUED_SHORT_PROMPTS, current=settings(batch=8, timeout=0, budget=108)),
        expect={("colocated", TOKEN_BUDGET): (108, 216)},
        unchanged=[("colocated", REPLICAS)],
        says=["two mean prompts and a full batch (128 tokens) overflow the budget"],
    ),
    Case(
        "TTFT over SLO from a drained backlog (waits over the SLO, fewer waiting than they need): the budget holds",
        colocated(**BACKLOG, waiting=0, current=settings(batch=8, timeout=0, budget=64)),
        unchanged=[("colocated", TOKEN_BUDGET)],
        says=[
            "mean prompt 100 tokens > budget 64, but its requests queued for longer than the SLO "
            "(queue p95 3800 ms) while 0.00 waited per pod, where a live queue that slow holds at least 3.80: "
            "a backlog that has drained"
        ],
    ),
    Case(
        "the same backlog still waiting: the budget grows",
        colocated(**BACKLOG, waiting=6, current=settings(batch=8, timeout=0, budget=64)),
        expect={("colocated", TOKEN_BUDGET): (64, 128)},
        says=["mean prompt 100 tokens > budget 64 -> maxNumBatchedTokens 64 -> 128"],
    ),
    Case(
        "a few long prompts, each waiting longer than the SLO, hold few in the queue: no backlog, the budget grows",
        colocated(**FEW_LONG_PROMPTS, waiting=0.1, current=settings(batch=8, timeout=0, budget=256)),
        expect={("colocated", TOKEN_BUDGET): (256, 512)},
        says=["mean prompt 4000 tokens > budget 256 -> maxNumBatchedTokens 256 -> 512"],
    ),
    Case(
        "TTFT over SLO while the queue times are those of long answers finishing now (queue p95 far above "
        "the TTFT p95 every first token would carry it in): no backlog, the prompts' own excess, the budget grows",
        colocated(
            **(BACKLOG | {"ttft_ms": 600, "queue_ms": 180000}),
            waiting=0,
            current=settings(batch=8, timeout=0, budget=64),
        ),
        expect={("colocated", TOKEN_BUDGET): (64, 128)},
        says=["mean prompt 100 tokens > budget 64 -> maxNumBatchedTokens 64 -> 128"],
    ),
    Case(
        "ITL over from prefill-heavy steps at a cold start, TTFT not yet known but 6 waiting (1.5 s each by "
        "Little's law, over the SLO): a smaller budget would only queue more, it holds",
        colocated(itl_ms=130, ttft_ms=None, waiting=6, rate=4, mean_batch=12, step_tokens=400),
        unchanged=[("colocated", TOKEN_BUDGET), ("colocated", MAX_BATCH)],
        says=[
            "TTFT p95 is unknown with 6.0 requests waiting per pod, a mean wait of 1500 ms at 4.00 requests/s "
            "(Little's law) over its SLO: a smaller budget would move the excess onto TTFT"
        ],
    ),
    Case(
        "the same with one waiting (250 ms by Little's law, within the SLO): the budget shrinks",
        colocated(itl_ms=130, ttft_ms=None, waiting=1, rate=4, mean_batch=12, step_tokens=400),
        expect={("colocated", TOKEN_BUDGET): (512, 384)},
    ),
    Case(
        "prompts queue, but two of them fit the budget: it holds",
        colocated(**QUEUED_SHORT_PROMPTS, current=settings(batch=8, timeout=0, budget=256)),
        unchanged=[("colocated", TOKEN_BUDGET)],
        says=["but prompts fit the budget (mean prompt 60.0 tokens, queue p95 400.0 ms)"],
    ),
    Case(
        "ITL over SLO from prefill-heavy steps: the token budget shrinks, not the batch",
        colocated(itl_ms=130, mean_batch=12, step_tokens=400),
        expect={("colocated", TOKEN_BUDGET): (512, 384)},
        unchanged=[("colocated", MAX_BATCH)],
        says=["prefill-heavy steps (400 tokens per step for 12.0 sequences)", "maxNumBatchedTokens shrinks instead"],
    ),
    Case(
        "the same under a budget no step reaches (12 sequences beside a p95 prompt of 100 tokens, 112 "
        "tokens): it goes to that step, where x0.75 of 2048 would split no prompt and change no step",
        colocated(itl_ms=130, mean_batch=12, step_tokens=40, prompt_p95=100, current=settings(budget=2048)),
        expect={("colocated", TOKEN_BUDGET): (2048, 112)},
        unchanged=[("colocated", MAX_BATCH)],
        says=["maxNumBatchedTokens 2048 -> 112 (to the largest step run)"],
    ),
    Case(
        "and below it: x0.75 as before (the p95 prompt now splits)",
        colocated(itl_ms=130, mean_batch=12, step_tokens=40, prompt_p95=100, current=settings(budget=112)),
        expect={("colocated", TOKEN_BUDGET): (112, 84)},
        says=["maxNumBatchedTokens 112 -> 84 (x0.75)"],
    ),
    Case(
        "TTFT far under SLO and ITL to spare: the window grows (+5 ms)",
        colocated(ttft_ms=100, itl_ms=40),
        expect={("colocated", TIMEOUT): (20, 25)},
        says=["TTFT p95 100 ms + 5 ms < 0.5 x SLO 500 ms and ITL p95 40 ms < 0.8 x SLO 100 ms"],
    ),
    Case(
        "too few requests behind the ITL quantile: the batch holds, replicas still follow demand",
        {
            "colocated": pool_input(
                metrics(
                    itl_ms=None,
                    prompt_tps=8000,
                    pods=3,
                    missing={"itl": "itl: 3 observations in the 60 s window (< 20)"},
                ),
                settings(replicas=3),
            )
        },
        expect={("colocated", REPLICAS): (3, 4)},
        unchanged=[("colocated", MAX_BATCH)],
        says=["ITL p95 unknown (itl: 3 observations in the 60 s window (< 20))"],
    ),
    Case(
        "demand over capacity with headroom: more replicas",
        colocated(prompt_tps=5600, gen_tps=200, pods=2, current=settings(replicas=2)),
        expect={("colocated", REPLICAS): (2, 3)},
        says=["demand 1.90 replicas (prompt 5600 tok/s / 4000 per replica + generation 200 tok/s / 400 per replica)"],
    ),
    Case(
        "waiting requests count as demand to drain",
        # saturated: the first measurement replaces the default guess (1500 / 150 tok/s per replica)
        colocated(waiting=600, pods=2, current=settings(replicas=2)),
        expect={("colocated", REPLICAS): (2, 5)},
        says=["first measurement: replaces the default guess", "backlog 600 waiting drained in 60 s = 2.00"],
    ),
    Case(
        "demand beyond maxReplicas stops at maxReplicas",
        colocated(prompt_tps=5600, gen_tps=200, pods=2, current=settings(replicas=2), lim=limits(max_replicas=2)),
        unchanged=[("colocated", REPLICAS)],
        says=["within [1, 2] -> 2"],
    ),
    Case(
        "low demand scales down, not below minReplicas",
        colocated(
            prompt_tps=400, gen_tps=40, itl_ms=50, pods=4, current=settings(replicas=4), lim=limits(min_replicas=2)
        ),
        expect={("colocated", REPLICAS): (4, 2)},
    ),
    Case(
        "a knob outside the spec bounds is brought back (spec bounds win)",
        colocated(current=settings(batch=300), lim=limits(batch=(8, 256))),
        expect={("colocated", MAX_BATCH): (300, 256)},
        says=["maxBatchSize 300 is outside spec bounds.maxBatchSize [8, 256] -> 256 (spec bounds win)"],
    ),
    Case(
        "P:D ratio follows prompt vs generated token demand (prompt-heavy)",
        {
            "prefill": pool_input(metrics("prefill", ttft_ms=300, prompt_tps=16000, pods=4), settings(replicas=4)),
            "decode": pool_input(metrics("decode", gen_tps=400, pods=1), settings(replicas=1)),
        },
        expect={("prefill", REPLICAS): (4, 5), ("decode", REPLICAS): (1, 2)},
        says=["P:D demand 4.00:1.00 replica-equivalents", "-> 5:2 replicas"],
    ),
    Case(
        "P:D ratio follows prompt vs generated token demand (generation-heavy)",
        {
            "prefill": pool_input(metrics("prefill", ttft_ms=300, prompt_tps=4000, pods=1), settings(replicas=1)),
            "decode": pool_input(metrics("decode", gen_tps=1600, pods=4), settings(replicas=4)),
        },
        expect={("prefill", REPLICAS): (1, 2), ("decode", REPLICAS): (4, 5)},
        says=["P:D demand 1.00:4.00 replica-equivalents", "-> 2:5 replicas"],
    ),
    Case(
        "disaggregated: prefill owns TTFT (window), decode owns ITL (batch)",
        {
            "prefill": pool_input(metrics("prefill", ttft_ms=800, queue_ms=100, itl_ms=500, prompt_tps=100)),
            "decode": pool_input(metrics("decode", ttft_ms=5000, itl_ms=142, mean_batch=32, gen_tps=100)),
        },
        expect={("prefill", TIMEOUT): (20, 10), ("decode", MAX_BATCH): (32, 24)},
        unchanged=[("prefill", MAX_BATCH), ("decode", TIMEOUT)],
        says=[
            "prefill: TTFT held to 125 ms: the SLO 500 ms less the 4980 ms a decode server adds (its TTFT p95 "
            "5000 ms less 20 ms of waiting for a batch slot), at least 25% of the SLO"
        ],
    ),
    Case(
        "disaggregated: clients wait for the prefill and the decode server's first token, so prefill gets the rest",
        {
            "prefill": pool_input(metrics("prefill", ttft_ms=350, queue_ms=100, prompt_tps=100)),
            "decode": pool_input(metrics("decode", ttft_ms=250, queue_ms=None, gen_tps=100)),
        },
        expect={("prefill", TIMEOUT): (20, 10)},
        says=[
            "prefill: TTFT held to 250 ms: the SLO 500 ms less the 250 ms a decode server adds (its TTFT p95 250 ms)",
            "prefill: TTFT p95 350 ms > SLO 250 ms",
        ],
    ),
    Case(
        "disaggregated: a wait for a decode slot is not the prefill pool's to clear",
        {
            "prefill": pool_input(metrics("prefill", ttft_ms=150, queue_ms=20, prompt_tps=100)),
            "decode": pool_input(metrics("decode", ttft_ms=2500, queue_ms=2300, step_ms=100, gen_tps=100)),
        },
        unchanged=[("prefill", TIMEOUT), ("prefill", REPLICAS)],
        says=[
            "prefill: TTFT held to 200 ms: the SLO 500 ms less the 300 ms a decode server adds (its TTFT p95 "
            "2500 ms less 2200 ms of waiting for a batch slot)"
        ],
    ),
    Case(
        "disaggregated: a wait for a decode slot is the decode pool's, which adds a pod where ITL has no room",
        {
            "prefill": pool_input(metrics("prefill", ttft_ms=300, queue_ms=20, prompt_tps=100)),
            "decode": pool_input(
                metrics(
                    "decode", ttft_ms=700, queue_ms=600, step_ms=100, itl_ms=90, mean_batch=30, waiting=3, gen_tps=100
                )
            ),
        },
        expect={("decode", REPLICAS): (1, 2)},
        unchanged=[("decode", MAX_BATCH), ("prefill", REPLICAS)],
        says=[
            "decode: TTFT held to 350 ms: the SLO less the prefill pool's TTFT p50 150 ms",
            "decode: TTFT p95 700 ms > its share 350 ms, waiting for a batch slot (queue p95 600 ms), and ITL p95 "
            "90 ms within 0.8-1x SLO 100 ms: no room for more slots",
        ],
    ),
    Case(
        "disaggregated: a decode pool owns no TTFT where the prefill pool's leaves no room for a wait",
        {
            "prefill": pool_input(metrics("prefill", ttft_ms=800, queue_ms=100, prompt_tps=100)),
            "decode": pool_input(metrics("decode", ttft_ms=400, queue_ms=None, itl_ms=90, mean_batch=30, gen_tps=100)),
        },
        unchanged=[("decode", MAX_BATCH), ("decode", REPLICAS)],
        says=[
            "decode: owns no TTFT: the prefill pool's TTFT p50 400 ms leaves 100 ms of the SLO, no more than "
            "the 400 ms a decode server adds to every request"
        ],
    ),
    Case(
        "disaggregated: with the decode pool's TTFT unknown, prefill is held to the whole SLO",
        {
            "prefill": pool_input(metrics("prefill", ttft_ms=350, queue_ms=100, prompt_tps=100)),
            "decode": pool_input(metrics("decode", ttft_ms=None, gen_tps=100)),
        },
        unchanged=[("prefill", TIMEOUT), ("prefill", REPLICAS)],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_rule_table(case: Case) -> None:
    decision = Tuner(ONE_SHOT).decide(case.pools, SLO, TunerMemory(), now=1000.0)
    assert not decision.hold, decision.hold_reason
    got = {(c.pool, c.knob): (c.old, c.new) for c in decision.changes}
    text = "\n".join(decision.reasons)
    for key, move in case.expect.items():
        assert got.get(key) == move, f"{key}: expected {move}, got {got.get(key)}\n{text}"
    for key in case.unchanged:
        assert key not in got, f"{key} changed: {got[key]}\n{text}"
    for fragment in case.says:
        assert fragment in text, f"missing {fragment!r} in:\n{text}"
    for change in decision.changes:
        assert change.reason.startswith(f"{change.pool}: ") and any(ch.isdigit() for ch in change.reason)


def test_stale_metrics_hold_everything_and_say_why() -> None:
    pools = colocated(itl_ms=300, ttft_ms=2000, stale=True, reason="colocated: newest sample 95 s old (> 60 s)")
    decision = Tuner(ONE_SHOT).decide(pools, SLO, TunerMemory(), now=1000.0)
    assert decision.hold and not decision.changes
    assert "newest sample 95 s old" in decision.hold_reason
    assert decision.condition()["status"] == "False"
    assert decision.condition()["reason"] == "MetricsUnavailable"
    assert decision.last_decision_status()["reason"] == decision.hold_reason


def test_one_stale_pool_holds_the_other_too() -> None:
    pools = {
        "prefill": pool_input(metrics("prefill", stale=True, reason="prefill: 0 pods reporting (< 1)")),
        "decode": pool_input(metrics("decode", itl_ms=300, mean_batch=32)),
    }
    decision = Tuner(ONE_SHOT).decide(pools, SLO, TunerMemory(), now=1000.0)
    assert decision.hold and not decision.changes
    assert "prefill: 0 pods reporting" in decision.hold_reason


def test_bounds_are_enforced_even_while_holding() -> None:
    pools = colocated(stale=True, reason="x", current=settings(batch=2, replicas=12), lim=limits(batch=(8, 64)))
    decision = Tuner(ONE_SHOT).decide(pools, SLO, TunerMemory(), now=1000.0)
    assert decision.hold
    assert {(c.knob, c.old, c.new) for c in decision.changes} == {(MAX_BATCH, 2, 8), (REPLICAS, 12, 8)}
    assert decision.settings["colocated"].replicas == 8


def test_capacity_is_measured_when_saturated() -> None:
    decode = pool_input(metrics("decode", gen_tps=900, waiting=4, pods=2), settings(replicas=2))
    decision = Tuner(ONE_SHOT).decide({"decode": decode}, SLO, TunerMemory(), now=1000.0)
    capacity = decision.memory.capacity["decode"]
    # the first measurement replaces the default guess (400) outright
    assert capacity.generation_tps == pytest.approx(450) and capacity.measured
    assert any(
        "400 -> 450 generation tok/s (saturated: 2.0 waiting per pod (first measurement" in r for r in decision.reasons
    )
    # the same snapshot again is not a second observation
    again = Tuner(ONE_SHOT).decide({"decode": decode}, SLO, decision.memory, now=1030.0)
    assert again.memory.capacity["decode"].generation_tps == capacity.generation_tps
    # later measurements are smoothed (EWMA 0.3)
    slower = pool_input(metrics("decode", gen_tps=700, waiting=4, pods=2, at=1100.0), settings(replicas=2))
    later = Tuner(ONE_SHOT).decide({"decode": slower}, SLO, decision.memory, now=1100.0)
    assert later.memory.capacity["decode"].generation_tps == pytest.approx(0.7 * 450 + 0.3 * 350)


def test_outrunning_the_estimate_raises_it_at_once() -> None:
    prefill = pool_input(metrics("prefill", ttft_ms=300, prompt_tps=9000, pods=1))
    decision = Tuner(ONE_SHOT).decide({"prefill": prefill}, SLO, TunerMemory(), now=1000.0)
    assert decision.memory.capacity["prefill"].prompt_tps == 9000


def test_status_views() -> None:
    pools = colocated(itl_ms=142, mean_batch=32, step_tokens=40, prompt_tps=400, gen_tps=80)
    decision = Tuner(ONE_SHOT).decide(pools, SLO, None, now=0.0)
    status = decision.tuner_status()
    assert status["knobs"]["colocated"][MAX_BATCH] == 24 and status["replicas"]["colocated"] == 1
    last = decision.last_decision_status()
    assert last["time"] == "1970-01-01T00:00:00Z"
    assert last["changes"] == [
        {"pool": "colocated", "knob": MAX_BATCH, "from": 32, "to": 24, "reason": decision.changes[0].reason}
    ]
    assert last["inputs"]["colocated"]["itlP95Ms"] == 142.0
    assert decision.condition() == {
        "type": "TunerActive",
        "status": "True",
        "reason": "Adjusted",
        "message": decision.changes[0].reason,
    }


def test_unknown_pool_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown pools"):
        Tuner().decide({"router": pool_input(metrics())}, SLO, None, now=0.0)


def test_config_from_spec_autotune() -> None:
    from llmfleet.operator.resource.spec import Autotune

    config = TunerConfig.from_autotune(Autotune(scaleDownStabilizationSeconds=120, cooldownSeconds=45, headroom=0.3))
    assert config.scale_down_stabilization_s == 120 and config.flap_window_s == 120
    assert config.cooldown_s == 45 and config.headroom == 0.3
    assert config.knob_relax_stabilization_s == 45  # one cooldown, within the scale-down window


def test_limits_from_spec_pool() -> None:
    from llmfleet.operator.resource.spec import Pool
    from llmfleet.operator.tuner.law import PoolLimits, Range

    pool = Pool(minReplicas=1, maxReplicas=3, engine={"max_batch_size": 512}, bounds={"batchTimeoutMs": {"max": 40}})
    lim = PoolLimits.from_spec(pool)
    assert lim.knob(MAX_BATCH) == Range(1, 512)  # default range widened to the initial value
    assert lim.knob(TIMEOUT) == Range(0, 40)
    assert lim.knob(TOKEN_BUDGET).low >= 1
    assert (lim.min_replicas, lim.max_replicas) == (1, 3)


@pytest.mark.parametrize(
    ("knob", "bound", "expected"),
    [
        (MAX_BATCH, {"min": 300}, (300, 4096)),  # above the default range's top (256): up to the engine's
        (TOKEN_BUDGET, {"min": 32768}, (32768, 1 << 20)),
        (TIMEOUT, {"min": 150}, (150, 60_000)),
        (TOKEN_BUDGET, {"max": 32}, (1, 32)),  # below the default range's bottom (64): down to the engine's
        (MAX_BATCH, {"min": 10.2}, (11, 256)),  # whole numbers for an integer knob
    ],
)
def test_a_one_sided_bound_outside_the_default_range_still_leaves_a_range(knob, bound, expected) -> None:
    from llmfleet.operator.resource.spec import Pool
    from llmfleet.operator.tuner.law import PoolLimits, Range

    assert PoolLimits.from_spec(Pool(bounds={knob: bound})).knob(knob) == Range(*expected)


def test_a_tuned_pool_never_goes_below_one_replica() -> None:
    """minReplicas 0 with autotune on: a pool of no pods reports nothing, so it could never come back."""
    from llmfleet.operator.resource.spec import Pool
    from llmfleet.operator.tuner.law import PoolLimits

    lim = PoolLimits.from_spec(Pool(minReplicas=0, maxReplicas=4))
    idle = metrics(
        ttft_ms=None,
        itl_ms=None,
        queue_ms=None,
        rate=0.0,
        prompt_tps=0.0,
        gen_tps=0.0,
        running=0.0,
        kv_max=0.0,
        mean_batch=None,
        step_tokens=None,
    )
    decision = Tuner(ONE_SHOT).decide({"colocated": pool_input(idle, settings(replicas=1), lim)}, SLO, None, now=1000.0)
    assert decision.settings["colocated"].replicas == 1, decision.reasons
    # a pool already at zero holds (nothing reports), but is brought back to one
    empty = metrics(pods=0, stale=True, reason="colocated: 0 pods reporting")
    decision = Tuner(ONE_SHOT).decide(
        {"colocated": pool_input(empty, settings(replicas=0), lim)}, SLO, None, now=1000.0
    )
    assert decision.hold and decision.settings["colocated"].replicas == 1
    assert "minReplicas/maxReplicas (at least 1 while tuned) [1, 4] -> 1" in decision.reasons[0]


def test_scaling_limited_says_when_the_bounds_cut_the_count_the_slos_ask_for() -> None:
    """As HPA's ScalingLimited: TooManyReplicas where demand asks above maxReplicas,
    TooFewReplicas where it asks for fewer than minReplicas but some; False (DesiredWithinRange)
    otherwise, an idle pool at its minimum included; nothing on a hold, which judged nothing."""

    def condition(**kw):
        decision = Tuner(ONE_SHOT).decide(colocated(**kw), SLO, TunerMemory(), now=1000.0)
        return decision.scaling_condition(), decision

    busy = dict(prompt_tps=5600, gen_tps=200, pods=2, current=settings(replicas=2))
    many, decision = condition(**busy, lim=limits(max_replicas=2))
    assert (many["status"], many["reason"]) == ("True", "TooManyReplicas"), decision.reasons
    assert many["message"] == "colocated: 3 replicas wanted (demand), held at maxReplicas 2"
    within, _ = condition(**busy)
    assert (within["status"], within["reason"]) == ("False", "DesiredWithinRange")

    quiet = dict(prompt_tps=400, gen_tps=40, itl_ms=50, pods=4, current=settings(replicas=4))
    few, decision = condition(**quiet, lim=limits(min_replicas=4))
    assert (few["status"], few["reason"]) == ("True", "TooFewReplicas"), decision.reasons
    assert few["message"].startswith("colocated: 1 replica wanted (demand), held at minReplicas 4")
    idle, _ = condition(**(quiet | dict(prompt_tps=0, gen_tps=0, rate=0)), lim=limits(min_replicas=4))
    assert idle["status"] == "False"

    held, _ = condition(stale=True, reason="colocated: metrics stale")
    assert held is None
