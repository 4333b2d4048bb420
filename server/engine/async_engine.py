"""Runs the engine loop in its own thread so the event loop never blocks on a forward pass.

All engine calls happen on that thread. The asyncio side sends commands (add, abort, new
config) through a queue and gets, per request, an ``asyncio.Queue`` of ``RequestOutput``
events, filled as tokens are produced. With nothing runnable the thread sleeps until a command
arrives or the engine's next timer (``next_wakeup``: a batch window closing) fires.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from llmfleet.server.config import EngineConfig
from llmfleet.server.core.kv_wire import KVImport
from llmfleet.server.core.request import SamplingParams
from llmfleet.server.engine.engine import EngineStats, LLMEngine, RequestOutput, StepFailedError

log = logging.getLogger(__name__)

# Upper bound on an idle sleep while requests wait: a safety net for any admission rule whose
# wake-up the engine cannot predict; commands and engine timers wake the loop sooner.
_IDLE_POLL_S = 0.5

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
        self._client_aborts: set[str] = set()  # engine thread: aborted for their clients, final event to come

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def now(self) -> float:
        """The engine's clock (thread-safe for the default monotonic clock)."""
        return self.engine.clock()

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def cached_prefix_blocks(
        self, token_ids: list[int], salt: str | None = None, prompt_tokens: int | None = None
    ) -> int:
        """Leading full blocks of ``token_ids`` (the first of a prompt of ``prompt_tokens``) in the
        prefix cache now. A hint read while the engine runs, without a round trip to its thread:
        the scheduler checks again at admission."""
        return self.engine.block_manager.cached_prefix_blocks(token_ids, salt, prompt_tokens)

    # --- asyncio side ---------------------------------------------------------------------------
    async def add(
        self,
        request_id: str,
        prompt: list[int],
        sampling: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        stream: asyncio.Queue | None = None,
        kv_import: KVImport | None = None,
        export_kv: bool = False,
    ) -> asyncio.Queue:
        """Submit a request; raises the engine's InvalidRequestError / QueueFullError.

        Returns the queue its ``RequestOutput`` events arrive on: ``stream`` when given (several
        requests can share one), else a new one. ``priority``: larger is served first (the
        engine's convention). ``arrival_time`` (engine clock) is when the HTTP request arrived,
        so TTFT and queue time include tokenization and the hop to the engine thread.
        """
        if arrival_time is None:
            arrival_time = self.now()
        if stream is None:
            stream = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        try:
            await self._call("add", request_id, prompt, sampling, priority, arrival_time, kv_import, export_kv)
        except asyncio.CancelledError:  # the client left while the engine took the request
            self._streams.pop(request_id, None)
            self.abort(request_id)
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return stream

    async def generate(
        self,
        request_id: str,
        prompt: list[int],
        sampling: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """One request's events as an async stream; leaving the loop early aborts it."""
        stream = await self.add(request_id, prompt, sampling, priority, arrival_time)
        finished = False
        try:
            while not finished:
                event: RequestOutput = await stream.get()
                finished = event.finished
                yield event
        finally:
            if not finished:  # the client went away: free the KV now
                self.abort(request_id)

    def abort(self, request_id: str, by_client: bool = True) -> None:
        """Thread-safe; the request's KV is freed before the engine's next step. ``by_client``: the
        API gives up on it for its client (gone, or its call refused), and its final event says so
        (``client_aborted``: the metrics leave it out, as vLLM does); False: the server ends it."""
        self._send(_Command("abort", (request_id, by_client)))

    def abort_all(self) -> int:
        """Abort every request this engine is serving (drain timeout); returns how many."""
        ids = list(self._streams)
        for request_id in ids:
            self.abort(request_id, by_client=False)
        return len(ids)

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
                # clear before reading commands: one that lands after this wakes the wait below
                self._wake.clear()
                self._drain_commands()
                timeout: float | None = None
                if engine.has_unfinished_requests():
                    try:
                        events = engine.step()
                    except StepFailedError:
                        log.exception("engine step failed; its requests were aborted")
                        continue
                    self.stats = engine.stats()
                    self._mark_client_aborts(events)
                    self._observe(events)
                    self._deliver(events)
                    if events or engine.scheduler.num_running or engine.batches_in_flight:
                        continue
                    # waiting work that cannot run yet (a batch filling up, a timeout window):
                    # sleep until the engine's timer, a command, or a safety poll
                    wake = engine.next_wakeup()
                    timeout = _IDLE_POLL_S if wake is None else min(_IDLE_POLL_S, max(0.0, wake - engine.clock()))
                self._wake.wait(timeout)
        except BaseException as exc:  # surface to /health instead of dying silently
            self.error = exc
            log.exception("engine loop crashed")
            self._fail_all(exc)
            self._fail_commands()

    def _mark_client_aborts(self, events: list[RequestOutput]) -> None:
        if self._client_aborts:
            for event in events:
                if event.finished and event.request_id in self._client_aborts:
                    self._client_aborts.discard(event.request_id)
                    event.client_aborted = True

    def _observe(self, events: list[RequestOutput]) -> None:
        for observer in self.observers:
            try:
                observer(self.engine, events)
            except Exception:  # metrics must never stop the engine
                log.exception("step observer failed")

    def _queued(self) -> Iterator[_Command]:
        """The commands waiting, in order. One whose caller gave up (a client gone while its
        request was handed over) has a cancelled future: it is skipped (its abort follows), and
        no result may be set on it."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command.done is None or command.done.set_running_or_notify_cancel():
                yield command

    def _drain_commands(self) -> None:
        for command in self._queued():
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
            request_id, prompt, sampling, priority, arrival_time, kv_import, export_kv = command.args
            engine.add_request(
                request_id,
                prompt,
                sampling,
                priority=priority,
                arrival_time=arrival_time,
                kv_import=kv_import,
                export_kv=export_kv,
            )
            self.stats = engine.stats()
            return None
        if command.kind == "abort":
            request_id, by_client = command.args
            aborted = engine.abort_request(request_id)
            if aborted and by_client:  # not one the server ended first (nor one already finished)
                self._client_aborts.add(request_id)
            return aborted
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
        # one hop per event loop per step, not per event: 32 streams cost one wake-up
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for event in events:
            target = self._streams.get(event.request_id)
            if target is None:
                continue
            loop, stream = target
            if event.finished:
                self._streams.pop(event.request_id, None)
            batches.setdefault(loop, []).append((stream, event))
        for loop, items in batches.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody is listening
                loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for rid, (loop, stream) in streams.items():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stream.put_nowait, _error_event(rid))

    def _fail_commands(self) -> None:
        """Commands sent before the crash would otherwise wait forever (an ``add`` is a client's)."""
        for command in self._queued():
            if command.done is not None:
                command.done.set_exception(RuntimeError("engine is not running"))


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for stream, event in items:
        stream.put_nowait(event)


def _error_event(request_id: str) -> RequestOutput:
    from llmfleet.server.engine.engine import RequestMetrics

    now = time.monotonic()
    return RequestOutput(request_id, [], "", True, "abort", 0, 0, None, RequestMetrics(now))
