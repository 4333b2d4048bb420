"""Colocated vs disaggregated serving on the same machine, side by side in one run.

Contenders, on the same CPU cores and the same engine config:

- **colocated**: one `llm-fleet serve` process with every torch thread (``--threads``);
- **disaggregated**: a router, one prefill and one decode server, the threads split between
  the two engines (prefill gets ``threads // 2``, at least one; decode the rest).

Each replays the same open-loop trace (Poisson arrivals, streaming OpenAI clients) of the chat
and the long-prompt workload shapes (llmfleet.workloads.SHAPES), after a warm-up. Reported per
contender: throughput (output tokens/s), TTFT, ITL and end-to-end p50/p99 as the clients see
them, and the ratios disaggregated/colocated. JSON and a PNG go to ``--out``.

What to expect (vLLM's docs say as much): disaggregation does not raise throughput; it keeps
long prefills from stalling the decodes of other requests, so ITL tails shrink, while TTFT pays
for the KV transfer and, on a fixed core count, for the prefill server's smaller share.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from dataclasses import replace
from pathlib import Path

from llmfleet.arguments import positive, positive_int
from llmfleet.bench.report import latency_summary, print_table
from llmfleet.bench.server_bench import stream_completion
from llmfleet.local.processes import ServerProcess
from llmfleet.server.wire.auth import KV_TOKEN_ENV
from llmfleet.workloads import SHAPES, prompt_tokens

WORKLOADS = ("chat", "long-prompt")


def add_arguments(parser) -> None:
    group = parser.add_argument_group("disagg bench")
    group.add_argument("--disagg-workloads", default=",".join(WORKLOADS), help="disagg: shapes (chat,long-prompt)")
    group.add_argument(
        "--disagg-threads", type=positive_int, default=os.cpu_count() or 2, help="disagg: threads per contender"
    )
    group.add_argument("--disagg-rate-scale", type=positive, default=1.0, help="disagg: multiply the arrival rates")
    group.add_argument(
        "--disagg-requests", type=positive_int, help="disagg: requests per workload (default: the workload's)"
    )


class Servers:
    """The servers of one contender, drained (and waited for) on exit; they share a KV-transfer
    token of their own, as a fleet's servers do."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.servers: list[ServerProcess] = []
        self.env = {KV_TOKEN_ENV: secrets.token_hex(16)}

    def start(self, name: str, threads: int | None, *args: str) -> str:
        env = self.env | ({"OMP_NUM_THREADS": str(threads)} if threads is not None else {})
        server = ServerProcess(name, ["--log-level", "warning", *args], self.out / f"disagg-{name}.log", env=env)
        self.servers.append(server)
        return server.url

    def wait_ready(self) -> None:
        for server in self.servers:
            server.wait_ready(600)

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *exc) -> None:
        for server in self.servers:
            server.drain()
        deadline = time.monotonic() + 60
        while any(s.alive for s in self.servers) and time.monotonic() < deadline:
            time.sleep(0.1)
        for server in self.servers:
            server.kill()


async def replay(url: str, requests: list[tuple[float, list[int], int]]) -> dict:
    import httpx

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(requests) + 4)) as http:
        start = time.monotonic()
        traces = await asyncio.gather(*(stream_completion(http, url, p, n, start, a) for a, p, n in requests))
        total = time.monotonic() - start
    summary = latency_summary(traces, total)
    summary["throughput_tok_s"] = sum(n for _, _, n in requests) / total
    return summary


def _trace(shape: str, model_dir: Path, rate_scale: float, count: int | None, seed: int = 0):
    workload = SHAPES[shape]
    workload = replace(
        workload, rate_per_s=workload.rate_per_s * rate_scale, num_requests=count or workload.num_requests
    )
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    specs = workload.requests()
    return workload, [(s.arrival_s, prompt_tokens(s, i, vocab, seed), s.output_len) for i, s in enumerate(specs)]


