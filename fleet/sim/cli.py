"""`llm-fleet sim`: replay a workload trace through a simulated fleet of an InferenceService.

Each pod runs the real scheduler and engine loop with a cost-model runner fitted by
`llm-fleet calibrate`; the real tuner (or an HPA baseline, or nothing) acts every autotune
interval on the simulated metrics. Prints SLO attainment, goodput, replica-minutes and the
decisions; writes JSON and a PNG plot.
"""

from __future__ import annotations

import argparse

from llmfleet.arguments import fraction, non_negative, positive, positive_int

HELP = "simulate an InferenceService on a workload trace: real scheduler and tuner, cost-model pods"


def add_arguments(parser) -> None:
    from llmfleet.sim.trace import TRACE_NAMES

    parser.add_argument("-f", "--file", required=True, help="InferenceService YAML (e.g. examples/local.yaml)")
    parser.add_argument("--workload", choices=TRACE_NAMES, help="built-in workload (default bursty)")
    add_trace_arguments(parser)
    parser.add_argument("--duration", type=positive, help="seconds of built-in workload (default: its own length)")
    parser.add_argument("--rate-scale", type=positive, help="multiply the built-in workload's rates")
    parser.add_argument("--seed", type=int, help="workload seed (default: the workload's), or --thin's draw")
    parser.add_argument(
        "--warmup",
        type=non_negative,
        default=0.0,
        help="serve the workload's opening rate this long first, unreported (with --trace: leave the trace's "
        "first seconds out of the report)",
    )
    parser.add_argument("--save-trace", help="write the trace used as JSONL")
    parser.add_argument("--profile", help="cost profile (default $LLMFLEET_CACHE/calibration/<model>.json)")
    parser.add_argument(
        "--controller",
        choices=["tuner", "hpa", "fixed"],
        help="tuner (default when spec.autotune.enabled), hpa (queue-length baseline) or fixed",
    )
    parser.add_argument("--hpa-target", type=positive, default=2.0, help="HPA: target waiting requests per pod")
    parser.add_argument("--startup-s", type=non_negative, default=30.0, help="pod start-up delay on scale-up")
    parser.add_argument("--tail-s", type=non_negative, default=600.0, help="time to finish after the last arrival")
    parser.add_argument("--kv-transfer-gbps", type=positive, default=10.0, help="disaggregated: prefill->decode Gbit/s")
    parser.add_argument("--out", default="sim-results", help="directory for the JSON and PNG")
    parser.add_argument("--decisions", type=int, default=20, help="how many decisions to print")
    parser.add_argument(
        "--runs",
        help="write every tuner run to this file as JSON lines: the replicas it left, its changes and each line of "
        "its reasons, what held a knob or a count included",
    )


def add_trace_arguments(parser) -> None:
    """--trace and the flags that cut it (also `llm-fleet bench tuner`'s)."""
    parser.add_argument(
        "--trace",
        help="a request log: JSONL (arrival_s, prompt_tokens, output_tokens per line, or Mooncake's timestamp, "
        "input_length, output_length) or CSV (Azure's TIMESTAMP, ContextTokens, GeneratedTokens, or BurstGPT's "
        "Timestamp, Request tokens, Response tokens), plain or compressed (gzip, bzip2, xz)",
    )
    parser.add_argument("--trace-start", type=non_negative, help="--trace: replay from this many seconds in")
    parser.add_argument("--trace-duration", type=positive, help="--trace: replay this many seconds of it")
    parser.add_argument("--thin", type=fraction, help="--trace: keep this fraction of its requests (drawn with --seed)")
    parser.add_argument("--max-prompt-tokens", type=positive_int, help="--trace: cap prompt lengths")
    parser.add_argument("--max-output-tokens", type=positive_int, help="--trace: cap output lengths")
    parser.add_argument(
        "--trace-match",
        type=field_value,
        action="append",
        metavar="FIELD=VALUE",
        help="--trace: replay only the rows whose FIELD (a CSV column or JSONL key) is VALUE, e.g. "
        "'Model=GPT-4' of BurstGPT's; again for more fields, all of which must match",
    )


def field_value(text: str) -> tuple[str, str]:
    """FIELD=VALUE, split at the first '='."""
    field, equals, value = text.partition("=")
    if not equals or not field.strip():
        raise argparse.ArgumentTypeError(f"expected FIELD=VALUE, got {text!r}")
    return field.strip(), value.strip()


