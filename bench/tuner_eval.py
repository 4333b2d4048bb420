"""tuner: the closed loop against fixed configurations, a queue-length HPA and an oracle, in the
simulator.

For each workload (tuner_cases.py: the built-in shapes, bursty, two disaggregated ones, a diurnal
ramp and a window of the Azure LLM inference trace; or, with ``--trace``, a request log of your
own, cut as ``llm-fleet sim`` cuts it and judged on the SLOs given), one InferenceService spec
runs in the simulator (``llmfleet.sim``: every pod the real scheduler and engine loop with the
calibrated cost model, pods start ``--startup-s`` after a scale-up and drain on scale-down) under:

- **tuner**: the real tuner (operator/tuner/law.py through operator/tuner/run.py), moving knobs
  and replicas; on ramps also with its reactive law alone (``autotune.predictive: false``);
- **fixed**: a grid of fixed configurations (colocated: knob sets x replicas, per knob set the
  counts up to the fewest that meet the SLOs; disaggregated: (prefill, decode) pairs at each
  combination of the prefill pool's token budget and the decode pool's batch cap, per prefill
  count the decode counts up to the fewest that meet the SLOs);
- **hpa**: a HorizontalPodAutoscaler on ``vllm:num_requests_waiting`` for targets from 0.05 to 5
  waiting per pod, with the initial knobs (an HPA does not tune them);
- **oracle**: a lower bound, from the fixed runs: per minute the fewest replicas that met it,
  pods paid from a start-up before their minute (tuner_scores.py).

Targets (tuner_scores.py scores them): the tuner meets the p95 TTFT and ITL SLOs in >= 99% of
minutes, leaving out minutes within pod start-up and one interval of a step the trace gives no
warning of (reported apart), and never fewer minutes than the best HPA target; spends <= 1.1x
the replica-minutes of the cheapest fixed configuration that reaches its minutes met and <= 1.0x
the cheapest HPA target that does; changes a quantity's direction at most once per
stabilization window, and after load falls holds no more than its own demand estimate asked
for within the window plus two intervals; on disaggregated workloads its time-averaged
(prefill, decode) is within one replica of the cheapest fixed pair meeting the SLOs; on ramps,
prediction cuts missed minutes against the reactive law at <= 5% more replica-minutes.

The cost model is a reference profile kept in the repository (``bench/profiles/``: builtin:small
calibrated by ``llm-fleet calibrate`` on a 2-core AVX2 CPU in float32), so the SLOs and rates mean
the same on any machine; ``--profile`` runs another one, whose SLOs may then need other values.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

from llmfleet.arguments import non_negative, positive, positive_int
from llmfleet.bench.arguments import seeds
from llmfleet.bench.tuner_cases import (
    AUTOTUNE,
    BOUNDS,
    CASES,
    INITIAL_ENGINE,
    LONG_GRID,
    QUICK_GRID,
    SEASON_CASES,
    Case,
    Drawn,
    draw,
    spec_for,
)
from llmfleet.bench.tuner_scores import cheapest_reaching, judged_minutes, oracle, reaches, scale_down_lag
from llmfleet.server.router.policies import POLICIES as ROUTER_POLICIES
from llmfleet.sim.cli import add_trace_arguments

ATTAINMENT_TARGET = 0.99
FIXED_RATIO_TARGET = 1.1
HPA_RATIO_TARGET = 1.0
PREDICTION_EXTRA_TARGET = 0.05
REFERENCE_PROFILE = Path(__file__).parent / "profiles" / "builtin-small-cpu-fp32.json"
KNOB_NAMES = {"maxBatchSize": "batch", "maxNumBatchedTokens": "budget", "batchTimeoutMs": "window"}
# Waiting requests per pod, a 1-2-5 series. The low end matters: a pool of the right size averages
# a small fraction of a request waiting per pod, and with nothing waiting the HPA wants no pods.
HPA_TARGETS = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
QUICK_HPA_TARGETS = (0.1, 0.5, 2.0)


def add_arguments(parser) -> None:
    """Options of `llm-fleet bench tuner` (bench/cli.py adds them)."""
    names = ",".join(c.workload for c in CASES)
    days = ",".join(c.workload for c in SEASON_CASES)
    parser.add_argument(
        "--workloads",
        help=f"tuner: comma-separated subset of {names}; or of {days} (whole days, with --tuner-only)",
    )
    parser.add_argument("--startup-s", type=non_negative, default=30.0, help="tuner: pod start-up delay on scale-up")
    parser.add_argument(
        "--workers", type=positive_int, help="tuner: processes for the fixed grid (default: one per CPU)"
    )
    parser.add_argument("--seed", type=int, help="tuner: another draw of each workload's trace (default: its own seed)")
    parser.add_argument(
        "--seeds",
        type=seeds,
        help="tuner: several draws in one run, comma-separated (`default` for the workloads' own seeds)",
    )
    parser.add_argument(
        "--tuner-only",
        action="store_true",
        help="tuner: the tuner's runs alone, without the fixed grid, HPA and oracle (a change to the law in a minute)",
    )
    # Your own traffic instead of the bench's workloads (--trace and its cut are the sim's flags).
    add_trace_arguments(parser)
    parser.add_argument("--ttft-ms", type=positive, help="tuner --trace: the p95 TTFT SLO")
    parser.add_argument("--itl-ms", type=positive, help="tuner --trace: the p95 ITL SLO")
    parser.add_argument(
        "--max-replicas", type=positive_int, default=12, help="tuner --trace: the pool's maxReplicas (default 12)"
    )
    parser.add_argument(
        "--initial-replicas",
        type=positive_int,
        default=1,
        help="tuner --trace: the pool the tuner and the HPA start from (default 1; your fleet's size today, say)",
    )
    parser.add_argument(
        "--warmup",
        type=non_negative,
        default=300.0,
        help="tuner --trace: seconds of the trace served first and not counted (default 300: the fleet has been "
        "running)",
    )
    parser.add_argument(
        "--router-policy",
        choices=ROUTER_POLICIES,
        default="load",
        help="tuner --trace: spec.router.policy, for every contender (default load; prefix where your router "
        "follows prompt prefixes and the trace names them, as Mooncake's hash_ids do)",
    )
    parser.add_argument(
        "--scale-down-window-s",
        type=positive_int,
        help=f"tuner --trace: autotune.scaleDownStabilizationSeconds (default the bench's "
        f"{AUTOTUNE['scaleDownStabilizationSeconds']})",
    )


def seeds_of(args) -> list[int | None]:
    return getattr(args, "seeds", None) or [getattr(args, "seed", None)]


def run(args) -> int:
    from llmfleet.sim.cost_model import CostModel

    path = Path(args.profile) if getattr(args, "profile", None) else REFERENCE_PROFILE
    if not path.is_file():
        print(f"no cost profile at {path}: run `llm-fleet calibrate --model {args.model}` to make one")
        return 2
    cost = CostModel.load(path)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    quick = bool(getattr(args, "quick", False))
    seeds = seeds_of(args)
    draws: dict[tuple[str, int | None], Drawn] = {}  # a --trace's, read once a seed; the bench's are drawn in the jobs
    if getattr(args, "trace", None):
        try:
            case, by_seed = trace_case(args, seeds, quick)
        except ValueError as exc:
            print(exc)
            return 2
        cases = [case]
        draws = {(case.workload, seed): drawn for seed, drawn in by_seed.items()}
    else:
        wanted = [w.strip() for w in (args.workloads or "").split(",") if w.strip()]
        known = (*CASES, *SEASON_CASES)
        unknown = sorted(set(wanted) - {c.workload for c in known})
        if unknown:
            print(f"unknown workload(s) {', '.join(unknown)}: choose from {', '.join(c.workload for c in known)}")
            return 2
        cases = [c for c in known if c.workload in wanted] if wanted else list(CASES)
        days_long = [c.workload for c in cases if c.tuner_only]
        if days_long and not getattr(args, "tuner_only", False):
            print(f"{', '.join(days_long)}: days long, run with --tuner-only (a fixed grid over days takes hours)")
            return 2
    print(f"== tuner evaluation in the simulator: {cost.model} {cost.dtype} on {cost.device}, profile {path}")
    print(f"   cost model: {cost.describe()}")
    print(f"   initial knobs {INITIAL_ENGINE}, bounds {BOUNDS}")
    autotune = cases[0].autotune  # the bench's workloads share it; a --trace is alone
    start = (
        "" if cases[0].initial_replicas == 1 else f"; the tuner and the HPA start at {cases[0].initial_replicas} pods"
    )
    if cases[0].router_policy != "load":
        start += f"; router policy {cases[0].router_policy}"
    print(
        f"   autotune {autotune}; pods start {args.startup_s:g} s after a scale-up{start}; draws "
        + ", ".join("default" if s is None else str(s) for s in seeds)
    )
    if getattr(args, "tuner_only", False):
        from llmfleet.bench import tuner_alone

        tuner_alone.run(cases, seeds, cost, args.startup_s, getattr(args, "workers", None), out_dir, quick, draws)
        return 0
    results: dict[str, Any] = {
        "profile": str(path),
        "cost_model": cost.describe(),
        "model": cost.model,
        "initial_engine": INITIAL_ENGINE,
        "bounds": BOUNDS,
        "autotune": autotune,
        "startup_s": args.startup_s,
        "initial_replicas": cases[0].initial_replicas,
        "router_policy": cases[0].router_policy,
        "seeds": seeds,
        "targets": {
            "attainment": ATTAINMENT_TARGET,
            "vs_fixed_at_equal_attainment": FIXED_RATIO_TARGET,
            "vs_hpa_at_equal_attainment": HPA_RATIO_TARGET,
            "prediction_extra_replica_minutes": PREDICTION_EXTRA_TARGET,
        },
        "workloads": [],
    }
    for seed in seeds:  # a whole table per draw, then the next draw
        for case in cases:
            started = time.perf_counter()
            drawn = draws.get((case.workload, seed))
            row = evaluate(case, cost, args.startup_s, quick, getattr(args, "workers", None), seed, drawn)
            row["wall_s"] = time.perf_counter() - started
            results["workloads"].append(row)
            print_workload(row)
            (out_dir / "tuner_eval.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    print_summary(results["workloads"])
    png = save_plot(results["workloads"], out_dir / "tuner_eval.png")
    hint = f" and {png}" if png else " (no PNG: matplotlib is not installed)"
    print(f"wrote {out_dir / 'tuner_eval.json'}{hint}")
    return 0


def trace_case(args, seeds: list[int | None], quick: bool) -> tuple[Case, dict[int | None, Drawn]]:
    """The workload `--trace` asks for, and its draw for each seed: the trace cut as the sim cuts
    it, the SLOs and maxReplicas given, the bench's initial knobs, grid and autotune timing (its
    scale-down window unless ``--scale-down-window-s``). Each draw is read here, once, and handed
    to the runs, since a long log takes a while to read. ValueError says what is missing."""
    path = Path(args.trace)
    if args.ttft_ms is None or args.itl_ms is None:
        raise ValueError("--trace needs the SLOs it is judged on: --ttft-ms and --itl-ms")
    if getattr(args, "workloads", None):
        raise ValueError("--trace replaces the bench's workloads: leave out --workloads")
    if args.trace_duration is not None and args.trace_duration <= args.warmup:
        raise ValueError(
            f"--trace-duration {args.trace_duration:g} leaves nothing after the {args.warmup:g} s --warmup"
        )
    if args.initial_replicas > args.max_replicas:
        raise ValueError(f"--initial-replicas {args.initial_replicas} is above --max-replicas {args.max_replicas}")
    window = args.scale_down_window_s
    caps = {"max_prompt_tokens": args.max_prompt_tokens, "max_output_tokens": args.max_output_tokens}
    case = Case(
        path.stem,
        args.ttft_ms,
        args.itl_ms,
        source="trace",
        duration_s=None if args.trace_duration is None else args.trace_duration - args.warmup,
        warmup_s=args.warmup,
        max_replicas=args.max_replicas,
        initial_replicas=args.initial_replicas,
        router_policy=args.router_policy,
        grid=LONG_GRID,
        ramp=True,
        thin=1.0 if args.thin is None else args.thin,
        trace=path,
        trace_start_s=args.trace_start or 0.0,
        trace_match=tuple(args.trace_match or ()),
        **{cap: tokens for cap, tokens in caps.items() if tokens is not None},  # else the bench's, for builtin:small
        autotune_overrides={} if window is None else {"scaleDownStabilizationSeconds": window},
        why=f"{path}: your trace",
    )
    draws = {}
    for seed in seeds:
        try:
            drawn = draw(case, seed, quick)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the trace: {exc}") from exc
        if not any(r.arrival_s >= drawn.warmup_s for r in drawn.requests):
            which = "" if seed is None else f" (draw {seed})"
            raise ValueError(
                f"no request of {path}{which} arrives after the {drawn.warmup_s:g} s warm-up: nothing to judge"
            )
        draws[seed] = drawn
    return case, draws


def evaluate(
    case: Case,
    cost,
    startup_s: float,
    quick: bool = False,
    workers: int | None = None,
    seed: int | None = None,
    drawn: Drawn | None = None,
) -> dict[str, Any]:
    """Every contender on one draw of a case (``drawn``, or drawn here), scored against the
    targets."""
    from concurrent.futures import ProcessPoolExecutor

    drawn = drawn or draw(case, seed, quick)
    interval = float(case.autotune["intervalSeconds"])
    window = float(case.autotune["scaleDownStabilizationSeconds"])
    tuner_jobs = [(case, cost, drawn.requests, startup_s, drawn.warmup_s, True)]
    if case.ramp:
        tuner_jobs.append((case, cost, drawn.requests, startup_s, drawn.warmup_s, False))
    if case.mode == "disaggregated":
        prefill_counts = sorted({p for p, _ in case.pairs})
        fixed_jobs = [
            (case, knobs, p, cost, drawn.requests, startup_s, drawn.warmup_s)
            for knobs in pair_knob_sets(case, quick)
            for p in prefill_counts
        ]
    else:
        grid = QUICK_GRID if quick else case.grid
        knob_sets = [dict(zip(grid.keys(), values, strict=True)) for values in itertools.product(*grid.values())]
        fixed_jobs = [(case, knobs, cost, drawn.requests, startup_s, drawn.warmup_s) for knobs in knob_sets]
    targets = QUICK_HPA_TARGETS if quick else HPA_TARGETS
    hpa_jobs = [(case, target, cost, drawn.requests, startup_s, drawn.warmup_s) for target in targets]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        tuner_runs = list(pool.map(tuner_run, *zip(*tuner_jobs, strict=True)))
        if case.mode == "disaggregated":
            fixed = [r for runs in pool.map(_fixed_pairs, *zip(*fixed_jobs, strict=True)) for r in runs]
        else:
            fixed = [r for runs in pool.map(_fixed, *zip(*fixed_jobs, strict=True)) for r in runs]
        hpas = list(pool.map(_hpa, *zip(*hpa_jobs, strict=True)))

    tuner = tuner_runs[0]
    reactive = tuner_runs[1] if case.ramp else None
    minutes = len(tuner["per_minute"])
    judged = judged_minutes(tuner["per_minute"], drawn.steps, drawn.warmup_s, startup_s + interval)
    meeting = [r for r in fixed if r["slo_attainment"] is not None and r["slo_attainment"] >= ATTAINMENT_TARGET]
    best_fixed = min(meeting, key=lambda r: r["replica_minutes"]) if meeting else None
    best_hpa = _best_hpa(hpas)
    fixed_equal = cheapest_reaching(fixed, tuner["slo_minutes_met"])
    hpa_equal = cheapest_reaching(hpas, tuner["slo_minutes_met"])
    least = 2 if case.mode == "disaggregated" else 1
    most = (2 if case.mode == "disaggregated" else 1) * case.max_replicas
    oracle_rm, oracle_counts = oracle(fixed, minutes, startup_s, least, most, tuner["span_s"] / 60.0)
    lag = scale_down_lag(tuner.pop("needed"), drawn.warmup_s)
    ratio = _ratio_check(case, tuner, best_fixed)
    prediction = prediction_check(tuner, reactive)
    moved_right = {
        knob: (tuner["knobs"][knob]["net"] * sign > 0) for knob, sign in case.expect.items() if knob in tuner["knobs"]
    }
    rm = tuner["replica_minutes"]
    checks = {
        "attainment": reaches(judged, ATTAINMENT_TARGET),
        "not_below_hpa": best_hpa is None or tuner["slo_minutes_met"] >= best_hpa["slo_minutes_met"],
        "vs_fixed": None if fixed_equal is None else rm <= FIXED_RATIO_TARGET * fixed_equal["replica_minutes"],
        "vs_hpa": None if hpa_equal is None else rm <= HPA_RATIO_TARGET * hpa_equal["replica_minutes"],
        "direction_changes": tuner["max_direction_changes_per_window"] <= 1,
        "scale_down_lag": lag <= window + 2 * interval,
        "ratio": ratio["within_one"] if ratio else None,
        "prediction": prediction["met"] if prediction else None,
        "knobs_right_way": all(moved_right.values()) if case.expect else None,
    }
    for r in (tuner, reactive, *fixed, *hpas):
        if r is not None:
            r.pop("needed", None)
    return {
        "workload": case.workload,
        "seed": seed,
        "mode": case.mode,
        "description": drawn.description,
        "why": case.why,
        "warmup_s": drawn.warmup_s,
        "requests": len(drawn.requests),
        "slo": {"ttft_p95_ms": case.ttft_ms, "itl_p95_ms": case.itl_ms},
        "expect": case.expect,
        "tuner": tuner,
        "reactive": reactive,
        "fixed": fixed,
        "best_fixed": best_fixed,
        "fixed_at_equal_attainment": fixed_equal,
        "hpa_runs": hpas,
        "hpa": best_hpa,
        "hpa_at_equal_attainment": hpa_equal,
        "oracle": {"replica_minutes": oracle_rm, "per_minute": oracle_counts},
        "minutes": judged,
        "scale_down_lag_s": lag,
        "ratio": ratio,
        "prediction": prediction,
        "moved_right": moved_right,
        "checks": checks,
    }


def _ratio_check(case: Case, tuner: dict[str, Any], best_fixed: dict[str, Any] | None) -> dict[str, Any] | None:
    """Disaggregated: the tuner's time-averaged (prefill, decode) against the cheapest fixed pair."""
    if case.mode != "disaggregated" or best_fixed is None:
        return None
    span = tuner["duration_s"] / 60.0
    by_pool = tuner["replica_minutes_by_pool"]
    averaged = (by_pool.get("prefill", 0.0) / span, by_pool.get("decode", 0.0) / span)
    pair = tuple(best_fixed["replicas"])
    within = all(abs(a - b) <= 1.0 for a, b in zip(averaged, pair, strict=True))
    return {"tuner": [round(a, 2) for a in averaged], "best_fixed": list(pair), "within_one": within}


