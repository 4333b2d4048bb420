"""Requests held while the pool they need has no server: a pool scaled to zero, or a gap in a
rollout.

A request that finds no server of the router's serving pool taking requests waits here instead
of failing, up to ``max_held`` requests and ``timeout_s`` each; past either it gets a 503 with
Retry-After. The first one asks for servers at once (``Waker``), and again every few seconds
while requests wait; meanwhile the endpoint source is re-read four times a second, so held
requests go the moment a server is ready. The time from the first held request to that moment is
the cold start the router measures (``llmfleet_router_cold_start_seconds``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass

from fastapi.responses import Response

from llmfleet.server.http.errors import error_response
from llmfleet.server.router.balancer import Balancer
from llmfleet.server.router.router_metrics import RouterMetrics
from llmfleet.server.router.wake import NoWaker, Waker

log = logging.getLogger(__name__)

REDISCOVER_S = 0.25  # how often the endpoint source is read while requests wait
WAKE_EVERY_S = 5.0  # how often the waker is asked again while they wait


@dataclass(frozen=True)
class HoldSettings:
    timeout_s: float = 0.0  # how long one request may wait for a server; 0: a 503 at once
    max_held: int = 256  # requests waiting at once; more get a 503 at once

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0


class Holding:
    def __init__(
        self, balancer: Balancer, settings: HoldSettings, metrics: RouterMetrics, waker: Waker | None = None
    ) -> None:
        self.balancer = balancer
        self.settings = settings
        self.metrics = metrics
        self.waker = waker or NoWaker()
        self.held = 0
        self.last_cold_start_s: float | None = None
        self._arrived = asyncio.Event()
        self._watch: asyncio.Task | None = None

    async def wait(self, pool: str) -> Response | None:
        """None once ``pool`` has a server that takes requests (at once if it has one); else the
        503 for the client."""
        if self.balancer.has_open(pool) or not self.settings.enabled:
            return None
        if self.held >= self.settings.max_held:
            self.metrics.held_refused("full")
            return error_response(
                503, f"{self.held} requests already wait for a {pool} server; retry later", "unavailable"
            )
        self.held += 1
        self.metrics.held(self.held, new=True)
        if self._watch is None:
            self._watch = asyncio.create_task(self._wait_for_servers(pool))
        arrived = self._arrived
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                await arrived.wait()
        except TimeoutError:
            self.metrics.held_refused("timeout")
            message = f"no {pool} server became ready within {self.settings.timeout_s:g} s; retry later"
            return error_response(503, message, "unavailable")
        finally:
            self.held -= 1
            self.metrics.held(self.held)
        return None

    async def _wait_for_servers(self, pool: str) -> None:
        """Ask for servers, re-read the endpoint source until one takes requests, release the held
        requests. Ends early once nobody waits any more (each timed out or left)."""
        started = time.monotonic()
        log.info("no %s server: holding requests and asking for servers (%s)", pool, self.waker.description)
        asked = -math.inf
        try:
            while not self.balancer.has_open(pool):
                if self.held == 0:
                    return
                if time.monotonic() - asked >= WAKE_EVERY_S:
                    asked = time.monotonic()
                    await self.waker.wake()
                await asyncio.sleep(REDISCOVER_S)
                try:
                    await self.balancer.refresh()
                except Exception:  # the source's trouble: keep waiting on the last good table
                    log.exception("reading the endpoint source failed")
            seconds = time.monotonic() - started
            self.last_cold_start_s = seconds
            self.metrics.cold_start(seconds)
            log.info("a %s server is ready after %.2f s: releasing %d held requests", pool, seconds, self.held)
        finally:
            self._arrived.set()
            self._arrived = asyncio.Event()
            self._watch = None

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
