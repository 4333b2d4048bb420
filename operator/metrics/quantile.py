"""Quantiles from cumulative histogram buckets, computed exactly as PromQL's ``histogram_quantile``.

Used by the direct-scrape source on bucket deltas between two scrapes, so both metric sources
agree on the same data. Port of Prometheus's ``bucketQuantile`` (promql/quantile.go):
- buckets are sorted by upper bound; the last must be ``+Inf`` or the result is NaN;
- buckets with the same bound are merged, and counts made monotonic (float precision drift);
- no observations gives NaN; a rank that lands in the ``+Inf`` bucket returns the highest
  finite bound; inside a bucket the value is interpolated linearly (the first bucket starts at 0
  unless its bound is <= 0).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

Buckets = Mapping[float, float]  # upper bound (le) -> cumulative count


def parse_le(text: str) -> float:
    """Bucket bounds as the text format writes them: '0.1', '1.0', '+Inf'."""
    return math.inf if text in ("+Inf", "Inf", "inf", "+inf") else float(text)


def bucket_quantile(q: float, buckets: Buckets | Iterable[tuple[float, float]]) -> float:
    """The q-quantile of cumulative buckets, with PromQL's semantics (NaN when undefined)."""
    pairs = sorted(dict(buckets).items() if isinstance(buckets, Mapping) else buckets)
    if math.isnan(q):
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    if not pairs or not math.isinf(pairs[-1][0]):
        return math.nan
    merged = _coalesce(pairs)
    _ensure_monotonic(merged)
    if len(merged) < 2:
        return math.nan
    observations = merged[-1][1]
    if observations == 0:
        return math.nan
    rank = q * observations
    index = next(i for i in range(len(merged) - 1) if merged[i][1] >= rank) if merged[-2][1] >= rank else None
    if index is None:  # the rank lies in the +Inf bucket
        return merged[-2][0]
    if index == 0 and merged[0][0] <= 0:
        return merged[0][0]
    start, end, count = 0.0, merged[index][0], merged[index][1]
    if index > 0:
        start = merged[index - 1][0]
        count -= merged[index - 1][1]
        rank -= merged[index - 1][1]
    if count == 0:  # only for q == 0 over an empty first bucket: 0/0 in Go
        return math.nan
    return start + (end - start) * (rank / count)


def bucket_deltas(current: Buckets, previous: Buckets | None) -> dict[float, float]:
    """Observations between two scrapes of one cumulative histogram.

    A counter reset (any bucket went down, i.e. the process restarted) makes the current
    buckets the delta, as Prometheus's ``rate`` does; a histogram absent before counts from 0.
    """
    if not previous:
        return dict(current)
    if any(value < previous.get(le, 0.0) for le, value in current.items()):
        return dict(current)
    return {le: value - previous.get(le, 0.0) for le, value in current.items()}


def _coalesce(pairs: list[tuple[float, float]]) -> list[list[float]]:
    merged: list[list[float]] = []
    for bound, count in pairs:
        if merged and merged[-1][0] == bound:
            merged[-1][1] += count
        else:
            merged.append([bound, count])
    return merged


def _ensure_monotonic(merged: list[list[float]]) -> None:
    highest = -math.inf
    for bucket in merged:
        if bucket[1] < highest:
            bucket[1] = highest
        else:
            highest = bucket[1]