def run(args) -> int:
    from llmfleet.server.config import EngineConfig
    from llmfleet.server.runner.builtin_models import resolve_model

    shapes = args.disagg_workloads.split(",")
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        print(f"unknown workload(s) {', '.join(unknown)}: choose from {', '.join(SHAPES)}")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(resolve_model(args.model))  # built once here, not by four servers at once
    config = EngineConfig(dtype=args.dtype, max_batch_size=64, max_num_batched_tokens=1024, kv_cache_memory_mb=1024)
    config_file = out / "disagg_bench_engine.yaml"
    config_file.write_text(config.to_yaml())
    engine_args = ("--model", args.model, "--config", str(config_file), "--served-model-name", "bench")
    threads = args.disagg_threads
    prefill_threads = max(1, threads // 2)
    decode_threads = max(1, threads - prefill_threads)
    print(
        f"== colocated (1 server, {threads} threads) vs disaggregated (router + prefill {prefill_threads} "
        f"+ decode {decode_threads} threads), {args.model}, {config.dtype}"
    )
    results: dict = {"model": args.model, "threads": threads, "engine": config.model_dump(mode="json")}
    rows = []
    for shape in shapes:
        workload, requests = _trace(shape, model_dir, args.disagg_rate_scale, args.disagg_requests)
        print(
            f"-- {shape}: {workload.num_requests} requests, Poisson {workload.rate_per_s:g}/s, prompts "
            f"{workload.prompt_len[0]}..{workload.prompt_len[1]}, outputs {workload.output_len[0]}.."
            f"{workload.output_len[1]}"
        )
        _, warm = _trace(shape, model_dir, 1.0, 4, seed=1)  # other prompts: none of the trace's cached
        warmup = [(0.0, p, 4) for _, p, _ in warm]
        runs = {}
        with Servers(out) as servers:
            url = servers.start("colocated", threads, *engine_args)
            servers.wait_ready()
            asyncio.run(replay(url, warmup))
            runs["colocated"] = asyncio.run(replay(url, requests))
        with Servers(out) as servers:
            prefill = servers.start("prefill", prefill_threads, "--role", "prefill", *engine_args)
            decode = servers.start("decode", decode_threads, "--role", "decode", "--prefill-url", prefill, *engine_args)
            router = servers.start(
                "router",
                None,
                "--role",
                "router",
                "--served-model-name",
                "bench",
                "--prefill-url",
                prefill,
                "--decode-url",
                decode,
            )
            servers.wait_ready()
            asyncio.run(replay(router, warmup))
            runs["disaggregated"] = asyncio.run(replay(router, requests))
        results[shape] = {"workload": workload.params(), **runs}
        base = runs["colocated"]
        for name, r in runs.items():
            rows.append(_row(shape, name, r, base))
    header = ["workload", "contender", "tok/s", "x colocated", "TTFT p50/p99", "ITL p50/p99", "e2e p50/p99"]
    print_table(header, rows)
    (out / "disagg_bench.json").write_text(json.dumps(results, indent=2))
    _plot(results, out / "disagg_bench.png")
    print(f"wrote {out / 'disagg_bench.json'} and {out / 'disagg_bench.png'}")
    return 0


def _row(shape: str, name: str, r: dict, base: dict) -> list[str]:
    return [
        shape,
        name,
        f"{r['throughput_tok_s']:.1f}",
        f"{r['throughput_tok_s'] / base['throughput_tok_s']:.2f}",
        f"{r['ttft_p50']:.2f}/{r['ttft_p99']:.2f}s ({r['ttft_p99'] / base['ttft_p99']:.2f}x)",
        f"{r['itl_p50'] * 1e3:.0f}/{r['itl_p99'] * 1e3:.0f}ms ({r['itl_p99'] / base['itl_p99']:.2f}x)",
        f"{r['e2e_p50']:.2f}/{r['e2e_p99']:.2f}s",
    ]


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = [s for s, r in results.items() if isinstance(r, dict) and "colocated" in r]  # every one measured
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (metric, label, scale) in zip(
        axes,
        [("throughput_tok_s", "tokens/s", 1), ("ttft_p99", "TTFT p99 (s)", 1), ("itl_p99", "ITL p99 (ms)", 1e3)],
        strict=True,
    ):
        for i, contender in enumerate(("colocated", "disaggregated")):
            values = [results[s][contender][metric] * scale for s in shapes]
            ax.bar([x + 0.4 * i for x in range(len(shapes))], values, width=0.4, label=contender)
        ax.set_xticks([x + 0.2 for x in range(len(shapes))], shapes)
        ax.set_title(label)
    axes[0].legend()
    fig.suptitle(f"colocated vs disaggregated, {results['model']}, {results['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
