"""`llm-fleet up`: run an InferenceService on this machine (the local fleet)."""

from __future__ import annotations

from llmfleet.arguments import LOG_LEVELS, bind_problem, port

HELP = "run an InferenceService file as a local fleet of server processes, with the tuner"
DEFAULT_SPEC = "default.yaml"  # packaged with llmfleet.local; the same file as examples/local.yaml


def add_arguments(parser) -> None:
    parser.add_argument(
        "service_file", nargs="?", metavar="FILE", help="InferenceService YAML, as -f (`up examples/local.yaml`)"
    )
    parser.add_argument("-f", "--file", help="InferenceService YAML (default: builtin:tiny, as examples/local.yaml)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port, default=8000, help="the client-facing OpenAI endpoint")
    parser.add_argument("--prometheus-url", help="read metrics from this Prometheus instead of scraping the servers")
    parser.add_argument("--run-dir", help="engine configs and server logs (default: a new temporary directory)")
    parser.add_argument("--no-tui", action="store_true", help="plain log lines instead of the live view")
    parser.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS)


def load_service(path: str | None) -> tuple[str, object]:
    """(name, parsed spec) of the first InferenceService in ``path`` (or the built-in default)."""
    from importlib import resources
    from pathlib import Path

    from llmfleet.operator.resource.service_file import read_service

    source = Path(path) if path else resources.files("llmfleet.local").joinpath(DEFAULT_SPEC)
    return read_service(source, "local")


def run(args) -> int:
    import asyncio
    import logging
    import os
    import sys
    import tempfile
    from pathlib import Path

    from llmfleet.local.fleet import LocalFleet
    from llmfleet.operator.resource.spec import SpecError, name_problem
    from llmfleet.server.wire.auth import API_KEY_ENV

    if args.service_file and args.file and args.service_file != args.file:
        print(f"error: two service files given: {args.service_file} and -f {args.file}", file=sys.stderr)
        return 2
    args.file = args.file or args.service_file
    try:
        name, spec = load_service(args.file)
    except SpecError as exc:
        print(f"error: {args.file}: {exc.reason}: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    problem = name_problem(name)  # it names processes, logs and the run directory, as Services on a cluster
    if problem:
        print(f"error: {args.file}: InferenceService {problem}", file=sys.stderr)
        return 2
    secret = spec.api_key_secret
    if secret is not None and not os.environ.get(API_KEY_ENV):
        print(
            f"error: {args.file}: spec.apiKeySecret names Secret {secret.name} (key {secret.key}), which a local "
            f"fleet cannot read: export {API_KEY_ENV}=<the key> to require it here",
            file=sys.stderr,
        )
        return 2
    busy = bind_problem(args.host, args.port)
    if busy:
        print(f"error: cannot serve on {args.host}:{args.port}: {busy}; pick another with --port", file=sys.stderr)
        return 2
    tui = not args.no_tui and sys.stdout.isatty()
    try:
        run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix=f"llm-fleet-{name}-"))
        run_dir.mkdir(parents=True, exist_ok=True)
        log_file = logging.FileHandler(run_dir / "fleet.log")  # also proves the directory writable
    except OSError as exc:
        print(f"error: --run-dir {args.run_dir or run_dir}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    handlers = [log_file] + ([] if tui else [logging.StreamHandler(sys.stdout)])
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(message)s", handlers=handlers, force=True)
    fleet = LocalFleet(name, spec, run_dir, args.port, host=args.host)
    try:
        return asyncio.run(_serve(fleet, args, tui))
    finally:
        fleet.stop(timeout=0)  # after a clean drain a no-op; after a crash no server outlives us


async def _serve(fleet, args, tui: bool) -> int:
    import asyncio
    import contextlib
    import logging
    import signal
    import sys

    from rich.console import Console
    from rich.live import Live

    from llmfleet.local.processes import StartFailed, reachable_url
    from llmfleet.local.terminal import detach_from_terminal
    from llmfleet.local.view import render
    from llmfleet.operator.metrics.prometheus import PrometheusSource
    from llmfleet.operator.metrics.scrape import ScrapeSource

    log = logging.getLogger("llmfleet.local")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per scrape and request is noise
    url = reachable_url(args.host, args.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    drain_s = fleet.spec.drain_seconds("router")  # the longest any pool's streams may take
    live = None  # the terminal view, once started

    # Ctrl-C, a kill, or the terminal going away (the servers run in sessions of their own, so a
    # hang-up reaches only us): all drain the fleet.
    def on_signal(sig: signal.Signals) -> None:
        if sig == signal.SIGHUP:
            # The terminal is gone: a write to it now fails (EIO), which would end this process
            # before the drain and cut every stream. Our output goes nowhere from here on.
            detach_from_terminal()
            if live is not None:
                live.console.quiet = True
        if stop.is_set() and sig != signal.SIGHUP:  # a second Ctrl-C, as for uvicorn and vLLM: stop now
            log.warning("stopping now, without waiting for the drain")
            fleet.hurry()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, on_signal, sig)

    prometheus = args.prometheus_url or fleet.spec.autotune.prometheus_url
    source = PrometheusSource(prometheus) if prometheus else ScrapeSource(fleet.scrape_targets)
    fleet.start()
    log.info("InferenceService %s: starting %s; logs and configs in %s", fleet.name, fleet.spec.mode, fleet.run_dir)
    log.info("Prometheus can scrape the servers through file_sd: %s", fleet.targets_file)
    announced = False
    console = Console()
    live = Live(render(fleet, url, console.height), console=console, refresh_per_second=2) if tui else None
    failure = None
    with live or contextlib.nullcontext():
        while not stop.is_set():
            try:
                # its polls block (a starting server may be slow to answer): off the loop signals are handled on
                await asyncio.to_thread(fleet.supervise)
            except StartFailed as exc:
                log.error("cannot start the fleet: %s", exc)
                failure = str(exc)
                break
            if not announced and fleet.serving():
                announced = True
                log.info(
                    "ready: %s (OpenAI API: send model=%r; %s/metrics is the router's, each server's is in %s)",
                    url,
                    fleet.served_name,
                    url,
                    fleet.targets_file,
                )
            if fleet.tune_due():
                try:
                    decision = await fleet.tune(source)
                    if not tui:
                        for line in decision.reasons:
                            log.info("tuner: %s", line)
                except Exception:  # a failed run holds: the next interval tries again
                    log.exception("tuner run failed")
            if live is not None:
                live.update(render(fleet, url, console.height))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
    log.info("draining the fleet (up to %d s)", drain_s)
    await asyncio.to_thread(fleet.stop, drain_s + 5)
    close = getattr(source, "aclose", None)
    if close is not None:
        await close()
    log.info("stopped")
    if failure is None:
        return 0
    if tui:  # the log went to a file: say why here too
        print(f"error: cannot start the fleet: {failure}", file=sys.stderr)
    return 1
