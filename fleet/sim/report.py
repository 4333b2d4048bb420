"""What a simulation run comes to: SLO attainment per minute, goodput, replica-minutes, decision
history; printed, as JSON, and as a PNG plot of latency, replicas and knobs over time.

- **Per minute** (of the trace, by arrival): the p95 TTFT of the requests that arrived in the
  minute (a request rejected, aborted, or never answered counts as an infinite TTFT), and the p95
  of the inter-token gaps that ended in it (the last minute also takes the gaps of the requests
  still streaming after it). The minute meets the SLOs when both are within them.
  Minutes without traffic are left out of the attainment; a run with no minute judged has no
  attainment (None), not a perfect one.
- **Goodput** (DistServe): requests whose TTFT and TPOT are both within the SLOs (the TPOT
  target is the ITL SLO), per second of the trace (of the run, where every request arrives at once).
- **Direction changes**: per controlled quantity, the most reversals (up then down, or down
  then up) within any stabilization window (the spec's ``scaleDownStabilizationSeconds``).

A run with a warm-up (``SimResult.measure_from``) is reported from there on: minutes, latencies
and goodput of the requests that arrived after it, replica-minutes paid after it, and direction
changes of the decisions made after it.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from llmfleet.sim.fleet import SimResult
from llmfleet.sim.metric_source import RequestRecord

FAILED = ("rejected", "aborted")  # the statuses that come with a reason (RequestRecord.detail)
REASONS_SHOWN = 5


def nearest_rank(values: Iterable[float], q: float) -> float | None:
    """The q-quantile by nearest rank (works with infinities); None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def judged_ttft(record: RequestRecord) -> float:
    """The TTFT a minute is judged on: infinite for a request its client never got an answer to,
    even one rejected or aborted after its first token (a disaggregated decode pod's 400, a pod
    killed at the end of its drain)."""
    if record.ttft is None or record.status in FAILED:
        return math.inf
    return record.ttft


