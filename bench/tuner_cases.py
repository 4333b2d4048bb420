"""The tuner bench's workloads: each one InferenceService spec (SLOs, initial knobs, bounds,
autotune timing) and one trace, drawn per seed.

SLOs and rates are set for the reference profile (builtin:small, float32, 2 CPU cores: a decode
step of 16 sequences at a 300-token context takes about 190 ms, a pod prefills about 550 prompt
tokens/s): each is reachable at the workload's rate with 3 to 10 pods of the best fixed
configuration. Four kinds of trace:

- the built-in shapes (chat, long-prompt, creative: Poisson arrivals) and bursty (rate steps and a
  spike the trace gives no warning of), colocated; chat and long-prompt also disaggregated;
- ``diurnal``: a synthetic day's rise, plateau and fall, compressed into 18 minutes;
- ``daily-steps``: a day compressed into 20 minutes, four times over, with a step at the same
  minute each day: the forecast's season (``seasonSeconds`` 1200) learns it;
- ``azure-conv``: 35 minutes of the public Azure LLM inference trace (2023, conversations;
  bench/traces/README.md), thinned per seed so builtin:small needs 3-10 pods.

And, run on request (``--workloads working-days,working-days-no-season --tuner-only``), four
whole days with a step at 09:00 each, the tuner with its season at the default day and without:
the season at its own scale, where the compressed day's bins are a tuner run or two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmfleet.workloads import RequestSpec

TRACE = Path(__file__).parent / "traces" / "azure-conv-2023-window.csv"
INITIAL_ENGINE = {"maxBatchSize": 8, "maxNumBatchedTokens": 256, "batchTimeoutMs": 20}
BOUNDS = {
    "maxBatchSize": {"min": 2, "max": 64},
    "maxNumBatchedTokens": {"min": 64, "max": 4096},
    "batchTimeoutMs": {"min": 0, "max": 100},
}
AUTOTUNE = {"intervalSeconds": 10, "scaleDownStabilizationSeconds": 120, "cooldownSeconds": 30, "headroom": 0.2}
# The batching window stays at 0 in the grid, which halves the bench's time: with 0 or 20 ms, the
# best fixed configuration ran 0 ms on three of the four colocated workloads (creative: 20 ms).
# Budgets up to the bounds' 4096, where the tuner may take a pool (as in PAIR_KNOBS): a fixed
# fleet at the bound served azure-conv's default draw with 5 pods where 2048 needed 6.
GRID = {"maxBatchSize": (8, 16, 32), "maxNumBatchedTokens": (64, 256, 2048, 4096), "batchTimeoutMs": (0,)}
LONG_GRID = {"maxBatchSize": (8, 16, 32), "maxNumBatchedTokens": (256, 2048, 4096), "batchTimeoutMs": (0,)}
QUICK_GRID = {"maxBatchSize": (8, 32), "maxNumBatchedTokens": (256, 2048), "batchTimeoutMs": (20,)}
DAY_S, DAYS = 1200.0, 4  # daily-steps: a day compressed into 20 minutes, and how many of them
WORKING_DAYS = 4  # working-days: whole days, each with a step at 09:00
STEP_RISE = 1.5  # a phase whose rate is this much above the one before is a step the trace gives no warning of


@dataclass(frozen=True)
class Case:
    workload: str  # the bench's name for it
    ttft_ms: float
    itl_ms: float
    source: str = ""  # built-in workload name (default: workload), "diurnal" or "trace"
    rate_scale: float = 1.0
    duration_s: float | None = 900.0  # None: the workload's own length
    warmup_s: float = 300.0  # served first, not counted (the fleet has been running)
    mode: str = "colocated"
    max_replicas: int = 8
    initial_replicas: int = 1  # the tuner's and the HPA's pool at the start (a fixed fleet is its own)
    router_policy: str = "load"  # spec.router.policy: how the simulated router picks pods
    grid: dict[str, tuple[float, ...]] = field(default_factory=lambda: GRID)
    pairs: tuple[tuple[int, int], ...] = ()  # disaggregated: the fixed (prefill, decode) grid
    # disaggregated: per pool, the knob values the fixed pairs also run at (every combination)
    pair_knobs: dict[str, dict[str, tuple[float, ...]]] = field(default_factory=dict)
    ramp: bool = False  # judged on prediction: the tuner against its reactive law alone
    thin: float = 1.0  # trace: the share of the shipped window's requests kept
    trace: Path | None = None  # trace: the request log (default: the shipped Azure window)
    trace_start_s: float = 0.0  # trace: replayed from this many seconds in
    trace_match: tuple[tuple[str, str], ...] = ()  # trace: only the rows whose fields hold these values
    max_prompt_tokens: int = 2048  # trace: builtin:small's context is 4096
    max_output_tokens: int = 512
    autotune_overrides: dict[str, Any] = field(default_factory=dict)  # over AUTOTUNE
    tuner_only: bool = False  # days long: the tuner's runs alone (--tuner-only), no fixed grid or HPA
    expect: dict[str, int] = field(default_factory=dict)  # knob -> +1 (up) or -1 (down), net over the run
    why: str = ""

    @property
    def autotune(self) -> dict[str, Any]:
        """The spec's autotune block (timing, headroom) for this case."""
        return AUTOTUNE | self.autotune_overrides


