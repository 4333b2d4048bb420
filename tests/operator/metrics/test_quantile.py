"""bucket_quantile must give what PromQL's histogram_quantile gives on the same buckets."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmfleet.operator.metrics.quantile import bucket_deltas, bucket_quantile, parse_le

INF = math.inf
# 10 observations <= 0.1, 10 more <= 0.5, 10 more <= 1, none above
B = {0.1: 10.0, 0.5: 20.0, 1.0: 30.0, INF: 30.0}


@pytest.mark.parametrize(
    ("q", "buckets", "expected"),
    [
        (0.5, B, 0.1 + (0.5 - 0.1) * (5 / 10)),  # rank 15 lands in (0.1, 0.5], 5 of its 10
        (0.25, B, 0.1 * (7.5 / 10)),  # the first bucket starts at 0
        (1.0, B, 1.0),  # rank 30 is the top of (0.5, 1]
        (0.95, {0.1: 10.0, 0.5: 20.0, 1.0: 30.0, INF: 40.0}, 1.0),  # rank 38 in +Inf: the highest finite bound
        (0.0, {-1.0: 5.0, 0.0: 5.0, INF: 5.0}, -1.0),  # first bound <= 0 is returned as is
        (0.5, [(0.1, 4.0), (0.1, 6.0), (INF, 20.0)], 0.1),  # equal bounds (le="0.1", le="0.10") add up
        (0.5, {0.1: 10.0, 0.5: 9.0, 1.0: 30.0, INF: 30.0}, 0.5 + 0.5 * (5 / 20)),  # non-monotonic: made monotonic
        (0.5, [(INF, 30.0), (1.0, 30.0), (0.1, 10.0), (0.5, 20.0)], 0.3),  # order does not matter
    ],
)
def test_known_quantiles(q, buckets, expected) -> None:
    assert bucket_quantile(q, buckets) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("q", "buckets"),
    [
        (0.5, {0.1: 0.0, 1.0: 0.0, INF: 0.0}),  # no observations in the window
        (0.5, {0.1: 10.0, 1.0: 20.0}),  # no +Inf bucket
        (0.5, {INF: 20.0}),  # one bucket only
        (0.5, {}),
        (math.nan, B),
    ],
)
def test_undefined_is_nan(q, buckets) -> None:
    assert math.isnan(bucket_quantile(q, buckets))


def test_out_of_range_q() -> None:
    assert bucket_quantile(-0.1, B) == -INF
    assert bucket_quantile(1.1, B) == INF


def test_parse_le() -> None:
    assert parse_le("+Inf") == INF and parse_le("0.25") == 0.25 and parse_le("1.0") == 1.0


def test_bucket_deltas_and_resets() -> None:
    before = {0.1: 10.0, 1.0: 30.0, INF: 30.0}
    after = {0.1: 12.0, 1.0: 40.0, INF: 41.0}
    assert bucket_deltas(after, before) == {0.1: 2.0, 1.0: 10.0, INF: 11.0}
    restarted = {0.1: 1.0, 1.0: 2.0, INF: 2.0}  # the process restarted: its counts start over
    assert bucket_deltas(restarted, before) == restarted
    assert bucket_deltas(after, None) == after


@st.composite
def histograms(draw):
    bounds = sorted(set(draw(st.lists(st.floats(0.001, 100), min_size=1, max_size=12))))
    counts = draw(st.lists(st.integers(0, 1000), min_size=len(bounds) + 1, max_size=len(bounds) + 1))
    cumulative, total = {}, 0
    for bound, count in zip([*bounds, INF], counts, strict=True):
        total += count
        cumulative[bound] = float(total)
    return cumulative


@given(histograms(), st.floats(0, 1), st.floats(0, 1))
def test_monotone_in_q_and_within_the_finite_bounds(buckets, q1, q2) -> None:
    low, high = sorted((q1, q2))
    a, b = bucket_quantile(low, buckets), bucket_quantile(high, buckets)
    if buckets[INF] == 0:
        assert math.isnan(a) and math.isnan(b)
        return
    finite = [le for le in buckets if le != INF]
    for value in (a, b):
        assert math.isnan(value) or 0.0 <= value <= max(finite)
    if not (math.isnan(a) or math.isnan(b)):
        assert a <= b + 1e-12
