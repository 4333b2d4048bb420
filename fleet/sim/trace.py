"""Workload traces for the simulator: the built-in workloads (llmfleet.workloads), stretched to a
duration, or a JSONL file with one request per line::

    {"arrival_s": 0.42, "prompt_tokens": 180, "output_tokens": 96}

``arrival_s`` is seconds from the start of the trace; other keys are ignored. Requests are
``llmfleet.workloads.RequestSpec`` (arrival_s, prompt_len, output_len) in arrival order.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from llmfleet.workloads import BURSTY, SHAPES, PhasedWorkload, RequestSpec, Workload, anyscale_online

TRACE_NAMES = ("chat", "long-prompt", "creative", "bursty", "anyscale-online")


_TIMESTAMPS_FROM_S = 86_400.0  # a first arrival this late is a timestamp, not an offset
# The simulator steps through idle time (a scrape every simulated second), so a trace spanning
# decades would run for ever; a week is more than any replay needs.
MAX_SPAN_S = 7 * 86_400.0


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the line."""


def read_trace(path: str | Path) -> list[RequestSpec]:
    """The requests of a JSONL trace, by arrival (seconds from the trace's start). A trace whose
    first arrival is a day or more in holds timestamps (a log's Unix seconds): its arrivals count
    from the first one, so it replays as it happened, not after decades of idling. A trace whose
    arrivals span more than ``MAX_SPAN_S`` is refused (a mix of offsets and timestamps)."""
    requests = []
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from exc
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise TraceError(f"{where}: not JSON: {exc}") from exc
        if not isinstance(record, dict):
            raise TraceError(f"{where}: expected an object with arrival_s, prompt_tokens, output_tokens")
        missing = [k for k in ("arrival_s", "prompt_tokens", "output_tokens") if k not in record]
        if missing:
            raise TraceError(f"{where}: missing {', '.join(missing)}")
        arrival, prompt, output = record["arrival_s"], record["prompt_tokens"], record["output_tokens"]
        if (
            isinstance(arrival, bool)
            or not isinstance(arrival, int | float)
            or not math.isfinite(arrival)
            or arrival < 0
        ):
            raise TraceError(f"{where}: arrival_s must be a finite number >= 0, got {arrival!r}")
        for key, value in (("prompt_tokens", prompt), ("output_tokens", output)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TraceError(f"{where}: {key} must be an integer >= 1, got {value!r}")
        requests.append(RequestSpec(float(arrival), prompt, output))
    if not requests:
        raise TraceError(f"trace {path} holds no requests")
    requests.sort(key=lambda r: r.arrival_s)  # stable: ties keep file order
    _check_span(path, requests)
    first = requests[0].arrival_s
    if first < _TIMESTAMPS_FROM_S:
        return requests
    return [RequestSpec(r.arrival_s - first, r.prompt_len, r.output_len) for r in requests]


def _check_span(path: str | Path, requests: list[RequestSpec]) -> None:
    first, last = requests[0].arrival_s, requests[-1].arrival_s
    if last - first > MAX_SPAN_S:
        raise TraceError(
            f"trace {path}: its arrivals span {(last - first) / 86_400:.3g} days ({first:g} s to {last:g} s), "
            f"more than the {MAX_SPAN_S / 86_400:g} days a trace may cover; does it mix offsets from its start "
            "(arrival_s 0, 1.5, ...) with Unix timestamps?"
        )


def write_trace(path: str | Path, requests: list[RequestSpec]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in requests:
            record = {"arrival_s": round(r.arrival_s, 6), "prompt_tokens": r.prompt_len, "output_tokens": r.output_len}
            f.write(json.dumps(record) + "\n")
    return path


def builtin_workload(
    name: str, duration_s: float | None = None, rate_scale: float = 1.0, seed: int | None = None
) -> Workload | PhasedWorkload:
    """A built-in workload, its rate multiplied by ``rate_scale``; the shapes and anyscale-online
    run for ``duration_s`` at their own rate (default: their defined request count)."""
    if rate_scale <= 0:
        raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
    if name == "bursty":
        phases = BURSTY.phases
        if duration_s is not None:  # stretch or squeeze the phases to the duration
            k = duration_s / BURSTY.duration_s
            phases = tuple((seconds * k, rate) for seconds, rate in phases)
        phases = tuple((seconds, rate * rate_scale) for seconds, rate in phases)
        return replace(BURSTY, phases=phases, seed=BURSTY.seed if seed is None else seed)
    if name == "anyscale-online":
        base: Workload = anyscale_online(1.0, 32)
    elif name in SHAPES:
        base = SHAPES[name]
    else:
        raise ValueError(f"unknown workload {name!r}; use one of {', '.join(TRACE_NAMES)}")
    rate = (base.rate_per_s or 1.0) * rate_scale
    count = base.num_requests if duration_s is None else max(1, round(rate * duration_s))
    return replace(base, rate_per_s=rate, num_requests=count, seed=base.seed if seed is None else seed)


def describe(workload: Workload | PhasedWorkload) -> str:
    if isinstance(workload, PhasedWorkload):
        steps = " -> ".join(f"{rate:g}/s for {seconds:g} s" for seconds, rate in workload.phases)
        return f"{workload.name}: {steps}; prompts {workload.prompt_len}, outputs {workload.output_len}"
    lengths = f"prompts {workload.prompt_len}, outputs {workload.output_len}"
    if workload.output_mean is not None:
        lengths += f" (exponential mean {workload.output_mean:g})"
    return f"{workload.name}: {workload.num_requests} requests, Poisson {workload.rate_per_s:g}/s; {lengths}"


def with_warmup(workload: Workload | PhasedWorkload, warmup_s: float, seed: int = 1000) -> list[RequestSpec]:
    """``warmup_s`` seconds of the workload's lengths at its opening rate, then the workload
    itself shifted by ``warmup_s``: a fleet that has been serving for a while when it starts."""
    requests = workload.requests()
    if warmup_s <= 0:
        return requests
    if isinstance(workload, PhasedWorkload):
        rate = workload.phases[0][1]
        base = Workload(
            "warm-up",
            0,
            prompt_len=workload.prompt_len,
            output_len=workload.output_len,
            output_mean=workload.output_mean,
        )
    else:
        rate = workload.rate_per_s or 1.0
        base = workload
    count = max(1, round(rate * warmup_s * 1.5))  # enough arrivals to cover the warm-up; the rest are cut
    warm = [
        r for r in replace(base, rate_per_s=rate, num_requests=count, seed=seed).requests() if r.arrival_s < warmup_s
    ]
    return warm + [RequestSpec(r.arrival_s + warmup_s, r.prompt_len, r.output_len) for r in requests]
