"""How the tuner bench scores a run: minutes met with and without those an unannounced step
explains, the cheapest contender that reaches an attainment, the oracle lower bound, and how
long replicas stayed above what demand needed after it fell."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def step_minutes(steps: Sequence[float], measure_from: float, minutes: int, excused_s: float) -> set[int]:
    """Minutes (counted from ``measure_from``) that overlap ``[step, step + excused_s]`` for a
    step the trace gives no warning of: pod start-up plus one interval after it, which no
    reactive controller can cover."""
    out = set()
    for step in steps:
        start, end = step - measure_from, step - measure_from + excused_s
        out |= {m for m in range(minutes) if m * 60.0 < end and (m + 1) * 60.0 > start}
    return out


def attainment(met: Sequence[bool | None], excluded: set[int] = frozenset()) -> tuple[int, int]:
    """(minutes met, minutes judged), leaving out minutes without traffic and ``excluded``."""
    judged = [ok for m, ok in enumerate(met) if ok is not None and m not in excluded]
    return sum(1 for ok in judged if ok), len(judged)


def judged_minutes(
    per_minute: Sequence[bool | None], steps: Sequence[float], measure_from: float, excused_s: float
) -> dict[str, int]:
    """Minutes met of those judged, leaving out those ``excused_s`` after an unannounced step
    (step_minutes), and those step minutes on their own."""
    excused = step_minutes(steps, measure_from, len(per_minute), excused_s)
    met, judged = attainment(per_minute, excused)
    step_met, step_judged = attainment([ok if m in excused else None for m, ok in enumerate(per_minute)])
    return {"met": met, "judged": judged, "step_met": step_met, "step_judged": step_judged}


def reaches(minutes: dict[str, int], target: float) -> bool:
    """Whether the judged minutes (judged_minutes) meet the attainment ``target``."""
    return minutes["judged"] == 0 or minutes["met"] / minutes["judged"] >= target


def cheapest_reaching(runs: Sequence[dict[str, Any]], minutes_met: int) -> dict[str, Any] | None:
    """The run with the fewest replica-minutes among those meeting at least ``minutes_met``."""
    reaching = [r for r in runs if r["slo_minutes_met"] >= minutes_met]
    return min(reaching, key=lambda r: r["replica_minutes"]) if reaching else None


def oracle(
    runs: Sequence[dict[str, Any]],
    minutes: int,
    startup_s: float,
    least: int,
    most: int,
    span_minutes: float | None = None,
) -> tuple[float, list[int]]:
    """The oracle lower bound: per minute, the fewest replicas any fixed run met that minute
    with (a knob set's runs above the count that met every minute meet every minute too), as if
    replicas could change each minute with perfect foresight; each added pod paid from a start-up
    before its minute. Minutes no run met take ``most``, minutes without traffic ``least``.

    ``span_minutes`` is the measured time the runs compared with it paid for (from the warm-up's
    end until their last request finished): a last minute cut short pays its part, and the drain
    after the last minute is paid at that minute's count, as any fleet keeps its pods until its
    requests finish. Without it, every minute is paid whole. Returns (replica-minutes, the count
    per minute)."""
    counts = []
    for m in range(minutes):
        met = [r["replicas_total"] for r in runs if m < len(r["per_minute"]) and r["per_minute"][m] is not False]
        quiet = all(m >= len(r["per_minute"]) or r["per_minute"][m] is None for r in runs)
        counts.append(least if quiet else min(met, default=most))
    span = float(minutes) if span_minutes is None else span_minutes
    paid = [min(max(span - m, 0.0), 1.0) for m in range(minutes)]
    if paid:
        paid[-1] = max(span - (minutes - 1), 0.0)  # the last minute and the drain after it
    rm = sum(n * share for n, share in zip(counts, paid, strict=True))
    previous = counts[0] if counts else 0
    for n in counts[1:]:
        rm += max(0, n - previous) * startup_s / 60.0
        previous = n
    return rm, counts


def scale_down_lag(needed: Sequence[tuple[float, dict[str, tuple[int, float]]]], measure_from: float) -> float:
    """The longest a pool held more replicas than its own demand estimate (and latency floor)
    had last asked for: at each run, the time since a run whose needed count was at least the
    replicas held now. 0 where replicas never exceeded need."""
    worst = 0.0
    pools = {pool for _, per in needed for pool in per}
    for pool in pools:
        series = [(t, per[pool]) for t, per in needed if pool in per]
        for i, (t, (replicas, _)) in enumerate(series):
            if t < measure_from:
                continue
            since = next((s for s, (_, need) in reversed(series[: i + 1]) if need >= replicas), series[0][0])
            worst = max(worst, t - since)
    return worst