PAIRS = tuple((p, d) for p in (1, 2, 3, 4) for d in (1, 2, 3, 4, 5))
# The knobs each disaggregated pool's tuner moves most, so that the cheapest fixed pair is one an
# engineer would set by hand: the prefill pool's token budget and the decode pool's batch cap.
PAIR_KNOBS = {"prefill": {"maxNumBatchedTokens": (256, 2048, 4096)}, "decode": {"maxBatchSize": (8, 16, 32)}}
CASES = (
    Case("bursty", 3000, 300, rate_scale=0.5, duration_s=None, why="anyscale-online lengths, rate steps and a spike"),
    Case(
        "chat",
        400,
        200,
        rate_scale=2.0,
        expect={"batchTimeoutMs": -1},
        why="short prompts and answers: TTFT-sensitive, the batching window should shrink",
    ),
    Case(
        "long-prompt",
        6000,
        1000,  # a decode step at a 1300-token context reads KV for ~30 ms per sequence
        expect={"maxNumBatchedTokens": +1},
        why="768-1536-token prompts: prefill-bound, the token budget should grow",
    ),
    Case(
        "creative",
        2000,
        250,
        rate_scale=2.0,
        expect={"maxBatchSize": +1},
        why="long outputs: decode-bound, batches should grow while ITL allows",
    ),
    Case(
        "chat-disagg",
        600,
        150,
        source="chat",
        rate_scale=2.0,
        mode="disaggregated",
        max_replicas=6,
        pairs=PAIRS,
        pair_knobs=PAIR_KNOBS,
        why="chat on separate prefill and decode pools: the P:D ratio against a grid of fixed pairs",
    ),
    Case(
        "long-prompt-disagg",
        8000,
        300,
        source="long-prompt",
        mode="disaggregated",
        max_replicas=6,
        pairs=PAIRS,
        pair_knobs=PAIR_KNOBS,
        why="long prompts on separate pools: prefill-heavy, the P:D ratio against a grid of fixed pairs",
    ),
    Case(
        "diurnal",
        3000,
        300,
        source="diurnal",
        duration_s=1080.0,
        grid=LONG_GRID,
        ramp=True,
        why="a day's rise (0.4 -> 1.6 req/s over 10 min), plateau and fall, anyscale-online lengths",
    ),
    Case(
        "daily-steps",
        3000,
        300,
        source="daily-steps",
        duration_s=None,
        grid=LONG_GRID,
        ramp=True,
        autotune_overrides={"seasonSeconds": int(DAY_S)},
        why="a compressed day, four times: a step at the same minute each day, which the season learns",
    ),
    Case(
        "azure-conv",
        6000,
        400,
        source="trace",
        duration_s=1800.0,
        max_replicas=12,
        grid=LONG_GRID,
        ramp=True,
        thin=1 / 3,
        why="the Azure LLM inference trace (conversations, 2023): its rise and fall, real lengths",
    ),
)

# Whole days, run on request with --tuner-only (5-6 minutes a run here): the season at a day's
# own scale (5-minute bins), against the same tuner without it.
SEASON_CASES = (
    Case(
        "working-days",
        3000,
        300,
        source="working-days",
        duration_s=None,
        ramp=True,
        tuner_only=True,
        why="four days at 0.4 req/s, a step to 1.2 at 09:00 for two hours each day; the season at a day",
    ),
    Case(
        "working-days-no-season",
        3000,
        300,
        source="working-days",
        duration_s=None,
        tuner_only=True,
        autotune_overrides={"seasonSeconds": 0},
        why="working-days without the season: Holt's trend alone ahead of the step",
    ),
)


def spec_for(
    case: Case,
    engine: dict[str, Any] | None = None,
    replicas: int | tuple[int, int] | None = None,
    *,
    autotune: bool = True,
    predictive: bool = True,
    pool_knobs: dict[str, dict[str, float]] | None = None,
):
    """The case's InferenceService; ``replicas`` fixes the pool (colocated) or the (prefill,
    decode) pair (disaggregated), for runs without a controller; ``pool_knobs`` sets knobs of
    single pools over ``engine``."""
    from llmfleet.operator.resource.spec import parse_spec

    def pool(name: str, fixed: int | None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "minReplicas": 1,
            "maxReplicas": case.max_replicas,
            "replicas": case.initial_replicas,
            "engine": (engine or INITIAL_ENGINE) | (pool_knobs or {}).get(name, {}),
            "bounds": BOUNDS,
        }
        if fixed is not None:
            out |= {"replicas": fixed, "minReplicas": fixed, "maxReplicas": fixed}
        return out

    if case.mode == "disaggregated":
        p, d = replicas if isinstance(replicas, tuple) else (None, None)
        pools = {"prefill": pool("prefill", p), "decode": pool("decode", d)}
    else:
        pools = {"colocated": pool("colocated", replicas if isinstance(replicas, int) else None)}
    return parse_spec(
        {
            "model": {"builtin": "small"},
            "mode": case.mode,
            "slo": {"ttftP95Ms": case.ttft_ms, "itlP95Ms": case.itl_ms},
            "pools": pools,
            "router": {"policy": case.router_policy},
            "autotune": case.autotune | {"enabled": autotune, "predictive": predictive},
        }
    )