def prediction_check(tuner: dict[str, Any], reactive: dict[str, Any] | None) -> dict[str, Any] | None:
    """Ramps: missed minutes and replica-minutes with prediction against the reactive law alone.
    Met where prediction misses fewer minutes (or neither misses any) for <= 5% more."""
    if reactive is None:
        return None
    missed = tuner["slo_minutes"] - tuner["slo_minutes_met"]
    missed_reactive = reactive["slo_minutes"] - reactive["slo_minutes_met"]
    extra = tuner["replica_minutes"] / reactive["replica_minutes"] - 1.0
    cut = missed < missed_reactive or missed == missed_reactive == 0
    return {
        "missed": missed,
        "missed_reactive": missed_reactive,
        "extra_replica_minutes": extra,
        "met": cut and extra <= PREDICTION_EXTRA_TARGET,
    }


def _brief(result, label: str, **extra: Any) -> dict[str, Any]:
    from llmfleet.sim.report import per_minute, summarize

    s = summarize(result)
    keep = (
        "slo_attainment",
        "slo_minutes",
        "slo_minutes_met",
        "replica_minutes",
        "replica_minutes_by_pool",
        "duration_s",
        "ttft_p95_s",
        "itl_p95_s",
        "goodput_req_s",
        "max_direction_changes_per_window",
        "direction_changes",
        "decisions",
        "status",
        "conserved",
    )
    return {
        "contender": label,
        **{k: s[k] for k in keep},
        "span_s": s["end_s"] - s["measured_from_s"],  # the time its replica-minutes count
        "per_minute": [m["met"] for m in per_minute(result)],
        "needed": result.notes.get("tuner_needed", []),
        **extra,
    }


