"""Process wiring for `llm-fleet serve`: engine, metrics, config watcher, app, uvicorn, drain."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import uvicorn

from ..config import load_engine_config
from ..engine.build import build_engine
from .app import ServerState, create_app
from .async_engine import AsyncEngine
from .live_config import ConfigWatcher
from .metrics import ServerMetrics

log = logging.getLogger("llmfleet.serve")


class DrainingServer(uvicorn.Server):
    """SIGTERM/SIGINT drain instead of stopping at once: readiness fails, new requests get
    503, in-flight streams finish (up to the drain timeout), then the process exits 0.
    A second signal stops immediately."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self.state.draining or self._loop is None:
            super().handle_exit(sig, frame)
            return
        log.info("received %s: draining (up to %.0fs)", signal.Signals(sig).name, self.drain_timeout)
        self.state.draining = True
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        self.state.engine.flush()  # static batching: launch whatever waits
        deadline = time.monotonic() + self.drain_timeout
        while self.state.engine.num_unfinished and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = self.state.engine.num_unfinished
        if left:
            log.warning("drain timeout: %d requests unfinished", left)
        await asyncio.sleep(0.2)  # let the last SSE bytes flush
        self.should_exit = True


def serve(args) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.role != "colocated":
        raise SystemExit(f"role {args.role!r} is not available yet in this build; use --role colocated")
    config = load_engine_config(args.config)
    engine, tokenizer = build_engine(args.model, config, device=args.device)
    name = args.served_model_name or args.model
    metrics = ServerMetrics(name, args.role)
    metrics.set_config(engine.config, engine.config_generation, engine.runner.num_kv_blocks)
    async_engine = AsyncEngine(engine, observers=[metrics.on_step])
    async_engine.config_observers.append(
        lambda e: metrics.set_config(e.config, e.config_generation, e.runner.num_kv_blocks)
    )
    async_engine.start()
    state = ServerState(async_engine, tokenizer, name, engine.runner.max_model_len, metrics, role=args.role)
    watcher = None
    if args.config:
        watcher = ConfigWatcher(
            args.config,
            apply=async_engine.update_config_threadsafe,
            on_error=lambda _: metrics.lab(metrics.config_errors).inc(),
        )
        watcher.start()
    app = create_app(state)
    server = DrainingServer(
        uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False),
        state,
        args.drain_timeout,
    )
    try:
        server.run()
    finally:
        if watcher is not None:
            watcher.stop()
        async_engine.shutdown()
    return 0
