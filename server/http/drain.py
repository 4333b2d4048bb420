"""Graceful drain on SIGTERM/SIGINT: readiness fails and new requests get 503 at once, in-flight
streams finish (up to the drain timeout; then they are aborted and end cleanly), then uvicorn
stops and the process exits 0. A second signal stops immediately."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI

from llmfleet.server.gc_heap import freeze_startup_heap
from llmfleet.server.http.metrics_port import MetricsPortOnly
from llmfleet.server.http.state import ServerState
from llmfleet.server.wire.keepalive import SERVER_KEEP_ALIVE_S
from llmfleet.server.wire.parent import exit_with_parent

log = logging.getLogger("llmfleet.drain")

# uvicorn's own wait for connections after the drain: streams are already done by then
_SHUTDOWN_GRACE_S = 5.0

# After a drain timeout: the longest wait for the aborted requests' final events
_ABORT_GRACE_S = 5.0

# After the engine work is done: time for the last SSE bytes to leave the socket
_FLUSH_S = 0.2


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self.state.draining or self._loop is None:
            super().handle_exit(sig, frame)  # second signal (or not started): stop now
            return
        log.info("received %s: draining (up to %.0fs)", signal.Signals(sig).name, self.drain_timeout)
        self.state.draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await drain(self.state, self.drain_timeout)
            await asyncio.sleep(_FLUSH_S)
            log.info("drained; shutting down")
        finally:
            self.should_exit = True


async def drain(state: ServerState, timeout: float) -> int:
    """Wait until the engine has no request left (the caller has set ``state.draining``, so no
    new one comes in); past ``timeout`` abort the rest, whose streams then end cleanly.
    Returns how many were aborted."""
    engine = state.engine
    deadline = time.monotonic() + timeout
    if engine is None:  # the router: its calls end when the servers behind it answer
        while state.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return 0
    # Until the engine's work and the calls that bring it are done: a call accepted before the
    # drain may still be handing its later choices (n > 1, a list of prompts) to the engine.
    # Static batching launches whatever waits instead of holding it, flushed at every poll: the
    # scheduler's flush ends once its queue is empty, and such a choice comes after.
    while (engine.num_unfinished or state.in_flight) and time.monotonic() < deadline:
        engine.flush()
        await asyncio.sleep(0.05)
    if not engine.num_unfinished:
        await _hand_over_kv(state, deadline)
        return 0
    aborted = engine.abort_all()
    log.warning("drain timeout after %.0fs: aborted %d unfinished requests", timeout, aborted)
    # their final events come with the engine's next step; a bounded wait, so that no stream
    # that never ends could keep the process from exiting
    grace = time.monotonic() + _ABORT_GRACE_S
    while engine.num_unfinished and engine.alive and time.monotonic() < grace:
        await asyncio.sleep(0.05)
    return aborted


async def _hand_over_kv(state: ServerState, deadline: float) -> None:
    """A prefill server keeps serving the KV it computed until decode servers took it (or it
    expired), so that no request behind a router has to start over."""
    store = state.kv_store
    while store is not None and len(store) and time.monotonic() < deadline:
        store.expire()
        await asyncio.sleep(0.05)


def run_app(app: FastAPI, state: ServerState, args, on_exit: Callable[[], None] | None = None) -> int:
    """Serve ``app`` (``state``'s role) over HTTP until SIGTERM/SIGINT, then drain and return 0.
    With ``args.metrics_port``, the read-only paths are served on that port too (metrics_port.py)."""
    exit_with_parent()
    metrics_port = getattr(args, "metrics_port", 0) or 0
    served = MetricsPortOnly(app, metrics_port) if metrics_port else app

    def config(port: int) -> uvicorn.Config:
        return uvicorn.Config(
            served,
            host=args.host,
            port=port,
            log_level=uvicorn_log_level(args),
            access_log=False,
            timeout_graceful_shutdown=_SHUTDOWN_GRACE_S,
            timeout_keep_alive=SERVER_KEEP_ALIVE_S,  # longer than our clients pool connections
        )

    server = DrainingServer(config(args.port), state, args.drain_timeout)
    sockets = [server.config.bind_socket(), config(metrics_port).bind_socket()] if metrics_port else None
    frozen = freeze_startup_heap()  # everything is built: no full collection need walk it again
    logging.getLogger("llmfleet.serve").debug("froze %d start-up objects out of the collector's passes", frozen)
    try:
        server.run(sockets)
    finally:
        if on_exit is not None:
            on_exit()
    logging.getLogger("llmfleet.serve").info("exited cleanly")
    return 0


def uvicorn_log_level(args) -> str:
    """uvicorn's log level: ``--uvicorn-log-level`` where given, else ``--log-level``."""
    return (getattr(args, "uvicorn_log_level", None) or args.log_level).lower()