@dataclass(frozen=True)
class Drawn:
    """One draw of a case's trace: the requests (warm-up first), from when they count, what the
    trace is, and the times of its unannounced steps (measured from the start of the requests)."""

    requests: list[RequestSpec]
    warmup_s: float
    description: str
    steps: tuple[float, ...] = ()


def draw(case: Case, seed: int | None, quick: bool = False) -> Drawn:
    from llmfleet.sim.trace import TraceOptions, builtin_workload, describe, read_trace, with_warmup
    from llmfleet.workloads import PhasedWorkload

    duration = case.duration_s
    if quick and duration is not None:
        duration = min(duration, 300.0)
    warmup = min(case.warmup_s, 120.0) if quick else case.warmup_s
    if case.source == "trace":
        if quick and duration is None:
            duration = 300.0
        path = case.trace or TRACE
        cut = TraceOptions(
            start_s=case.trace_start_s,
            duration_s=None if duration is None else warmup + duration,
            thin=case.thin,
            max_prompt_tokens=case.max_prompt_tokens,
            max_output_tokens=case.max_output_tokens,
            seed=seed or 0,
            match=case.trace_match,
        )
        requests = read_trace(path, cut)
        return Drawn(requests, warmup, f"{path.name}: {len(requests)} requests, {cut.describe()}")
    if case.source == "diurnal":
        workload = diurnal(seed)
        warm = with_warmup(workload, warmup)
        what = "diurnal: 0.4 -> 1.6 req/s over 10 min (half a cosine), 3 min there, 5 min back; anyscale-online lengths"
        return Drawn(warm, warmup, what)
    if case.source == "daily-steps":
        workload = daily_steps(seed, 2 if quick else DAYS)
    elif case.source == "working-days":
        workload = working_days(seed, 1 if quick else WORKING_DAYS)
    else:
        workload = builtin_workload(case.source or case.workload, duration, case.rate_scale, seed=seed)
    steps: tuple[float, ...] = ()
    if isinstance(workload, PhasedWorkload):
        start, before, found = warmup, workload.phases[0][1], []
        for seconds, rate in workload.phases:
            if rate >= STEP_RISE * before:
                found.append(start)
            start, before = start + seconds, rate
        steps = tuple(found)
    return Drawn(with_warmup(workload, warmup), warmup, describe(workload), steps)


def daily_steps(seed: int | None, days: int = DAYS):
    """A day compressed into ``DAY_S``, ``days`` times over: 0.5 req/s, a step to 1.5 for 6
    minutes at minute 8, back to 0.5; anyscale-online lengths. The step gives no warning the first
    time, and comes at the same time every day: a load the season learns (``seasonSeconds``)."""
    day = ((480.0, 0.5), (360.0, 1.5), (DAY_S - 840.0, 0.5))
    return _anyscale_phases("daily-steps", day * days, 7 if seed is None else seed)


def working_days(seed: int | None, days: int = WORKING_DAYS):
    """Whole days, ``days`` of them: 0.4 req/s, a step to 1.2 at 09:00 for two hours, back to 0.4;
    anyscale-online lengths. A team's working hours in one time zone, a morning batch job: a step
    the trend cannot see coming, at the same time every day (the default season is a day)."""
    hour = 3600.0
    day = ((9 * hour, 0.4), (2 * hour, 1.2), (13 * hour, 0.4))
    return _anyscale_phases("working-days", day * days, 7 if seed is None else seed)


def diurnal(seed: int | None):
    """Half a cosine up from 0.4 to 1.6 req/s over 10 minutes, 3 minutes there, 5 back down, in
    30 s phases: a day's ramp, compressed, with no step."""
    low, high, phase = 0.4, 1.6, 30.0

    def level(x: float) -> float:
        return low + (high - low) * (1 - math.cos(math.pi * x)) / 2

    rise = [level((i + 0.5) / 20) for i in range(20)]
    fall = [level(1 - (i + 0.5) / 10) for i in range(10)]
    rates = rise + [high] * 6 + fall
    return _anyscale_phases("diurnal", tuple((phase, round(r, 3)) for r in rates), 6 if seed is None else seed)


def _anyscale_phases(name: str, phases: tuple[tuple[float, float], ...], seed: int):
    """Poisson arrivals through ``phases`` with bursty's anyscale-online lengths."""
    from dataclasses import replace

    from llmfleet.workloads import BURSTY

    return replace(BURSTY, name=name, phases=phases, seed=seed, description="")
