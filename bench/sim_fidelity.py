"""sim-fidelity: does the simulator predict the real engine on this machine?

The same anyscale-online trace (Poisson arrivals; prompts uniform 1..512; outputs exponential,
mean 128, capped) runs twice, side by side in one process:

1. **real**: the engine with the torch runner, in real time, with the torch thread count of the
   calibrated profile (``llm-fleet calibrate`` pins and records it);
2. **sim**: one simulated pod with the same engine config, its steps timed by the profile's cost
   model (``llmfleet.sim``).

Printed per arrival rate: throughput, TTFT, ITL, TPOT and end-to-end latency of both, and
sim/real ratios; the target is throughput and the p50 TTFT and end-to-end latency within 15%.
Also the cost model's error on the real run's own steps (each step's features, as the runner
saw them, through the model), and the CPU pressure during the real run: another busy process
on the machine slows the real engine, and a run under more than ``--max-pressure`` is repeated
(``--tries``), the quietest kept.

A virtual machine's speed also drifts with its host's load, which no pressure reading inside it
shows: on a 2-core cloud VM the same decode step's median moved between 23 and 45 ms within
three minutes. So the real run's steps also give the machine's speed during that run (their
measured over their modelled time, overall and its spread over 5-second spans), and a second
simulation runs the profile at that speed. It separates the two ways the simulator can be off:
step costs (the profile against this run's machine) and everything else (queueing, batching,
chunking, the scheduler's decisions), which the second simulation isolates.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from llmfleet.arguments import non_negative, positive_int
from llmfleet.bench.arguments import positive_floats
from llmfleet.bench.machine import CPUPressure, describe, wait_quiet
from llmfleet.bench.report import Trace, latency_summary, print_table
from llmfleet.server.config import EngineConfig
from llmfleet.server.core.request import SamplingParams
from llmfleet.sim.cost_model import CostModel, StepFeatures, default_profile_path, profile_error
from llmfleet.sim.paths import file_problem
from llmfleet.workloads import RequestSpec, Workload, anyscale_online, prompt_tokens

TOLERANCE = 0.15
TARGETS = ("throughput_tok_s", "ttft_p50", "e2e_p50")
SLO_TTFT_S, SLO_TPOT_S = 2.0, 0.2  # for goodput only


def add_arguments(parser) -> None:
    """Options of `llm-fleet bench sim-fidelity` (bench/cli.py adds them)."""
    parser.add_argument(
        "--profile",
        help="cost profile (sim-fidelity default: $LLMFLEET_CACHE/calibration/<model>.json; "
        "tuner default: the reference profile in bench/profiles/)",
    )
    parser.add_argument("--calibrate", action="store_true", help="sim-fidelity: calibrate first (--quick: its grid)")
    parser.add_argument("--threads", type=positive_int, help="sim-fidelity --calibrate: torch threads to pin")
    parser.add_argument(
        "--rates", type=positive_floats, default="0.3,0.6", help="sim-fidelity: arrival rates, requests/s"
    )
    parser.add_argument("--requests", type=positive_int, default=64, help="sim-fidelity: requests per rate")
    parser.add_argument("--budget", type=positive_int, default=512, help="sim-fidelity: max_num_batched_tokens")
    parser.add_argument(
        "--tries", type=positive_int, default=3, help="sim-fidelity: real runs per rate under CPU pressure"
    )
    parser.add_argument(
        "--max-pressure", type=non_negative, default=0.05, help="sim-fidelity: CPU pressure to retry above"
    )


def profile_problem(args) -> str | None:
    """Why the cost profile can be neither read nor made: an explicit --profile that is missing
    (unless --calibrate makes it), or a profile to calibrate that could not be saved; or None."""
    path = _profile_path(args)
    if not args.calibrate and path.exists():
        return profile_error(path)
    if args.profile and not args.calibrate:
        return f"no cost profile at {path}: pass --calibrate to make one"
    problem = file_problem(path)  # now, not after the minutes of calibrating
    return f"cannot save the profile to {path}: {problem}" if problem else None


def _profile_path(args) -> Path:
    return Path(args.profile) if args.profile else default_profile_path(args.model)


def run(args) -> int:
    import torch

    from llmfleet.sim.calibrate import GRIDS, calibrate, print_report

    model = args.model
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = _profile_path(args)
    if args.calibrate or not path.is_file():
        grid_name = "quick" if args.quick else "full"
        print(f"== calibrating {model} ({grid_name} grid, dtype {args.dtype}) -> {path}")
        wait_quiet()
        device = getattr(args, "device", None) or "cpu"
        profile = calibrate(model, GRIDS[grid_name], threads=args.threads, dtype=args.dtype, device=device)
        profile.save(path)
        print_report(profile)
    cost = CostModel.load(path)
    if cost.model != model:
        print(f"profile {path} is of {cost.model}, not {model}: pass --model {cost.model} or --calibrate")
        return 2
    if cost.threads:
        torch.set_num_threads(cost.threads)
    rates = args.rates
    requests = 16 if args.quick else args.requests
    config = EngineConfig(
        dtype=cost.dtype, max_batch_size=args.batch, max_num_batched_tokens=args.budget, max_queue_len=4096
    )
    print(
        f"== sim-fidelity: {model} {cost.dtype} on {cost.device}, {torch.get_num_threads()} torch threads "
        f"(profile: {cost.threads}); continuous chunked, max_batch_size {config.max_batch_size}, "
        f"max_num_batched_tokens {config.max_num_batched_tokens}"
    )
    print(f"   cost profile {path} ({cost.created}): {cost.describe()}")
    engine = _build(model, config, cost)
    results: dict[str, Any] = {
        "model": model,
        "dtype": cost.dtype,
        "device": cost.device,
        "threads": torch.get_num_threads(),
        "profile": str(path),
        "profile_created": cost.created,
        "cost_model": cost.describe(),
        "config": config.model_dump(mode="json", exclude_none=True),
        "tolerance": TOLERANCE,
        "runs": [],
    }
    ok = ok_at_speed = True
    for index, rate in enumerate(rates):
        workload = anyscale_online(rate, requests)
        specs = workload.requests()
        print(f"== {workload.name}: {workload.description}, {requests} requests")
        tries = []
        for attempt in range(max(1, args.tries)):
            wait_quiet(args.max_pressure)
            real = real_run(engine, specs, f"r{index}.{attempt}-", seed=1 + 1000 * index + attempt)
            tries.append(real)
            seconds, share = real["summary"]["seconds"], describe(real["pressure"])
            print(f"   real run {attempt + 1}: {seconds:.1f} s, CPU pressure {share}")
            if real["pressure"] is None or real["pressure"] <= args.max_pressure:
                break
        real = min(tries, key=lambda r: r["pressure"] if r["pressure"] is not None else 0.0)
        sim = sim_run(model, cost, config, specs, real["warm_sizes"])
        speed = machine_speed(real["steps"], cost)
        at_speed = sim_run(model, cost.slowed(speed["slowdown"]), config, specs, real["warm_sizes"])
        row = compare(workload, real, sim, at_speed, speed, cost)
        ok &= row["within_tolerance"]
        ok_at_speed &= row["within_tolerance_at_run_speed"]
        results["runs"].append(row | {"pressure_all_tries": [t["pressure"] for t in tries]})
        print_comparison(row)
    (out_dir / "sim_fidelity.json").write_text(json.dumps(results, indent=2) + "\n")
    save_plot(results, out_dir / "sim_fidelity.png")

    def verdict(met: bool) -> str:
        return "within" if met else "NOT within"

    print(
        f"== throughput and p50 TTFT/e2e of the simulator {verdict(ok)} {TOLERANCE:.0%} of the real engine as "
        f"calibrated, {verdict(ok_at_speed)} at each real run's machine speed"
    )
    print(f"wrote {out_dir / 'sim_fidelity.json'} and {out_dir / 'sim_fidelity.png'}")
    return 0


def _build(model: str, config: EngineConfig, cost: CostModel):
    """The real engine, its runner recording every step's features (and the step sizes run)."""
    from llmfleet.server.engine.build import build_engine

    engine, _ = build_engine(model, config, device=cost.device)
    runner = engine.runner
    engine.recorded = []  # type: ignore[attr-defined]
    engine.seen_sizes = set(runner.warm_sizes)  # type: ignore[attr-defined]  # step sizes this process has run
    execute = runner.execute

    def recording_execute(output):
        features = cost.features(output, runner.kv_block_size, engine.seen_sizes)  # type: ignore[attr-defined]
        engine.recorded.append(features)  # type: ignore[attr-defined]
        return execute(output)

    runner.execute = recording_execute
    engine.generate([[11] * 64, [12] * 200], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
    return engine


def real_run(engine, specs: list[RequestSpec], prefix: str, seed: int) -> dict[str, Any]:
    """The trace in real time through the real engine; every step's features and seconds kept.

    ``seed`` draws the prompts' tokens: each run needs its own, or the engine's prefix cache
    would serve a repeated trace's prompts from the run before (the simulator models no hits)."""
    vocab = engine.runner.model.config.vocab_size
    traces: dict[str, Trace] = {}
    steps: list[tuple[StepFeatures, float]] = []
    pending = list(enumerate(specs))
    engine.recorded.clear()
    warm = frozenset(engine.seen_sizes)
    with CPUPressure() as pressure:
        start = time.monotonic()
        while pending or engine.has_unfinished_requests():
            now = time.monotonic() - start
            while pending and pending[0][1].arrival_s <= now:
                i, spec = pending.pop(0)
                rid = f"{prefix}{i}"
                sampling = SamplingParams(max_tokens=spec.output_len, temperature=0, ignore_eos=True)
                prompt = prompt_tokens(spec, i, vocab, seed)
                engine.add_request(rid, prompt, sampling, arrival_time=start + spec.arrival_s)
                traces[rid] = Trace(spec.arrival_s, spec.prompt_len)
            before = len(engine.recorded)
            began = time.perf_counter()
            events = engine.step()
            seconds = time.perf_counter() - began
            if len(engine.recorded) > before:
                steps.append((engine.recorded[-1], seconds))
            t = time.monotonic() - start
            for ev in events:
                traces[ev.request_id].token_times.extend([t] * len(ev.new_token_ids))
            if not engine.has_unfinished_requests() and pending:
                time.sleep(max(0.0, start + pending[0][1].arrival_s - time.monotonic()))
        total = time.monotonic() - start
    summary = latency_summary(list(traces.values()), total, SLO_TTFT_S, SLO_TPOT_S)
    return {"summary": summary, "steps": steps, "pressure": pressure.share, "warm_sizes": warm}


def sim_run(
    model: str, cost: CostModel, config: EngineConfig, specs: list[RequestSpec], warm_sizes: frozenset[int]
) -> dict[str, Any]:
    """One simulated pod, the same engine config, no controller; it starts having run the step
    sizes the real engine process had run before its run (``new_shape``)."""
    from llmfleet.operator.resource.spec import parse_spec
    from llmfleet.sim.fleet import Fleet, SimOptions

    builtin = model.startswith("builtin:")
    source = {"builtin": model.split(":", 1)[1]} if builtin else {"path": str(Path(model).resolve())}
    engine = config.model_dump(by_alias=True, exclude_none=True)
    spec = parse_spec(
        {
            "model": source,
            "slo": {"ttftP95Ms": SLO_TTFT_S * 1000, "itlP95Ms": SLO_TPOT_S * 1000},
            "pools": {"colocated": {"minReplicas": 1, "maxReplicas": 1, "replicas": 1, "engine": engine}},
            "autotune": {"enabled": False},
        }
    )
    options = SimOptions(startup_s=0.0, tail_s=3600.0)
    started = time.perf_counter()
    fleet = Fleet(spec, cost, specs, options, None, name="fidelity")
    for pod in fleet.pools["colocated"].pods:
        pod.engine.runner.seen_sizes.update(warm_sizes)  # type: ignore[attr-defined]
    result = fleet.run()
    wall = time.perf_counter() - started
    summary = latency_summary(result.records, result.end, SLO_TTFT_S, SLO_TPOT_S)
    return {"summary": summary, "conserved": result.conserved, "wall_s": wall}


def machine_speed(steps: list[tuple[StepFeatures, float]], cost: CostModel, span_s: float = 5.0) -> dict[str, float]:
    """How much slower than its profile the machine ran a real run's steps: measured over
    modelled step time for the whole run (``slowdown``), and the 10th and 90th percentiles of the
    same ratio over consecutive spans of ``span_s`` of step time (how much it drifted within)."""
    spans: list[float] = []
    measured = modelled = span_measured = span_modelled = 0.0
    for features, seconds in steps:
        predicted = cost.step_seconds(features)
        measured += seconds
        modelled += predicted
        span_measured += seconds
        span_modelled += predicted
        if span_measured >= span_s:
            spans.append(span_measured / span_modelled)
            span_measured = span_modelled = 0.0
    if not modelled:
        return {"slowdown": 1.0, "span_p10": 1.0, "span_p90": 1.0}
    spans.sort()
    whole = measured / modelled
    return {
        "slowdown": whole,
        "span_p10": spans[len(spans) // 10] if spans else whole,
        "span_p90": spans[len(spans) * 9 // 10] if spans else whole,
    }


def compare(
    workload: Workload,
    real: dict[str, Any],
    sim: dict[str, Any],
    at_speed: dict[str, Any],
    speed: dict[str, float],
    cost: CostModel,
) -> dict[str, Any]:
    r = real["summary"]
    keys = ("throughput_tok_s", "ttft_p50", "ttft_p99", "itl_p50", "tpot_p50", "e2e_p50", "e2e_p99", "goodput_req_s")

    def ratios_of(simulated: dict[str, float]) -> dict[str, float]:
        return {k: (simulated[k] / r[k] if r[k] else float("nan")) for k in keys}

    def within(ratios: dict[str, float]) -> bool:
        return all(abs(ratios[k] - 1.0) <= TOLERANCE for k in TARGETS)

    ratios, ratios_at_speed = ratios_of(sim["summary"]), ratios_of(at_speed["summary"])
    measured = [seconds for _, seconds in real["steps"]]
    predicted = [cost.step_seconds(f) for f, _ in real["steps"]]
    errors = [abs(p - m) / m for p, m in zip(predicted, measured, strict=True) if m > 0]
    return {
        "workload": workload.params(),
        "rate": workload.rate_per_s,
        "real": r,
        "sim": sim["summary"],
        "ratios": ratios,
        "within_tolerance": within(ratios),
        "machine_speed": speed,
        "sim_at_run_speed": at_speed["summary"],
        "ratios_at_run_speed": ratios_at_speed,
        "within_tolerance_at_run_speed": within(ratios_at_speed),
        "pressure": real["pressure"],
        "real_steps": len(measured),
        "step_model": {
            "busy_s_real": sum(measured),
            "busy_s_model": sum(predicted),
            "ratio": sum(predicted) / sum(measured) if measured else None,
            "mean_abs_rel_error": sum(errors) / len(errors) if errors else None,
        },
        "sim_wall_s": sim["wall_s"],
        "sim_conserved": sim["conserved"],
    }


def print_comparison(row: dict[str, Any]) -> None:
    r, s, ratio = row["real"], row["sim"], row["ratios"]
    s2, ratio2 = row["sim_at_run_speed"], row["ratios_at_run_speed"]

    def sec(v: float) -> str:
        return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"

    metrics = [
        ("throughput (tok/s)", "throughput_tok_s", lambda v: f"{v:.1f}"),
        ("TTFT p50", "ttft_p50", sec),
        ("TTFT p99", "ttft_p99", sec),
        ("ITL p50", "itl_p50", sec),
        ("TPOT p50", "tpot_p50", sec),
        ("e2e p50", "e2e_p50", sec),
        ("e2e p99", "e2e_p99", sec),
        ("goodput (req/s)", "goodput_req_s", lambda v: f"{v:.2f}"),
    ]

    def mark(value: float, key: str) -> str:
        return ("yes" if abs(value - 1) <= TOLERANCE else "NO") if key in TARGETS else "-"

    rows = [
        [
            label,
            fmt(r[key]),
            fmt(s[key]),
            f"{ratio[key]:.2f}",
            mark(ratio[key], key),
            fmt(s2[key]),
            f"{ratio2[key]:.2f}",
            mark(ratio2[key], key),
        ]
        for label, key, fmt in metrics
    ]
    within = f"within {TOLERANCE:.0%}"
    headers = ["metric", "real engine", "simulator", "sim/real", within, "at run speed", "sim/real", within]
    print_table(headers, rows)
    m, speed = row["step_model"], row["machine_speed"]
    print(
        f"   cost model on the real run's {row['real_steps']} steps: busy time {m['busy_s_model']:.1f} s modeled vs "
        f"{m['busy_s_real']:.1f} s measured ({m['ratio']:.2f}x), mean |error| per step "
        f"{m['mean_abs_rel_error']:.1%}; CPU pressure during the real run {describe(row['pressure'])}; "
        f"simulated in {row['sim_wall_s']:.1f} s"
    )
    print(
        f"   machine speed: measured over modelled step time {speed['span_p10']:.2f}x-{speed['span_p90']:.2f}x "
        f"over 5 s spans of the run (10th-90th percentile); 'at run speed' simulates the profile slowed "
        f"{speed['slowdown']:.2f}x (the whole run's)"
    )


def save_plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), squeeze=False)
    for ax, row in zip(axes[0], runs, strict=True):
        labels = ["tok/s / 100", "TTFT p50 s", "ITL p50 s x 10", "e2e p50 s", "e2e p99 s"]
        scale = {"throughput_tok_s": 0.01, "ttft_p50": 1, "itl_p50": 10, "e2e_p50": 1, "e2e_p99": 1}
        x = range(len(labels))
        for offset, who in ((-0.27, "real"), (0.0, "sim"), (0.27, "sim_at_run_speed")):
            values = [row[who][k] * v for k, v in scale.items()]
            ax.bar([i + offset for i in x], values, width=0.27, label=who.replace("_", " "))
        ax.set_xticks(list(x), labels, rotation=15)
        ax.set_title(f"{results['model']} at {row['rate']:g} req/s (pressure {describe(row['pressure'])})")
        ax.legend()
    fig.suptitle("sim-fidelity: real engine vs simulator (anyscale-online)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
