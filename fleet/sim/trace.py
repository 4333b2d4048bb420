"""Workload traces for the simulator: the built-in workloads (llmfleet.workloads), stretched to a
duration, or a request log read from a file: JSONL, ours or Mooncake's, or CSV, Azure's or
BurstGPT's (trace_formats.py says what each holds).

``TraceOptions`` cut a time window out of a trace, thin it to a fraction of its requests (a
seeded draw, so a trace's rate fits a small fleet and each seed is another draw), and cap its
lengths (to the model's context). Requests are ``llmfleet.workloads.RequestSpec`` (arrival_s,
prompt_len, output_len, and the prompt's content blocks where the trace names them) in arrival
order.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from llmfleet.sim.trace_formats import READ_ERRORS, Content, Match, Rows, TraceError, open_text, read_rows
from llmfleet.workloads import BURSTY, SHAPES, PhasedWorkload, RequestSpec, Workload, anyscale_online

TRACE_NAMES = ("chat", "long-prompt", "creative", "bursty", "anyscale-online")


_TIMESTAMPS_FROM_S = 86_400.0  # a first arrival this late is a timestamp, not an offset
# The simulator steps through idle time (a scrape every simulated second), so a trace spanning
# decades (offsets from its start mixed with Unix timestamps) would run for ever. The longest
# public logs span months: BurstGPT's third holds 110 days.
MAX_SPAN_S = 366 * 86_400.0


@dataclass(frozen=True)
class TraceOptions:
    """What of a trace to replay: the rows whose fields hold the values ``match`` gives (all
    rows where it gives none), the window ``[start_s, start_s + duration_s)`` from their first
    arrival (re-based to start at 0), a ``thin`` fraction of their requests (each kept with that
    probability, drawn with ``seed``), and caps on prompt and output lengths."""

    start_s: float = 0.0
    duration_s: float | None = None
    thin: float = 1.0
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    seed: int = 0
    match: Match = ()

    def __post_init__(self) -> None:
        if not 0.0 < self.thin <= 1.0:
            raise ValueError(f"thin must be a fraction in (0, 1], got {self.thin}")
        if self.start_s < 0 or (self.duration_s is not None and self.duration_s <= 0):
            raise ValueError(
                f"a trace window needs start >= 0 and a duration > 0, got {self.start_s}, {self.duration_s}"
            )
        for cap in (self.max_prompt_tokens, self.max_output_tokens):
            if cap is not None and cap < 1:
                raise ValueError(f"length caps must be >= 1, got {cap}")

    def apply(self, requests: Iterable[tuple[float, int, int, Content]]) -> list[RequestSpec]:
        """The requests kept of (arrival_s, prompt_len, output_len, content: the prompt's block
        ids and the tokens in a block) in arrival order. A capped prompt keeps the blocks that
        still hold its tokens."""
        end = math.inf if self.duration_s is None else self.start_s + self.duration_s
        rng = random.Random(self.seed)
        out = []
        for arrival, prompt, output, (blocks, block_tokens) in requests:
            if not self.start_s <= arrival < end:
                continue
            if self.thin < 1.0 and rng.random() >= self.thin:
                continue
            prompt = min(prompt, self.max_prompt_tokens or prompt)
            output = min(output, self.max_output_tokens or output)
            if blocks:
                blocks = blocks[: -(-prompt // block_tokens)]
            out.append(RequestSpec(arrival - self.start_s, prompt, output, blocks, block_tokens))
        return out

    def describe(self) -> str:
        parts = [f"{field} = {value}" for field, value in self.match]
        if self.start_s or self.duration_s is not None:
            end = "" if self.duration_s is None else f"{self.start_s + self.duration_s:g}"
            parts.append(f"window {self.start_s:g}-{end} s")
        if self.thin < 1.0:
            parts.append(f"thinned to {self.thin:g} (seed {self.seed})")
        if self.max_prompt_tokens is not None:
            parts.append(f"prompts capped at {self.max_prompt_tokens}")
        if self.max_output_tokens is not None:
            parts.append(f"outputs capped at {self.max_output_tokens}")
        return ", ".join(parts)


def read_trace(path: str | Path, options: TraceOptions | None = None) -> list[RequestSpec]:
    """The requests of a trace in any of the formats trace_formats.py reads, compressed or not,
    by arrival (seconds from the trace's start), the rows ``options.match`` picks, then cut by
    the rest of ``options``. A trace whose first arrival is a day or more in holds timestamps (a
    log's Unix seconds): its arrivals count from the first one, so it replays as it happened, not
    after decades of idling. A trace whose arrivals span more than ``MAX_SPAN_S`` is refused (a
    mix of offsets and timestamps).

    The file is read as a stream into flat arrays and only the requests ``options`` keep become
    ``RequestSpec``s: Azure's 2024 traces hold 17 and 27 million requests over a week, BurstGPT's
    up to 5 million over months, of which a replay takes a window."""
    options = options or TraceOptions()
    rows = Rows()
    try:
        with open_text(path) as f:
            lines = iter(f)
            number, first = 0, ""
            for number, first in enumerate(lines, 1):  # noqa: B007 (the loop finds the first line with text)
                if first.strip():
                    break
            if not first.strip():  # whatever its name says, no header and no request
                raise TraceError(f"trace {path} holds no requests: it is empty")
            read_rows(path, itertools.chain([first], lines), number, first, rows, options.match)
    except READ_ERRORS as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from exc
    if not rows.arrivals:
        where = " and ".join(f"{field} = {value}" for field, value in options.match)
        raise TraceError(f"trace {path}: no request where {where}" if where else f"trace {path} holds no requests")
    order = rows.by_arrival()
    first_s, last_s = rows.arrivals[order[0]], rows.arrivals[order[-1]]
    _check_span(path, first_s, last_s)
    base = first_s if first_s >= _TIMESTAMPS_FROM_S else 0.0
    requests = ((rows.arrivals[i] - base, rows.prompts[i], rows.outputs[i], rows.content_of(i)) for i in order)
    kept = options.apply(requests)
    if not kept:
        raise TraceError(f"trace {path}: no request left after {options.describe()}")
    return kept


def _check_span(path: str | Path, first: float, last: float) -> None:
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
            if r.blocks:
                record |= {"hash_ids": list(r.blocks), "block_tokens": r.block_tokens}
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
    return warm + [replace(r, arrival_s=r.arrival_s + warmup_s) for r in requests]
