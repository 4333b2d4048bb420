"""Process wiring for `llm-fleet serve`: engine, metrics, config watcher, app, uvicorn, drain.

Roles with a local engine (colocated today; prefill and decode later) share
:func:`local_engine_state`; every role, the router included, runs its app through
:func:`run_app`, which gives it the SIGTERM drain and exit code 0.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import uvicorn

from ..config import load_engine_config
from ..engine.build import build_engine
from .app import create_app
from .drain import DrainingServer
from .live_config import ConfigWatcher
from .state import ServerState

log = logging.getLogger("llmfleet.serve")

# uvicorn's own wait for connections after the drain: streams are already done by then
_SHUTDOWN_GRACE_S = 5.0

LOCAL_ENGINE_ROLES = ("colocated",)


def local_engine_state(args) -> tuple[ServerState, ConfigWatcher | None]:
    """Load the model, start the engine thread and, with ``--config``, the live-config watcher."""
    try:
        config = load_engine_config(args.config)
    except ValueError as exc:  # a bad file at start-up has no last good config to fall back on
        raise SystemExit(f"llm-fleet serve: {exc}") from exc
    engine, tokenizer = build_engine(args.model, config, device=args.device)
    state = ServerState.for_engine(engine, tokenizer, args.served_model_name or args.model, args.role)
    watcher = None
    if args.config:
        watcher = ConfigWatcher.for_engine(args.config, state.engine, state.metrics, initial=config)
        watcher.start()
    return state, watcher


def run_app(state: ServerState, args, on_exit: Callable[[], None] | None = None) -> int:
    """Serve ``state``'s role over HTTP until SIGTERM/SIGINT, then drain and return 0."""
    server = DrainingServer(
        uvicorn.Config(
            create_app(state),
            host=args.host,
            port=args.port,
            log_level=args.log_level.lower(),
            access_log=False,
            timeout_graceful_shutdown=_SHUTDOWN_GRACE_S,
        ),
        state,
        args.drain_timeout,
    )
    try:
        server.run()
    finally:
        if on_exit is not None:
            on_exit()
    log.info("exited cleanly")
    return 0


def serve(args) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.role not in LOCAL_ENGINE_ROLES:
        raise SystemExit(f"role {args.role!r} is not available yet in this build; use --role colocated")
    state, watcher = local_engine_state(args)

    def stop() -> None:
        if watcher is not None:
            watcher.stop()
        state.engine.shutdown()

    return run_app(state, args, on_exit=stop)
