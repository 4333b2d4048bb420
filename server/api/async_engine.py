"""Runs the engine loop in its own thread so the event loop never blocks on a forward pass.

All engine calls happen on that thread. The asyncio side sends commands (add, abort, new
config) through a queue and gets, per request, an ``asyncio.Queue`` of ``RequestOutput``
events, filled as tokens are produced.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from ..config import EngineConfig
from ..core.request import SamplingParams
from ..engine.engine import EngineStats, LLMEngine, RequestOutput, StepFailedError

log = logging.getLogger(__name__)

StepObserver = Callable[[LLMEngine, list[RequestOutput]], None]


@dataclass
class _Command:
    kind: str  # add | abort | config | flush
    args: tuple
    done: concurrent.futures.Future | None = None


class AsyncEngine:
    def __init__(self, engine: LLMEngine, observers: list[StepObserver] | None = None) -> None:
        self.engine = engine
        self.observers = list(observers or [])
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmfleet-engine", daemon=True)
        self.config_observers: list[Callable[[LLMEngine], None]] = []
        self.stats: EngineStats = engine.stats()
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    # --- asyncio side ---------------------------------------------------------------------------
    async def add(
        self, request_id: str, prompt: list[int], sampling: SamplingParams, priority: int = 0
    ) -> asyncio.Queue:
        """Submit a request; raises the engine's InvalidRequestError / QueueFullError."""
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        try:
            await self._call("add", request_id, prompt, sampling, priority)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return stream

    async def generate(
        self, request_id: str, prompt: list[int], sampling: SamplingParams, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        stream = await self.add(request_id, prompt, sampling, priority)
        finished = False
        try:
            while not finished:
                event: RequestOutput = await stream.get()
                finished = event.finished
                yield event
        finally:
            if not finished:  # the client went away: free the KV now
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._send(_Command("abort", (request_id,)))

    async def update_config(self, config: EngineConfig) -> list[str]:
        return await self._call("config", config)

    def update_config_threadsafe(self, config: EngineConfig) -> concurrent.futures.Future:
        """From any thread (the config watcher): apply at the engine's next step."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_Command("config", (config,), done))
        return done

    def flush(self) -> None:
        self._send(_Command("flush", ()))

    async def _call(self, kind: str, *args):
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_Command(kind, args, done))
        return await asyncio.wrap_future(done)

    def _send(self, command: _Command) -> None:
        if not self.alive:
            if command.done is not None:
                command.done.set_exception(RuntimeError("engine is not running"))
            return
        self._commands.put(command)
        self._wake.set()

    # --- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if engine.has_unfinished_requests():
                    try:
                        events = engine.step()
                    except StepFailedError:
                        log.exception("engine step failed; its requests were aborted")
                        continue
                    self.stats = engine.stats()
                    for observer in self.observers:
                        observer(engine, events)
                    self._deliver(events)
                    if events or engine.scheduler.num_running:
                        continue
                # nothing runnable: sleep until a command arrives or a batching timer fires
                wake = engine.next_wakeup()
                timeout = None if wake is None else max(0.0, wake - engine.clock())
                if not engine.has_unfinished_requests():
                    timeout = None
                self._wake.wait(timeout if timeout is not None else 0.5)
                self._wake.clear()
        except BaseException as exc:  # surface to /health instead of dying silently
            self.error = exc
            log.exception("engine loop crashed")
            self._fail_all(exc)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                result = self._apply(command)
            except Exception as exc:
                if command.done is not None:
                    command.done.set_exception(exc)
                continue
            if command.done is not None:
                command.done.set_result(result)

    def _apply(self, command: _Command):
        engine = self.engine
        if command.kind == "add":
            request_id, prompt, sampling, priority = command.args
            engine.add_request(request_id, prompt, sampling, priority=priority, arrival_time=engine.clock())
            self.stats = engine.stats()
            return None
        if command.kind == "abort":
            return engine.abort_request(*command.args)
        if command.kind == "config":
            ignored = engine.update_config(*command.args)
            if ignored:
                log.warning("restart-only fields changed and were ignored until restart: %s", ignored)
            self.stats = engine.stats()
            for observer in self.config_observers:
                observer(engine)
            return ignored
        if command.kind == "flush":
            return engine.flush()
        raise ValueError(f"unknown command {command.kind}")

    def _deliver(self, events: list[RequestOutput]) -> None:
        for event in events:
            target = self._streams.get(event.request_id)
            if target is None:
                continue
            loop, stream = target
            if event.finished:
                self._streams.pop(event.request_id, None)
            loop.call_soon_threadsafe(stream.put_nowait, event)

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for rid, (loop, stream) in streams.items():
            loop.call_soon_threadsafe(stream.put_nowait, _error_event(rid))


def _error_event(request_id: str) -> RequestOutput:
    from ..engine.engine import RequestMetrics

    now = time.monotonic()
    return RequestOutput(request_id, [], "", True, "abort", 0, 0, None, RequestMetrics(now))