def per_minute(result: SimResult) -> list[dict[str, Any]]:
    """One row per minute of the trace after ``measure_from`` (``minute`` counts from there)."""
    start = result.measure_from
    minutes = max(1, math.ceil((result.last_arrival - start) / 60.0 + 1e-9))

    def minute(t: float) -> int:
        return int((t - start) // 60) if t >= start else -1

    ttft: list[list[float]] = [[] for _ in range(minutes)]
    itl: list[list[float]] = [[] for _ in range(minutes)]
    for r in result.records:
        m = minute(r.arrival)
        if 0 <= m < minutes:
            ttft[m].append(judged_ttft(r))
        for a, b in itertools.pairwise(r.token_times):
            k = min(minute(b), minutes - 1)  # the tail after the last arrival is judged too
            if k >= 0:
                itl[k].append(b - a)
    replicas: list[list[float]] = [[] for _ in range(minutes)]
    for point in result.timeline:
        m = minute(point.at)
        if 0 <= m < minutes:
            replicas[m].append(sum(p["ready"] + p["starting"] + p["draining"] for p in point.pools.values()))
    rows = []
    for m in range(minutes):
        t95, i95 = nearest_rank(ttft[m], 0.95), nearest_rank(itl[m], 0.95)
        active = bool(ttft[m] or itl[m])
        met = None
        if active:
            met = (t95 is None or t95 <= result.slo_ttft_s) and (i95 is None or i95 <= result.slo_itl_s)
        rows.append(
            {
                "minute": m,
                "arrivals": len(ttft[m]),
                "ttft_p95_s": _finite(t95),
                "itl_p95_s": _finite(i95),
                "met": met,
                "replicas_mean": sum(replicas[m]) / len(replicas[m]) if replicas[m] else None,
            }
        )
    return rows


def direction_changes(result: SimResult, window_s: float) -> dict[str, int]:
    """Most reversals of each quantity (pool/knob) within any ``window_s`` of the run (after
    ``measure_from``; the move before the first one counted sets the direction)."""
    moves: dict[str, list[tuple[float, int]]] = {}
    for record in result.decisions:
        for change in record.changes:
            direction = 1 if change["to"] > change["from"] else -1
            moves.setdefault(f"{change['pool']}/{change['knob']}", []).append((record.at, direction))
    out = {}
    for key, seq in moves.items():
        flips = [t for (_, d0), (t, d1) in itertools.pairwise(seq) if d1 != d0 and t >= result.measure_from]
        out[key] = max((sum(1 for u in flips if t <= u < t + window_s) for t in flips), default=0)
    return out


def summarize(result: SimResult) -> dict[str, Any]:
    import numpy as np

    start = result.measure_from
    records = [r for r in result.records if r.arrival >= start]
    status: dict[str, int] = {}
    for r in records:
        status[r.status] = status.get(r.status, 0) + 1
    served = [r for r in records if r.token_times]
    span = result.last_arrival - start
    duration = span if span > 0 else max(result.end - start, 1e-9)
    tokens = sum(len(r.token_times) for r in served)
    ttft = [r.ttft for r in served]
    e2e = [r.e2e for r in served if r.status == "finished"]
    itl = [b - a for r in served for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    good = sum(
        1
        for r in records
        if r.status == "finished" and r.ttft <= result.slo_ttft_s and (r.tpot or 0.0) <= result.slo_itl_s  # type: ignore[operator]
    )
    minutes = per_minute(result)
    judged = [m for m in minutes if m["met"] is not None]
    window = float(result.notes.get("stabilization_window_s", 300.0))
    flips = direction_changes(result, window)

    def pct(values: list[float], q: float) -> float | None:
        return float(np.percentile(values, q)) if values else None

    pools = sorted({pool for _, pool, _, _ in result.pod_lifetimes})
    held = [r.held_s for r in records if r.held_s > 0]
    cold = [c for c in result.cold_starts if c.at >= start]
    return {
        "name": result.name,
        "mode": result.mode,
        "controller": result.controller,
        "slo": {"ttft_p95_s": result.slo_ttft_s, "itl_p95_s": result.slo_itl_s},
        "requests": len(records),
        "status": status,
        "reasons": failure_reasons(records),
        "conserved": result.conserved,
        "measured_from_s": start,
        "duration_s": result.last_arrival - start,
        "end_s": result.end,
        "throughput_tok_s": tokens / max(result.end - start, 1e-9),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p95_s": pct(ttft, 95),
        "ttft_p99_s": pct(ttft, 99),
        "itl_p50_s": pct(itl, 50),
        "itl_p95_s": pct(itl, 95),
        "itl_p99_s": pct(itl, 99),
        "e2e_p50_s": pct(e2e, 50),
        "goodput_req_s": good / duration,
        "good_requests": good,
        "slo_minutes": len(judged),
        "slo_minutes_met": sum(1 for m in judged if m["met"]),
        "slo_attainment": sum(1 for m in judged if m["met"]) / len(judged) if judged else None,
        "replica_minutes": result.replica_seconds(since=start) / 60.0,
        "replica_minutes_by_pool": {p: result.replica_seconds(p, since=start) / 60.0 for p in pools},
        # a replica of a tensor- or pipeline-parallel pool costs its devices: the same as
        # replica_minutes where every pool runs one device a replica
        "device_minutes": result.device_seconds(since=start) / 60.0,
        "device_minutes_by_pool": {p: result.device_seconds(p, since=start) / 60.0 for p in pools},
        "decisions": len(result.decisions),
        "max_direction_changes_per_window": max(flips.values(), default=0),
        "direction_changes": flips,
        "stabilization_window_s": window,
        "held_requests": len(held),  # waited at the router for a pool with no ready pod
        "held_max_s": max(held, default=None),
        "held_p95_s": pct(held, 95),
        "cold_starts": len(cold),
        "cold_start_max_s": max((c.seconds for c in cold), default=None),
        # the tuner's ScalingLimited condition, by reason: what no bound or count let it do
        "tuner_runs": result.notes.get("tuner_runs"),
        "scaling_limited": result.notes.get("scaling_limited", {}),
        **prefix_cache_hit_rates(result),
    }


def prefix_cache_hit_rates(result: SimResult) -> dict[str, dict[str, float]]:
    """Per pool, the share of prompt tokens found in the prefix cache over the measured span
    (as vllm:prefix_cache_hits over vllm:prompt_tokens); nothing where the pods cached nothing."""
    points = [p for p in result.timeline if p.at >= result.measure_from]
    if len(points) < 2:
        return {}
    first, last = points[0].pools, points[-1].pools
    rates = {}
    for pool, counts in last.items():
        if "prefix_cache_hits" not in counts:
            continue
        prompt = counts["prompt_tokens"] - first[pool]["prompt_tokens"]
        rates[pool] = (counts["prefix_cache_hits"] - first[pool]["prefix_cache_hits"]) / prompt if prompt else 0.0
    return {"prefix_cache_hit_rate_by_pool": rates} if rates else {}


def failure_reasons(records: Iterable[RequestRecord]) -> list[dict[str, Any]]:
    """Why requests were rejected or aborted, most frequent first: one row per kind of reason
    (its details alike but for the numbers in them: pod names, lengths; a leading HTTP status is
    kept), with the first detail of the kind as its example."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
        if r.status not in FAILED:
            continue
        kind = re.sub(r"(?<=\D)\d+", "N", r.detail)
        row = rows.setdefault((r.status, kind), {"status": r.status, "reason": kind, "count": 0, "example": r.detail})
        row["count"] += 1
    return sorted(rows.values(), key=lambda row: -row["count"])


def to_json(result: SimResult, summary: dict[str, Any] | None = None) -> dict[str, Any]:
    step = max(1, len(result.timeline) // 2000)  # keep the file small on long runs
    return {
        "summary": summary or summarize(result),
        "per_minute": per_minute(result),
        "decisions": [asdict(d) for d in result.decisions],
        "timeline": [{"at": p.at, **p.pools} for p in result.timeline[::step]],
        "options": asdict(result.options),
        "cold_starts": [asdict(c) for c in result.cold_starts],
        "notes": result.notes,
    }


def write_json(result: SimResult, path: str | Path, summary: dict[str, Any] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(result, summary), indent=1, default=_finite) + "\n")
    return path


def write_runs(result: SimResult, path: str | Path) -> Path:
    """Every recorded tuner run as a JSON line: its time from the end of the warm-up (negative
    within it), the replicas it left, its changes and its reasons."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for run in result.runs:
            line = {"at_s": round(run.at - result.measure_from, 3)} | asdict(run)
            del line["at"]
            out.write(json.dumps(line, default=_finite) + "\n")
    return path


def print_summary(result: SimResult, summary: dict[str, Any] | None = None, decisions: int = 20) -> None:
    s = summary or summarize(result)

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f} ms"

    warm = f" after a {s['measured_from_s']:.0f} s warm-up" if s["measured_from_s"] else ""
    print(
        f"== {s['name']}: {s['mode']}, controller {s['controller']}, {s['requests']} requests over "
        f"{s['duration_s']:.0f} s{warm} (done at {s['end_s']:.0f} s): {s['status']}"
    )
    print(f"   SLO p95 TTFT {ms(s['slo']['ttft_p95_s'])}, ITL {ms(s['slo']['itl_p95_s'])}: {_attainment(s)}")
    print(
        f"   TTFT p50/p95/p99 {ms(s['ttft_p50_s'])}/{ms(s['ttft_p95_s'])}/{ms(s['ttft_p99_s'])}; "
        f"ITL p50/p95/p99 {ms(s['itl_p50_s'])}/{ms(s['itl_p95_s'])}/{ms(s['itl_p99_s'])}; "
        f"e2e p50 {ms(s['e2e_p50_s'])}"
    )
    print(
        f"   throughput {s['throughput_tok_s']:.1f} tok/s, goodput {s['goodput_req_s']:.2f} req/s, "
        f"replica-minutes {s['replica_minutes']:.1f}{_pools(s['replica_minutes_by_pool'])}, "
        f"{_device_minutes(s)}{s['decisions']} decisions, "
        f"at most {s['max_direction_changes_per_window']} direction change(s) "
        f"per {s['stabilization_window_s']:.0f} s"
    )
    if rates := s.get("prefix_cache_hit_rate_by_pool"):
        pools = ", ".join(f"{pool} {rate:.0%}" for pool, rate in rates.items())
        print(f"   prefix cache: {pools} of prompt tokens found cached")
    if s["cold_starts"] or s["held_requests"]:
        longest = "-" if s["cold_start_max_s"] is None else f"{s['cold_start_max_s']:.1f} s"
        print(
            f"   from zero: {s['cold_starts']} cold start(s), the longest {longest}; {s['held_requests']} "
            f"request(s) held at the router, p95 {ms(s['held_p95_s'])}, at most {ms(s['held_max_s'])}"
        )
    for reason, seen in s.get("scaling_limited", {}).items():
        print(
            f"   ScalingLimited {reason} in {seen['runs']} of {s['tuner_runs']} tuner runs "
            f"(t={seen['first_s']:.0f}-{seen['last_s']:.0f} s), last: {seen['message'][:240]}"
        )
    _print_reasons(s["reasons"])
    shown = result.decisions[-decisions:] if decisions else []
    if shown:
        print(f"   decisions (last {len(shown)} of {len(result.decisions)}):")
    for d in shown:
        what = ", ".join(f"{c['pool']}/{c['knob']} {c['from']} -> {c['to']}" for c in d.changes) or "hold"
        print(f"   t={d.at:6.0f}s {what}: {d.reason[:160]}")


def _device_minutes(s: dict[str, Any]) -> str:
    """Device-minutes, where a pool's replicas run on several devices (else they are the replica-minutes)."""
    if s.get("device_minutes", s["replica_minutes"]) == s["replica_minutes"]:
        return ""
    return f"device-minutes {s['device_minutes']:.1f}{_pools(s['device_minutes_by_pool'])}, "


def _attainment(s: dict[str, Any]) -> str:
    if s["slo_attainment"] is None:
        return "no minutes judged (no request arrived in the measured part of the run)"
    return f"met in {s['slo_minutes_met']}/{s['slo_minutes']} minutes ({s['slo_attainment']:.1%})"


def _print_reasons(reasons: list[dict[str, Any]]) -> None:
    for i, row in enumerate(reasons[:REASONS_SHOWN]):
        label = "why:" if i == 0 else "    "
        such = ", e.g." if row["count"] > 1 else ""
        print(f"   {label} {row['count']} {row['status']}{such}: {row['example'][:200]}")
    if len(reasons) > REASONS_SHOWN:
        rest = sum(row["count"] for row in reasons[REASONS_SHOWN:])
        print(f"        {rest} more, for {len(reasons) - REASONS_SHOWN} other reasons (all in the JSON)")


def _pools(by_pool: dict[str, float]) -> str:
    return " (" + ", ".join(f"{k} {v:.1f}" for k, v in by_pool.items()) + ")" if len(by_pool) > 1 else ""


def save_plot(result: SimResult, path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    minutes = per_minute(result)
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    start = result.measure_from  # minute 0 on every panel (a warm-up shows before it)
    ax = axes[0]
    mids = [m["minute"] + 0.5 for m in minutes]
    ax.plot(mids, [_ms(m["ttft_p95_s"]) for m in minutes], "o-", label="TTFT p95 (per minute, by arrival)")
    ax.plot(mids, [_ms(m["itl_p95_s"]) for m in minutes], "s-", label="ITL p95 (per minute)")
    ax.axhline(result.slo_ttft_s * 1000, color="C0", ls="--", lw=1, label="TTFT SLO")
    ax.axhline(result.slo_itl_s * 1000, color="C1", ls="--", lw=1, label="ITL SLO")
    missed = [m["minute"] + 0.5 for m in minutes if m["met"] is False]
    if missed:
        ax.plot(missed, [result.slo_ttft_s * 1000] * len(missed), "rx", label="minute missed the SLOs")
    ax.set_yscale("log")
    ax.set_ylabel("ms")
    ax.legend(fontsize=7, loc="upper right")
    ax.set_title(title or f"{result.name}: {result.controller}")

    times = [(p.at - start) / 60.0 for p in result.timeline]
    pools = list(result.timeline[0].pools) if result.timeline else []
    ax = axes[1]
    for i, pool in enumerate(pools):
        ready = [p.pools[pool]["ready"] for p in result.timeline]
        total = [
            p.pools[pool]["ready"] + p.pools[pool]["starting"] + p.pools[pool]["draining"] for p in result.timeline
        ]
        ax.step(times, total, where="post", color=f"C{i}", lw=1, ls=":", label=f"{pool} pods (incl. starting/draining)")
        ax.step(times, ready, where="post", color=f"C{i}", lw=2, label=f"{pool} ready")
    ax.set_ylabel("replicas")
    arrivals = ax.twinx()
    arrivals.plot(mids, [m["arrivals"] / 60.0 for m in minutes], color="gray", alpha=0.6, label="arrivals/s")
    arrivals.set_ylabel("arrivals/s", color="gray")
    ax.legend(fontsize=7, loc="upper left")

    ax = axes[2]
    for i, pool in enumerate(pools):
        for knob, style in (("maxBatchSize", "-"), ("batchTimeoutMs", "--")):
            ax.step(
                times,
                [p.pools[pool][knob] for p in result.timeline],
                where="post",
                color=f"C{i}",
                ls=style,
                label=f"{pool} {knob}",
            )
    ax.set_ylabel("batch size / window ms")
    budget = ax.twinx()
    for i, pool in enumerate(pools):
        budget.step(
            times,
            [p.pools[pool]["maxNumBatchedTokens"] for p in result.timeline],
            where="post",
            color=f"C{i}",
            ls=":",
            label=f"{pool} maxNumBatchedTokens",
        )
    budget.set_ylabel("token budget (dotted)")
    for d in result.decisions:
        ax.axvline((d.at - start) / 60.0, color="red" if d.hold else "green", alpha=0.15, lw=1)
    ax.legend(fontsize=7, loc="upper left")
    ax.set_xlabel("minutes" + (" (after the warm-up)" if start else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _ms(value: float | None) -> float:
    return math.nan if value is None else value * 1000.0


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
