"""The prefill servers a decode server may fetch KV from: the pool it was given at start
(``--prefill-url``, an ``--endpoints-file``'s prefill list, or ``--prefill-host``, the prefill
Service's DNS name), never an address a request names. A request names one of them by its URL,
which must equal one of the pool's exactly (the router writes them as the same sources do).

A decode server that fetched from any URL a request gave it would send the fleet's transfer token
there, and answer with what it found: a probe of the network behind it, and KV from anyone."""

from __future__ import annotations

import time

from llmfleet.server.wire.endpoints import EndpointSource, url

REFRESH_S = 1.0  # the pool read again at most this often (a URL it lacks forces no more lookups)


class PrefillPeers:
    """A decode server's prefill pool, as its source lists it, read again as servers come."""

    def __init__(self, source: EndpointSource | None, clock=time.monotonic) -> None:
        """``source``: where the pool's URLs come from; None, no pool: every transfer is refused."""
        self.source = source
        self.clock = clock
        self._known: frozenset[str] = frozenset()
        self._read_at: float | None = None

    @property
    def description(self) -> str:
        if self.source is None:
            return "none (no --prefill-url, --prefill-host or --endpoints-file)"
        return self.source.description

    async def knows(self, address: str) -> bool:
        """Whether ``address`` is one of the pool's prefill servers; the pool is read again when
        it is not, at most every ``REFRESH_S`` (a server that just became ready)."""
        if self.source is None:
            return False
        wanted = url(address)
        if wanted in self._known:
            return True
        now = self.clock()
        if self._read_at is not None and now - self._read_at < REFRESH_S:
            return False
        self._read_at = now
        self._known = frozenset(url(u) for u in (await self.source.fetch()).get("prefill", []))
        return wanted in self._known
