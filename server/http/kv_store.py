"""A prefill server's exported KV, held until a decode server fetches it (or it expires)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class HeldKV:
    token_ids: list[int]  # the prompt tokens the KV covers
    payload: memoryview  # all of their blocks
    expires: float

    @property
    def nbytes(self) -> int:
        return self.payload.nbytes


class KVExportStore:
    """A prefill server's exported KV, waiting for decode servers to fetch it.

    Each entry is taken once. Entries older than ``ttl_s`` are dropped, and past ``limit_bytes``
    the oldest go first: a decode server that comes too late gets 404 and its router retries the
    whole request, which is cheaper than letting abandoned transfers fill the host's memory."""

    def __init__(self, ttl_s: float = 60.0, limit_bytes: int = 2 << 30, clock=time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.limit_bytes = limit_bytes
        self.clock = clock
        self._held: OrderedDict[str, HeldKV] = OrderedDict()
        self.held_bytes = 0
        self.dropped = 0  # expired or evicted before anyone took them
        self._timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._held)

    def put(self, token_ids: list[int], payload: memoryview) -> str | None:
        """Hold ``payload``; its id, or None for KV larger than the whole store, which the decode
        server then computes itself (an id for KV already evicted would fail the request)."""
        if payload.nbytes > self.limit_bytes:
            self.dropped += 1
            return None
        kv_id = uuid.uuid4().hex
        entry = HeldKV(token_ids, payload, self.clock() + self.ttl_s)
        self._held[kv_id] = entry
        self.held_bytes += entry.nbytes
        self.expire()
        self._expire_later()
        return kv_id

    def get(self, kv_id: str) -> HeldKV | None:
        self.expire()
        return self._held.get(kv_id)

    def take(self, kv_id: str) -> HeldKV | None:
        self.expire()
        entry = self._held.pop(kv_id, None)
        if entry is not None:
            self.held_bytes -= entry.nbytes
        return entry

    def _expire_later(self) -> None:
        """Drop the oldest entry when its TTL runs out, though nothing touches the store then (no
        request, no scrape): an abandoned transfer must not pin host memory until the next one."""
        if self._timer is not None or not self._held:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # the store used outside a server (its tests): each call expires
            return
        oldest = next(iter(self._held.values()))
        self._timer = loop.call_later(max(0.0, oldest.expires - self.clock()) + 0.01, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.expire()
        self._expire_later()

    def expire(self) -> None:
        now = self.clock()
        while self._held:
            kv_id, oldest = next(iter(self._held.items()))
            if oldest.expires > now and self.held_bytes <= self.limit_bytes:
                return
            del self._held[kv_id]
            self.held_bytes -= oldest.nbytes
            self.dropped += 1


# --- the prefill side ------------------------------------------------------------------------------
