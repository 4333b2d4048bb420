"""Micro-benchmark of ``Scheduler.schedule()`` with many running decode requests.

Pure Python, no model: ``python -m llmfleet.bench.scheduler_bench [--running 256]``.
It prints the mean and p99 time of one ``schedule()`` call per policy; the target is
<= 0.5 ms with 256 running decodes. Nothing is asserted (timings depend on the machine).
"""

from __future__ import annotations

import argparse
import time

from llmfleet.server.config import EngineConfig
from llmfleet.server.core.block_manager import BlockManager
from llmfleet.server.core.request import Request, SamplingParams
from llmfleet.server.core.scheduler import Scheduler

POLICIES: dict[str, dict] = {
    "continuous/chunked/fcfs": {},
    "continuous/merged/fcfs": {"prefill_mode": "merged"},
    "continuous/prefill_first/fcfs": {"prefill_mode": "prefill_first"},
    "continuous/chunked/priority": {"scheduling": "priority", "priority_work_weight": 1.0},
    "static": {"policy": "static"},
    "dynamic": {"policy": "dynamic", "batch_timeout_ms": 50},
}


def time_schedule(knobs: dict, running: int, waiting: int, reps: int) -> tuple[float, float]:
    """Mean and p99 seconds of one ``schedule()`` call in steady-state decode."""
    config = EngineConfig(max_batch_size=running, max_num_batched_tokens=max(4096, running), **knobs)
    scheduler = Scheduler(config, BlockManager(running * 64, 16))
    for i in range(running + waiting):
        scheduler.add(Request(str(i), list(range(300)), SamplingParams(max_tokens=100_000), priority=i % 3))
    scheduler.flush()
    while any(r.num_computed_tokens == 0 for r in scheduler.running) or len(scheduler.running) < running:
        _advance(scheduler.schedule())  # prefill everything first (untimed)
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        out = scheduler.schedule()
        samples.append(time.perf_counter() - start)
        _advance(out)
    samples.sort()
    return sum(samples) / reps, samples[int(0.99 * (reps - 1))]


def _advance(out) -> None:
    """What the engine's postprocess does: tokens computed, one more token owed."""
    for item in out.scheduled:
        request = item.request
        request.num_computed_tokens += item.num_tokens
        if item.sample:
            request.output_token_ids.append(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, default=256, help="running decode requests")
    parser.add_argument("--waiting", type=int, default=64, help="requests queued behind them")
    parser.add_argument("--reps", type=int, default=300)
    args = parser.parse_args(argv)
    print(f"schedule() with {args.running} running decodes and {args.waiting} waiting, {args.reps} calls each")
    print(f"{'policy':32} {'mean ms':>9} {'p99 ms':>9}")
    for name, knobs in POLICIES.items():
        mean, p99 = time_schedule(knobs, args.running, args.waiting, args.reps)
        print(f"{name:32} {mean * 1e3:9.3f} {p99 * 1e3:9.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
