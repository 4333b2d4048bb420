"""Which server takes the next request: a colocated server, or a prefill and a decode server.

The router keeps a table of the servers its endpoint source names, polls each one's ``/load``
(waiting and running requests, KV usage) twice a second, and counts the requests it has itself
sent there and not yet seen answered, and of those the ones whose first token it has not seen
yet. Its own counts are exact at every pick, where a poll is up to half a second old: a burst
spreads instead of landing on the server that looked idlest then. Polls add only what other
routers sent (the requests a server reports beyond this router's own).

A server that refuses a connection or fails a request (a timeout, a 5xx) is set aside until a
poll finds it well again; a busy server whose ``/load`` is merely slow is set aside only after
several slow polls in a row. Set-aside servers are still tried when a pool has nothing else (one
slow answer must not turn into a 503 for everyone), draining ones never. The policy that picks
among them is pluggable (policies.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import httpx

from llmfleet.server.router.load import Server
from llmfleet.server.router.policies import POLICIES, PrefixAffinity
from llmfleet.server.wire.endpoints import MODE_POOLS, EndpointSource

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.5
POLL_TIMEOUT_S = 2.0
SLOW_POLLS = 3  # timeouts in a row that set a server aside
DISCOVERY_INTERVAL_S = 1.0


class Balancer:
    """``mode``: ``colocated`` (one pool, each request relayed to one server) or
    ``disaggregated`` (a prefill and a decode pool)."""

    def __init__(
        self, source: EndpointSource, policy: str, client: httpx.AsyncClient, mode: str = "disaggregated"
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown router policy {policy!r}; known: {sorted(POLICIES)}")
        self.source = source
        self.mode = mode
        self.pools = MODE_POOLS[mode]
        self.policies = {pool: POLICIES[policy]() for pool in self.pools}
        self.reads_prefixes = any(isinstance(p, PrefixAffinity) for p in self.policies.values())
        self.client = client
        self.servers: dict[str, dict[str, Server]] = {pool: {} for pool in self.pools}
        self._tasks: list[asyncio.Task] = []
        self._polls: set[asyncio.Task] = set()

    @property
    def serving_pool(self) -> str:
        """The pool no request can be answered without: the colocated or the decode pool."""
        return self.pools[-1]

    # --- choosing ------------------------------------------------------------------------------
    def has_open(self, pool: str) -> bool:
        """Some server of ``pool`` takes new requests: known, not draining, and not refusing
        connections (a server that exited stays listed until its endpoint is withdrawn)."""
        return any(not (s.draining or s.unreachable) for s in self.servers[pool].values())

    def not_ready(self) -> str | None:
        """Why the router cannot serve now: it knows no server of its serving pool that takes
        requests. (A router that holds requests for an empty pool is ready regardless.)"""
        if self.has_open(self.serving_pool):
            return None
        return f"no {self.serving_pool} server is ready yet (servers from {self.source.description})"

    def pick(
        self, pool: str, exclude: set[str] = frozenset(), prefixes: Sequence[int] = (), healthy_only: bool = False
    ) -> Server | None:
        """The policy's choice among the healthy servers of ``pool`` not in ``exclude`` (for a
        prompt with these prefix hashes), else (unless ``healthy_only``) the set-aside one that
        failed least; None if every server is excluded or draining."""
        open_ = self._open(pool, exclude)
        healthy = [s for s in open_ if s.healthy]
        if healthy:
            return self.policies[pool](healthy, prefixes)
        if healthy_only or not open_:
            return None
        return min(open_, key=lambda s: (s.failures, s.url))

    def any_server(self, pool: str) -> Server | None:
        """A healthy server of ``pool``, for a question any of them answers (what model it serves),
        leaving the policy's state alone."""
        healthy = [s for s in self._open(pool) if s.healthy]
        return min(healthy, key=lambda s: s.url) if healthy else None

    def _open(self, pool: str, exclude: set[str] = frozenset()) -> list[Server]:
        """The servers of ``pool`` that take new requests (not draining), less ``exclude``."""
        return [s for s in self.servers[pool].values() if not s.draining and s.url not in exclude]

    async def pick_or_rediscover(
        self, pool: str, exclude: set[str] = frozenset(), prefixes: Sequence[int] = ()
    ) -> Server | None:
        """``pick``, and where it finds no server, once more after re-reading the endpoint source:
        a pool's last known server can be draining while its replacement, ready since the last
        discovery, is not in the table yet (a scale-down right after a scale-up)."""
        server = self.pick(pool, exclude, prefixes)
        if server is None:
            await self.refresh()
            server = self.pick(pool, exclude, prefixes)
        return server

    def failed(self, server: Server, why: str, unreachable: bool = False) -> None:
        """Set ``server`` aside until a poll finds it well; ``unreachable``: no connection to it
        could be made, so it no longer counts as open (requests for its pool may be held)."""
        server.failures += 1
        server.unreachable = server.unreachable or unreachable
        if server.healthy:
            log.warning("%s server %s set aside: %s", server.pool, server.url, why)
        server.healthy = False

    def snapshot(self) -> dict[str, list[dict]]:
        return {pool: [s.as_dict() for s in servers.values()] for pool, servers in self.servers.items()}

    # --- keeping the table current -------------------------------------------------------------
    async def refresh(self) -> None:
        """Apply the endpoint source's current lists (new servers in, departed ones out)."""
        endpoints = await self.source.fetch()
        for pool in self.pools:
            urls = set(endpoints.get(pool, []))
            table = self.servers[pool]
            for url in urls - table.keys():
                table[url] = Server(url, pool)
                log.info("%s server %s joined", pool, url)
            for url in table.keys() - urls:
                del table[url]
                log.info("%s server %s left", pool, url)

    async def recheck(self, servers: Sequence[Server]) -> None:
        """Poll ``servers`` now, not at their next turn: one that just failed a request may have
        exited, which only a poll tells from a failure of that request alone."""
        await asyncio.gather(*(self._read_load(server) for server in servers))

    async def poll(self) -> None:
        """Poll every server not still answering an earlier poll (a slow one holds up no other)."""
        servers = [s for table in self.servers.values() for s in table.values() if not s.polling]
        for server in servers:
            task = asyncio.create_task(self._poll_one(server))
            self._polls.add(task)
            task.add_done_callback(self._polls.discard)

    async def _poll_one(self, server: Server) -> None:
        server.polling = True
        try:
            await self._read_load(server)
        finally:
            server.polling = False

    async def _read_load(self, server: Server) -> None:
        try:
            response = await self.client.get(f"{server.url}/load", timeout=httpx.Timeout(POLL_TIMEOUT_S, connect=1.0))
            response.raise_for_status()
            load = response.json()
        except httpx.TimeoutException as exc:  # busy, or stopped: only a streak of them counts
            server.slow_polls += 1
            if server.slow_polls >= SLOW_POLLS:
                server.poll_failures += 1
                self.failed(server, f"/load timed out {server.slow_polls} times in a row: {exc!r}")
            return
        except (httpx.HTTPError, ValueError) as exc:
            server.poll_failures += 1
            self.failed(server, f"/load: {exc!r}", unreachable=never_reached(exc))
            return
        server.slow_polls = 0
        server.unreachable = False
        server.draining = bool(load.get("draining", False))
        server.waiting = int(load.get("waiting", 0))
        server.running = int(load.get("running", 0))
        server.kv_usage = float(load.get("kv_usage", 0.0))
        # what this router sent is counted at every pick; a request in flight between the two
        # counts makes the difference low, never high: a lone router's others stay 0
        server.others = max(0, server.waiting + server.running - server.assigned)
        server.polled_at = time.monotonic()
        if not server.healthy:
            log.info("%s server %s is back", server.pool, server.url)
        server.healthy = True

    async def start(self) -> None:
        await self.refresh()
        await self.poll()
        await asyncio.gather(*self._polls)  # route on measured load from the first request
        self._tasks = [
            asyncio.create_task(self._every(DISCOVERY_INTERVAL_S, self.refresh)),
            asyncio.create_task(self._every(POLL_INTERVAL_S, self.poll)),
        ]

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._polls]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    async def _every(seconds: float, job) -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                await job()
            except Exception:  # the router keeps routing on the last good table
                log.exception("router background job failed")


def never_reached(exc: Exception) -> bool:
    """No connection could be made: the request never reached the server."""
    return isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
