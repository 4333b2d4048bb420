"""Pool metrics from Prometheus's HTTP API (``/api/v1/query``), PromQL from promql.py.

All queries of one snapshot are evaluated at the same instant (``time=now``), concurrently. An
empty result is "no series" and NaN is "no observations in the window": both become ``None``
with a reason, never zero. A failed query makes the whole snapshot stale, as does a pool with no
pod reporting or whose newest sample is older than the policy allows, and so does a snapshot
whose queries have not all been answered within ``timeout_s`` (a Prometheus that answers after
30 s holds the tuner that long at most, not the 30 s times the queries queued behind it).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Callable
from typing import Any

import httpx

from llmfleet.operator.metrics import promql
from llmfleet.operator.metrics.source import (
    EMPTY_MEAN,
    LOAD_FIELDS,
    QUANTILE_FIELDS,
    RATE_FIELDS,
    PoolMetrics,
    PoolRef,
    StalenessPolicy,
    judge_staleness,
    stale_snapshot,
    trusted_quantiles,
)
from llmfleet.operator.resource.conditions import cut

DEFAULT_TIMEOUT_S = 5.0  # one snapshot's queries, all of them
ERROR_EXCERPT = 300  # characters of a Prometheus error's text kept in a message
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/?#]*@")  # up to the authority's last @


def redacted(url: str) -> str:
    """``url`` with any user and password in it replaced: it is shown in status and Events."""
    return _USERINFO.sub(r"\1***@", url)


class PrometheusError(RuntimeError):
    """A query Prometheus did not answer, or answered with an error."""


class PrometheusSource:
    """``MetricSource`` over a Prometheus server (or anything speaking its query API)."""

    def __init__(
        self,
        base_url: str,
        *,
        client: httpx.AsyncClient | None = None,
        policy: StalenessPolicy | None = None,
        clock: Callable[[], float] = time.time,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_concurrency: int = 8,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.shown_url = redacted(self.base_url)  # what messages, status and Events may show
        self.policy = policy or StalenessPolicy()
        self.timeout_s = timeout_s
        self._clock = clock
        self._own_client = client is None
        self._client = client or httpx.AsyncClient(timeout=timeout_s)
        self._limit = asyncio.Semaphore(max_concurrency)

    async def aclose(self) -> None:
        if self._own_client:
            await self._client.aclose()

    async def query(self, expr: str, at: float) -> list[tuple[dict[str, str], float]]:
        """Evaluate an instant query: a list of (labels, value), values as floats (NaN kept)."""
        async with self._limit:
            try:
                response = await self._client.post(
                    f"{self.base_url}/api/v1/query", data={"query": expr, "time": f"{at:.3f}"}
                )
            except (httpx.HTTPError, httpx.InvalidURL) as exc:  # a bad --prometheus-url: stale, not a crash
                raise PrometheusError(f"prometheus at {self.shown_url} unreachable: {exc!r}") from exc
        try:
            body = response.json()
        except ValueError:
            raise PrometheusError(f"prometheus answered {response.status_code} with a non-JSON body") from None
        if not isinstance(body, dict):
            raise PrometheusError(f"prometheus answered {response.status_code} with JSON that is not an API answer")
        if response.status_code != 200 or body.get("status") != "success":
            error = cut(str(body.get("error", "no error message")), ERROR_EXCERPT)  # it reaches status and Events
            raise PrometheusError(
                f"prometheus answered {response.status_code} {cut(str(body.get('errorType', '')), 40)}: "
                f"{error} (query: {expr})"
            )
        try:
            return _parse_result(body.get("data") or {})
        except (AttributeError, KeyError, IndexError, TypeError, ValueError) as exc:  # a proxy's or a fake's body
            raise PrometheusError(f"prometheus's answer to {expr} is malformed: {exc!r}") from None

    async def scalar(self, expr: str, at: float) -> float | None:
        """The single value of an aggregated query; None when it has no series."""
        rows = await self.query(expr, at)
        return rows[0][1] if rows else None

    async def snapshot(self, pool: PoolRef, window_s: float) -> PoolMetrics:
        now = self._clock()
        queries = promql.pool_queries(promql.pool_selector(pool), window_s, self.policy.max_sample_age_s)
        try:
            async with asyncio.timeout(self.timeout_s):
                answers = await asyncio.gather(
                    *(self.scalar(expr, now) for expr in queries.values()), return_exceptions=True
                )
        except TimeoutError:
            reason = f"prometheus at {self.shown_url} did not answer within {self.timeout_s:g} s"
            return stale_snapshot(pool, now, window_s, f"{pool.pool}: {reason}")
        failures = [a for a in answers if isinstance(a, BaseException)]
        if failures:
            if not all(isinstance(f, PrometheusError) for f in failures):
                raise next(f for f in failures if not isinstance(f, PrometheusError))
            return stale_snapshot(pool, now, window_s, f"{pool.pool}: {failures[0]}")
        values: dict[str, float | None] = dict(zip(queries, answers, strict=True))  # type: ignore[arg-type]
        return judge_staleness(self._assemble(pool, now, window_s, values), self.policy)

    def _assemble(self, pool: PoolRef, now: float, window_s: float, values: dict[str, float | None]) -> PoolMetrics:
        missing: dict[str, str] = {}
        fields: dict[str, Any] = {}
        for name in QUANTILE_FIELDS:
            quantiles = {q: values[f"{name}:{q:g}"] for q in promql.measured_quantiles(name)}
            fields[name] = trusted_quantiles(name, quantiles, values[f"{name}:samples"], self.policy, window_s, missing)
        for name in (*RATE_FIELDS, *LOAD_FIELDS):
            value = values[name]
            if value is None:
                missing[name] = f"{name}: no series"
            elif math.isnan(value):
                missing[name] = f"{name}: {EMPTY_MEAN[name]}" if name in EMPTY_MEAN else f"{name}: NaN"
                value = None
            fields[name] = value
        newest = values["newest_sample"]
        age = None if newest is None or math.isnan(newest) else max(0.0, now - newest)
        return PoolMetrics(
            pool=pool,
            at=now,
            window_s=window_s,
            ready_pods=int(values["ready_pods"] or 0),
            newest_sample_age_s=age,
            missing=missing,
            **fields,
        )


def _parse_result(data: dict[str, Any]) -> list[tuple[dict[str, str], float]]:
    kind, result = data.get("resultType"), data.get("result")
    if kind == "scalar":
        return [({}, float(result[1]))]  # type: ignore[index]
    if kind == "vector":
        return [(row.get("metric") or {}, float(row["value"][1])) for row in result or []]
    raise PrometheusError(f"expected an instant vector or scalar, got {kind!r}")