def _options(startup_s: float):
    from llmfleet.sim.fleet import SimOptions

    return SimOptions(startup_s=startup_s)


def tuner_run(case: Case, cost, requests, startup_s: float, warmup: float, predictive: bool) -> dict[str, Any]:
    """One tuner run: with its forecast, or (``predictive`` False) its reactive law alone."""
    from llmfleet.sim.simulate import simulate

    spec = spec_for(case, predictive=predictive)
    result = simulate(
        spec,
        cost,
        requests,
        controller="tuner",
        options=_options(startup_s),
        name=case.workload,
        measure_from=warmup,
    )
    label = "tuner (closed loop)" if predictive else "tuner, reactive law alone"
    return _brief(result, label, knobs=_knob_moves(result), moves=_decisions(result), timeline=_timeline(result))


def _fixed(case: Case, knobs: dict[str, Any], cost, requests, startup_s: float, warmup: float) -> list[dict[str, Any]]:
    """One knob set at 1, 2, ... replicas up to the fewest that meet the SLOs (else the most)."""
    ladder = (
        (spec_for(case, knobs, n, autotune=False), f"fixed {_knobs(knobs)} x{n}", {"knobs": knobs, "replicas": n}, n)
        for n in range(1, case.max_replicas + 1)
    )
    return _until_met(case, ladder, cost, requests, startup_s, warmup)


