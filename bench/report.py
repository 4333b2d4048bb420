"""Latency summaries, tables and plots shared by the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Trace:
    """Per-request timings of one online run (seconds, relative to the run start): what
    ``latency_summary`` reads."""

    arrival: float
    prompt_len: int
    token_times: list[float] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def latency_summary(traces, total_s: float, ttft_slo_s: float = 2.0, tpot_slo_s: float = 0.2) -> dict:
    """Throughput, TTFT/TPOT/ITL/e2e percentiles and goodput (requests meeting both the TTFT
    and the TPOT SLO per second, as DistServe defines it). ``traces`` have ``arrival`` and
    ``token_times`` in seconds from the run start."""
    ttft, tpot, itl, e2e = [], [], [], []
    good = 0
    tokens = 0
    for t in traces:
        if not t.token_times:
            continue
        tokens += len(t.token_times)
        first = t.token_times[0] - t.arrival
        last = t.token_times[-1] - t.arrival
        per_token = (last - first) / (len(t.token_times) - 1) if len(t.token_times) > 1 else 0.0
        ttft.append(first)
        e2e.append(last)
        tpot.append(per_token)
        itl.extend(b - a for a, b in zip(t.token_times, t.token_times[1:], strict=False))
        good += first <= ttft_slo_s and per_token <= tpot_slo_s
    return {
        "requests": len(ttft),
        "seconds": total_s,
        "throughput_tok_s": tokens / total_s,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "tpot_p50": percentile(tpot, 50),
        "tpot_p99": percentile(tpot, 99),
        "itl_p50": percentile(itl, 50),
        "itl_p99": percentile(itl, 99),
        "e2e_p50": percentile(e2e, 50),
        "e2e_p99": percentile(e2e, 99),
        "goodput_req_s": good / total_s,
        "slo": {"ttft_s": ttft_slo_s, "tpot_s": tpot_slo_s},
    }


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    print(line)
    print("-" * len(line))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))


def save_plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("offline", "online") if k in results]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, key in zip(axes[0], panels, strict=True):
        if key == "offline":
            rows = results["offline"]["rows"]
            ax.bar([r["contender"].split(" (")[0] for r in rows], [r["useful_tok_s"] for r in rows])
            ax.set_title(f"offline: useful tokens/s ({results['model']}, {results['dtype']})")
        else:
            pol = results["online"]["policies"]
            names = list(pol)
            ax.bar(names, [pol[n]["throughput_tok_s"] for n in names], label="tok/s")
            ax2 = ax.twinx()
            ax2.plot(names, [pol[n]["e2e_p50"] for n in names], "o-r", label="e2e p50 (s)")
            ax2.set_ylabel("e2e p50 (s)")
            ax.set_title("anyscale-online: throughput and latency")
        ax.tick_params(axis="x", labelrotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