def run(args) -> int:
    from pathlib import Path

    from llmfleet.operator.resource.spec import SpecError
    from llmfleet.sim.cost_model import CostModel, default_profile_path
    from llmfleet.sim.fleet import SimOptions, check_spec
    from llmfleet.sim.hpa import HPAConfig
    from llmfleet.sim.pod import PodConfigError
    from llmfleet.sim.report import print_summary, save_plot, summarize, write_json, write_runs
    from llmfleet.sim.simulate import read_service, simulate
    from llmfleet.sim.trace import TraceError, builtin_workload, describe, read_trace, with_warmup, write_trace

    shaping = {
        "--workload": args.workload,
        "--duration": args.duration,
        "--rate-scale": args.rate_scale,
    }
    shapers = [flag for flag, value in shaping.items() if value is not None]
    if args.trace and shapers:
        print(
            f"{', '.join(shapers)} shape a built-in workload; a --trace is cut with --trace-start, "
            "--trace-duration and --thin"
        )
        return 2
    trace_flags = [flag for flag, value in _trace_flags(args).items() if value is not None]
    if trace_flags and not args.trace:
        print(f"{', '.join(trace_flags)} cut a --trace; a built-in workload is shaped with --duration, --rate-scale")
        return 2
    try:
        name, spec = read_service(args.file)
    except (OSError, ValueError, SpecError) as exc:
        print(f"cannot simulate {args.file}: {exc}")
        return 2
    model = spec.model.server_arg
    profile = Path(args.profile) if args.profile else default_profile_path(model)
    if not profile.exists():
        quick = " --quick" if model == "builtin:tiny" else ""
        print(
            f"no cost profile at {profile}: run `llm-fleet calibrate --model {model}{quick}` first, or pass --profile"
        )
        return 2
    try:
        cost = CostModel.load(profile)
        check_spec(spec, cost)
        options = trace_options(args)
        requests = read_trace(args.trace, options) if args.trace else []
    except PodConfigError as exc:
        print(f"cannot simulate {args.file} with the cost profile {profile}: {exc}")
        return 2
    except (TraceError, ValueError) as exc:
        print(exc)
        return 2
    workload = None
    if args.trace:
        cut = options.describe() if options else ""
        source = (
            f"trace {args.trace}"
            + (f" ({cut})" if cut else "")
            + f": {len(requests)} requests"
            + (f", reported after its first {args.warmup:g} s" if args.warmup else "")
        )
        label = Path(args.trace).stem
    else:
        label = args.workload or "bursty"
        workload = builtin_workload(label, args.duration, args.rate_scale or 1.0, args.seed)
        requests = with_warmup(workload, args.warmup)
        source = describe(workload) + (
            f", after a {args.warmup:g} s warm-up at its opening rate" if args.warmup else ""
        )
    problem = _nothing_measured(args, requests, workload) or _output_problem(args)
    if problem:
        print(problem)
        return 2
    if args.save_trace:
        write_trace(args.save_trace, requests)
    controller = args.controller or ("tuner" if spec.autotune.enabled else "fixed")
    if args.runs and controller != "tuner":
        print(f"--runs records the tuner's runs; the controller here is {controller}")
        return 2
    options = SimOptions(
        startup_s=args.startup_s,
        tail_s=args.tail_s,
        kv_transfer_bytes_per_s=args.kv_transfer_gbps * 1e9 / 8,
        record_runs=bool(args.runs),
    )
    print(f"== {name} ({spec.mode}, model {model}) on {source}")
    print(f"   cost profile {profile}: {cost.describe()}")
    if cost.model not in (model, "unknown"):
        print(
            f"   note: the profile was measured on {cost.model}, not {model}: the pods step, hold KV and "
            f"refuse long requests as {cost.model} does (calibrate {model} for its own)"
        )
    result = simulate(
        spec,
        cost,
        requests,
        controller=controller,
        options=options,
        name=name,
        hpa=HPAConfig(target_waiting_per_pod=args.hpa_target),
        measure_from=args.warmup,
    )
    result.notes["workload"] = source
    summary = summarize(result)
    print_summary(result, summary, args.decisions)
    out = Path(args.out)
    stem = f"sim-{name}-{label}-{controller}"
    json_path = write_json(result, out / f"{stem}.json", summary)
    try:
        png_path = save_plot(result, out / f"{stem}.png", f"{name} on {label}: {controller}")
    except ImportError:  # the plot is optional: matplotlib comes with the bench extra
        print(f"wrote {json_path} (no PNG: matplotlib is not installed; pip install 'llm-fleet[bench]' adds it)")
    else:
        print(f"wrote {json_path} and {png_path}")
    if args.runs:
        print(f"wrote {len(result.runs)} tuner runs to {write_runs(result, args.runs)}")
    return 0 if result.conserved else 1


def _trace_flags(args) -> dict[str, object]:
    return {
        "--trace-start": args.trace_start,
        "--trace-duration": args.trace_duration,
        "--thin": args.thin,
        "--max-prompt-tokens": args.max_prompt_tokens,
        "--max-output-tokens": args.max_output_tokens,
        "--trace-match": args.trace_match,
    }


def trace_options(args):
    """The ``TraceOptions`` the flags ask for, or None where they ask for the trace whole."""
    from llmfleet.sim.trace import TraceOptions

    if all(value is None for value in _trace_flags(args).values()) and args.seed is None:
        return None
    return TraceOptions(
        start_s=args.trace_start or 0.0,
        duration_s=args.trace_duration,
        thin=1.0 if args.thin is None else args.thin,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        seed=args.seed or 0,
        match=tuple(args.trace_match or ()),
    )


def _nothing_measured(args, requests, workload=None) -> str | None:
    """Why the run would judge no minute, or None: a built-in workload that generates no request,
    a --warmup that covers the whole trace. An attainment over no minutes is no result."""
    if workload is not None and not workload.requests():
        name = args.workload or "bursty"
        return f"{name} generates no requests: give it a longer --duration or a larger --rate-scale"
    last = requests[-1].arrival_s
    if last < args.warmup:
        return f"--warmup {args.warmup:g} covers the whole trace {args.trace} (its last arrival is at {last:g} s)"
    return None


def _output_problem(args) -> str | None:
    """Why the results could not be written, found before simulating, not after; or None."""
    from llmfleet.sim.paths import directory_problem, file_problem

    for flag, path in (("--save-trace", args.save_trace), ("--runs", args.runs)):
        problem = file_problem(path) if path else None
        if problem:
            return f"cannot write {flag} {path}: {problem}"
    problem = directory_problem(args.out)
    return f"cannot write --out {args.out}: {problem}" if problem else None