def pair_knob_sets(case: Case, quick: bool = False) -> list[dict[str, dict[str, float]]]:
    """Every combination of the case's per-pool knob values for the fixed pairs (quick: the
    first of each), as ``spec_for``'s ``pool_knobs``."""
    axes = [
        (pool, knob, values[:1] if quick else values)
        for pool, knobs in case.pair_knobs.items()
        for knob, values in knobs.items()
    ]
    sets = []
    for combo in itertools.product(*(values for _, _, values in axes)):
        knobs: dict[str, dict[str, float]] = {}
        for (pool, knob, _), value in zip(axes, combo, strict=True):
            knobs.setdefault(pool, {})[knob] = value
        sets.append(knobs)
    return sets


def _fixed_pairs(
    case: Case, knobs: dict[str, dict[str, float]], prefill: int, cost, requests, startup_s: float, warmup: float
) -> list[dict[str, Any]]:
    """One knob set and prefill count at 1, 2, ... decode replicas (the case's pairs) up to the
    fewest that meet the SLOs: more decode pods cost more and meet no fewer minutes."""
    described = " ".join(f"{pool} {_knobs(values)}" for pool, values in knobs.items())
    ladder = (
        (
            spec_for(case, replicas=(prefill, decode), autotune=False, pool_knobs=knobs),
            f"fixed P:D {prefill}:{decode}" + (f" {described}" if described else ""),
            {"replicas": [prefill, decode], "knobs": knobs},
            prefill + decode,
        )
        for decode in sorted(d for p, d in case.pairs if p == prefill)
    )
    return _until_met(case, ladder, cost, requests, startup_s, warmup)


