"""`llm-fleet bench`: run a benchmark (contenders side by side, ratios printed, JSON + PNG)."""

from __future__ import annotations

HELP = (
    "run a benchmark: engine (offline-32 vs HF, decode ceiling, scheduler, online policies), server, "
    "disagg (colocated vs prefill/decode), router (load vs prefix routing on conversations), "
    "sim-fidelity (real engine vs simulator) "
    "or tuner (closed loop vs fixed configs vs HPA, simulated)"
)


def add_arguments(parser) -> None:
    from . import disagg_bench, router_bench, sim_fidelity, tuner_eval

    parser.add_argument(
        "which",
        nargs="?",
        default="engine",
        choices=["engine", "server", "disagg", "router", "sim-fidelity", "tuner"],
        help="benchmark",
    )
    parser.add_argument("--model", default="builtin:small", help="builtin:small (default), builtin:tiny or a path")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 where the CPU has it natively, else float32")
    parser.add_argument("--out", default="bench/results", help="directory for JSON and PNG")
    parser.add_argument("--device", help="engine bench: cpu (default) or cuda")
    parser.add_argument("--quick", action="store_true", help="a small version for smoke tests")
    parser.add_argument("--skip-hf", action="store_true", help="skip the HF contenders")
    parser.add_argument("--skip-online", action="store_true", help="skip the online policy comparison")
    parser.add_argument("--rate", type=float, default=1.0, help="online arrival rate, requests/s")
    parser.add_argument("--online-requests", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16, help="max_batch_size for the online policies")
    parser.add_argument("--clients", type=int, default=32, help="server bench: concurrent streaming clients")
    parser.add_argument("--port", type=int, default=0, help="server bench: port for the server (0: a free one)")
    parser.add_argument("--rounds", type=int, default=2, help="server bench: alternating rounds per contender")
    disagg_bench.add_arguments(parser)
    router_bench.add_arguments(parser)
    sim_fidelity.add_arguments(parser)
    tuner_eval.add_arguments(parser)


def run(args) -> int:
    if args.which == "server":
        from .server_bench import run as run_server

        return run_server(args)
    if args.which == "disagg":
        from .disagg_bench import run as run_disagg

        return run_disagg(args)
    if args.which == "router":
        from .router_bench import run as run_router

        return run_router(args)
    if args.which == "sim-fidelity":
        from .sim_fidelity import run as run_fidelity

        return run_fidelity(args)
    if args.which == "tuner":
        from .tuner_eval import run as run_tuner

        return run_tuner(args)
    from .engine_bench import run as run_engine

    return run_engine(args)
