"""What one request weighs, for pricing a queue in replicas (and the load a queued pool offers):
the window's token rates over the requests they belong to.

Token counters count work as it is done; the request counter counts requests as they finish.
Once a pool has finished many requests the two agree on average (as many requests' tokens leave
the window half-done as came into it half-done), but while most of the requests it has seen are
still running (a start-up, the first minutes after a pool wakes) the window's tokens are mostly
theirs, and tokens per finished request read several times high. A queue's growth priced at
that buys pods several times over. So the running requests count too, by their share of all the
requests the pool has seen: fully while none has finished, not at all once finished requests
far outnumber them. The count of finished requests lives in ``TunerMemory``."""

from __future__ import annotations

from pydantic import BaseModel

from llmfleet.operator.metrics.source import PoolMetrics


class Finished(BaseModel):
    """How many requests a pool has finished since the tuner began watching it: the first
    window's, then its finished-request rate integrated run to run."""

    count: float = 0.0
    at: float | None = None

    def observe(self, m: PoolMetrics) -> None:
        if self.at is None:
            self.count, self.at = (m.request_rate or 0.0) * m.window_s, m.at
        elif m.at > self.at:
            self.count += (m.request_rate or 0.0) * min(m.at - self.at, m.window_s)
            self.at = m.at


def requests_per_s(m: PoolMetrics, finished: Finished) -> float | None:
    """Requests/s the window's token rates are spread over: those finished in it, and the running
    ones by their share of all the pool has seen (``running / (running + finished)``). None (or
    0) where the pool finished nothing in the window, as the finished rate alone gave."""
    if not m.request_rate:
        return m.request_rate
    running = m.running or 0.0
    if running <= 0:
        return m.request_rate
    share = running / (running + finished.count)
    return m.request_rate + running * share / m.window_s


def offered(m: PoolMetrics, rates: dict[str, float | None], requests_s: float | None) -> dict[str, float | None]:
    """The rates the load offers where a queue holds some of it back: each served rate plus the
    queue's growth in requests/s, each weighing the window's tokens over ``requests_s``
    (requests_per_s): arrivals are what the pods took plus what the queue kept. None where the
    queue's growth is unknown."""
    growth = m.waiting_growth_per_s
    if growth is None or not requests_s:
        return dict.fromkeys(rates)
    return {s: None if rate is None else max(rate + growth * rate / requests_s, 0.0) for s, rate in rates.items()}