def _until_met(case: Case, ladder, cost, requests, startup_s: float, warmup: float) -> list[dict[str, Any]]:
    """Fixed runs of ``ladder`` ((spec, label, extra fields, replicas in all), cheapest first,
    made as they are reached) up to the first that meets the SLOs: those after it cost more and
    meet no fewer minutes."""
    from llmfleet.sim.simulate import simulate

    runs = []
    for spec, label, extra, total in ladder:
        result = simulate(
            spec,
            cost,
            requests,
            controller="fixed",
            options=_options(startup_s),
            name=case.workload,
            measure_from=warmup,
        )
        row = _brief(result, label, **extra)
        runs.append(row | {"replicas_total": total})
        if row["slo_attainment"] is not None and row["slo_attainment"] >= ATTAINMENT_TARGET:
            break
    return runs


def _best_hpa(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The cheapest HPA target that meets the SLOs, else the one that meets the most minutes."""
    if not runs:
        return None
    meeting = [r for r in runs if r["slo_attainment"] is not None and r["slo_attainment"] >= ATTAINMENT_TARGET]
    if meeting:
        return min(meeting, key=lambda r: r["replica_minutes"])
    return max(runs, key=lambda r: (r["slo_minutes_met"], -r["replica_minutes"]))


def _hpa(case: Case, target: float, cost, requests, startup_s: float, warmup: float) -> dict[str, Any]:
    from llmfleet.sim.hpa import HPAConfig
    from llmfleet.sim.simulate import simulate

    result = simulate(
        spec_for(case),
        cost,
        requests,
        controller="hpa",
        options=_options(startup_s),
        name=case.workload,
        hpa=HPAConfig(target_waiting_per_pod=target),
        measure_from=warmup,
    )
    return _brief(result, f"hpa {target:g} waiting/pod", target=target)


def _knob_moves(result) -> dict[str, dict[str, Any]]:
    """Per knob (and replicas), summed over pools: first and last value, net direction, moves."""
    from llmfleet.operator.tuner.law import KNOB_FIELDS

    moves: dict[str, dict[str, Any]] = {}
    first = result.timeline[0].pools if result.timeline else {}
    for pool, start_values in first.items():
        for knob in (*KNOB_FIELDS, "replicas"):
            changes = [c for d in result.decisions for c in d.changes if c["knob"] == knob and c["pool"] == pool]
            start = changes[0]["from"] if changes else start_values.get(knob, start_values.get("ready"))
            end = changes[-1]["to"] if changes else start
            net = 0 if start == end else (1 if end > start else -1)
            values = [start, *(c["to"] for c in changes)]
            key = knob if len(first) == 1 else f"{pool}/{knob}"
            moves[key] = {
                "from": start,
                "to": end,
                "net": net,
                "moves": len(changes),
                "range": [min(values), max(values)],
                "drivers": sorted({c.get("driver", "") for c in changes} - {""}),
            }
    return moves


def _decisions(result) -> list[str]:
    return [
        f"t={d.at:.0f}s "
        + ", ".join(f"{c['pool']}/{c['knob']} {c['from']}->{c['to']} ({c.get('driver', '')})" for c in d.changes)
        for d in result.decisions
        if d.changes
    ]


def _timeline(result) -> list[tuple[float, int]]:
    """(minutes after the warm-up, pods paid for), at most 600 points."""
    points = [p for p in result.timeline if p.at >= result.measure_from]
    step = max(1, len(points) // 600)
    return [
        ((p.at - result.measure_from) / 60.0, sum(v["ready"] + v["starting"] + v["draining"] for v in p.pools.values()))
        for p in points[::step]
    ]


def save_plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Per workload (its first draw): the tuner's pods over time against the oracle's per minute
    and the best fixed fleet. None where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = list({row["workload"]: row for row in reversed(rows)}.values())[::-1]
    fig, axes = plt.subplots(len(first), 1, figsize=(10, 2.4 * len(first)), squeeze=False)
    for ax, row in zip(axes[:, 0], first, strict=True):
        timeline = row["tuner"].get("timeline") or []
        ax.step([t for t, _ in timeline], [n for _, n in timeline], where="post", label="tuner")
        oracle = row["oracle"]["per_minute"]
        ax.step(range(len(oracle) + 1), [*oracle, oracle[-1] if oracle else 0], where="post", ls=":", label="oracle")
        best = row["best_fixed"]
        if best is not None:
            ax.axhline(best["replicas_total"], color="gray", ls="--", lw=1, label="best fixed")
        ax.set_ylabel("pods")
        ax.set_title(f"{row['workload']}: {row['tuner']['slo_minutes_met']}/{row['tuner']['slo_minutes']} minutes met")
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("minutes after the warm-up")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _knobs(knobs: dict[str, Any]) -> str:
    return " ".join(f"{KNOB_NAMES[k]} {v:g}" for k, v in knobs.items())


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _of(r: dict[str, Any] | None, base: dict[str, Any] | None) -> str:
    return "-" if r is None or base is None else _ratio(r["replica_minutes"] / base["replica_minutes"])


def print_workload(row: dict[str, Any]) -> None:
    from llmfleet.bench.report import print_table

    slo = row["slo"]
    seed = "default draw" if row["seed"] is None else f"seed {row['seed']}"
    print(f"\n== {row['workload']} ({row['mode']}, {seed}): {row['description']}")
    print(
        f"   {row['why']}; SLO p95 TTFT {slo['ttft_p95_ms']:g} ms, ITL {slo['itl_p95_ms']:g} ms; "
        f"{row['requests']} requests, the first {row['warmup_s']:.0f} s not counted; evaluated in {row['wall_s']:.0f} s"
    )
    rows = [
        ("tuner (closed loop)", row["tuner"]),
        ("tuner, reactive law alone", row["reactive"]),
        ("best fixed (meets >= 99%)", row["best_fixed"]),
        ("cheapest fixed at the tuner's minutes met", row["fixed_at_equal_attainment"]),
        ("best HPA target", row["hpa"]),
        ("cheapest HPA at the tuner's minutes met", row["hpa_at_equal_attainment"]),
    ]
    oracle_rm = row["oracle"]["replica_minutes"]
    table = []
    for label, r in rows:
        if r is None:
            continue
        name = r["contender"] if label.startswith(("best", "cheapest")) else ""
        table.append(
            [
                label + (f": {name.removeprefix('fixed ')}" if name else ""),
                f"{r['slo_minutes_met']}/{r['slo_minutes']}",
                f"{r['replica_minutes']:.1f}",
                _ratio(r["replica_minutes"] / oracle_rm) if oracle_rm else "-",
                f"{r['ttft_p95_s'] * 1000:.0f}" if r["ttft_p95_s"] is not None else "-",
                f"{r['itl_p95_s'] * 1000:.0f}" if r["itl_p95_s"] is not None else "-",
                str(r["max_direction_changes_per_window"]),
            ]
        )
    table.append(["oracle (per-minute fewest, start-up paid)", "-", f"{oracle_rm:.1f}", "1.00x", "-", "-", "-"])
    print_table(
        ["contender", "SLO minutes", "replica-min", "vs oracle", "TTFT p95 ms", "ITL p95 ms", "dir. changes/window"],
        table,
    )
    m = row["minutes"]
    if m["step_judged"]:
        print(
            f"   minutes within start-up + one interval of an unannounced step: {m['step_met']}/{m['step_judged']} met"
            f" (left out of the attainment: {m['met']}/{m['judged']})"
        )
    print(f"   scale-down lag: {row['scale_down_lag_s']:.0f} s (most time above the need last asked for)")
    if row["ratio"]:
        r = row["ratio"]
        print(f"   P:D time-averaged {r['tuner'][0]:.2f}:{r['tuner'][1]:.2f} vs best fixed pair {r['best_fixed']}")
    if row["prediction"]:
        p = row["prediction"]
        print(
            f"   prediction: missed {p['missed']} minutes vs {p['missed_reactive']} reactive alone, "
            f"{p['extra_replica_minutes']:+.1%} replica-minutes"
        )
    print(
        "   HPA runs: "
        + "; ".join(
            f"{r['target']:g}: {r['replica_minutes']:.1f} rm, {r['slo_minutes_met']}/{r['slo_minutes']}"
            for r in row["hpa_runs"]
        )
    )
    knobs = row["tuner"]["knobs"]
    print(
        "   tuner moves: "
        + "; ".join(
            f"{knob} {_plain(v['from'])} -> {_plain(v['to'])} ({v['moves']} moves"
            + (f", by {'/'.join(v['drivers'])}" if v["drivers"] else "")
            + ")"
            for knob, v in knobs.items()
            if v["moves"]
        )
    )


def summary_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """One line per workload and draw: the table docs/benchmarks.md carries."""
    out = []
    for row in rows:
        t, hpa = row["tuner"], row["hpa"]
        out.append(
            [
                row["workload"],
                "default" if row["seed"] is None else str(row["seed"]),
                minutes_cell(row["minutes"]),
                "-" if hpa is None else f"{hpa['slo_minutes_met']}/{hpa['slo_minutes']}",
                f"{t['replica_minutes']:.1f}",
                _of(t, row["fixed_at_equal_attainment"]),
                _of(t, row["hpa_at_equal_attainment"]),
                _ratio(t["replica_minutes"] / row["oracle"]["replica_minutes"]),
                str(t["max_direction_changes_per_window"]),
                f"{row['scale_down_lag_s']:.0f} s",
                _pair(row["ratio"]),
                prediction_cell(row["prediction"]),
            ]
        )
    return out


def _pair(ratio: dict[str, Any] | None) -> str:
    """The tuner's time-averaged (prefill, decode) against the best fixed pair."""
    if not ratio:
        return "-"
    (p, d), (bp, bd) = ratio["tuner"], ratio["best_fixed"]
    return f"{p:.1f}:{d:.1f} vs {bp}:{bd}"


def minutes_cell(m: dict[str, int]) -> str:
    """Minutes met of those judged, and an unannounced step's minutes on their own."""
    steps = f" (+{m['step_met']}/{m['step_judged']} step)" if m["step_judged"] else ""
    return f"{m['met']}/{m['judged']}{steps}"


def prediction_cell(prediction: dict[str, Any] | None) -> str:
    """Minutes missed with prediction against the reactive law alone, and the extra spend."""
    if not prediction:
        return "-"
    p = prediction
    return f"{p['missed']} vs {p['missed_reactive']} missed, {p['extra_replica_minutes']:+.1%}"


SUMMARY_HEADER = [
    "workload",
    "draw",
    "minutes met",
    "best HPA met",
    "replica-min",
    "vs fixed (equal)",
    "vs HPA (equal)",
    "vs oracle",
    "dir. changes",
    "down lag",
    "P:D vs best",
    "prediction vs reactive",
]


def print_summary(rows: list[dict[str, Any]]) -> None:
    from llmfleet.bench.report import print_table

    def mark(value: bool | None) -> str:
        return "-" if value is None else ("met" if value else "MISSED")

    print("\n== summary (minutes met leave out those an unannounced step explains; ratios at equal attainment)")
    print_table(SUMMARY_HEADER, summary_rows(rows))
    print("\n== targets")
    names = {
        "attainment": f">= {ATTAINMENT_TARGET:.0%} minutes",
        "not_below_hpa": ">= best HPA's minutes",
        "vs_fixed": f"<= {FIXED_RATIO_TARGET}x fixed",
        "vs_hpa": f"<= {HPA_RATIO_TARGET}x HPA",
        "direction_changes": "<= 1 dir. change/window",
        "scale_down_lag": "down lag <= window + 2 intervals",
        "ratio": "P:D within 1",
        "prediction": "prediction",
        "knobs_right_way": "knobs the right way",
    }
    table = []
    for row in rows:
        draw_name = "default" if row["seed"] is None else str(row["seed"])
        table.append([row["workload"], draw_name, *(mark(row["checks"][k]) for k in names)])
    print_table(["workload", "draw", *names.values()], table)


def _plain(value: Any) -> Any:
    if isinstance(value, float) and value == int(value):
        return int(value)
    return value
