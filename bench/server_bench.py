"""Server benchmark: 32 concurrent streaming clients against `llm-fleet serve` vs the same
workload on the in-process engine, side by side in one run. Target: the server keeps >= 90%
of in-process throughput.

Fairness: both contenders run the same engine config, and the in-process engine steps on a
dedicated thread exactly as the server's engine does (torch's intra-op threading differs
between the main thread and other threads, which alone can swing CPU step times by several x
on a busy machine). The contenders alternate for ``--rounds`` rounds on one warm server and
one warm in-process engine, and each is reported at its best round, the one least disturbed
by other load on the machine; every round is in the JSON.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

from llmfleet.bench.report import Trace, latency_summary, print_table
from llmfleet.local.processes import ServerProcess
from llmfleet.server.config import EngineConfig
from llmfleet.server.core.request import SamplingParams
from llmfleet.server.wire.sse import event_lines
from llmfleet.workloads import Workload, prompt_tokens


def _workload(clients: int) -> Workload:
    return Workload("server-32", clients, seed=5, prompt_len=(64, 256), output_len=(32, 96))


def in_process(engine, prompts, outputs, tag: str) -> dict:
    """All requests at t=0, the engine stepping on its own thread until they finish."""
    result: dict = {}
    stop = threading.Event()

    def run() -> None:
        traces = {}
        start = time.monotonic()
        for i, (p, n) in enumerate(zip(prompts, outputs, strict=True)):
            engine.add_request(f"{tag}-{i}", p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            traces[f"{tag}-{i}"] = Trace(0.0, len(p))
        while engine.has_unfinished_requests() and not stop.is_set():
            for ev in engine.step():
                traces[ev.request_id].token_times.extend([time.monotonic() - start] * len(ev.new_token_ids))
        result.update(latency_summary(list(traces.values()), time.monotonic() - start))

    thread = threading.Thread(target=run, name="bench-engine")
    thread.start()
    try:
        thread.join()
    finally:  # Ctrl-C: the thread ends after its step, not while the interpreter shuts down under it
        stop.set()
        thread.join()
    return result


async def stream_completion(http, url: str, prompt: list[int], n: int, start: float, arrival: float = 0.0) -> Trace:
    """One streamed completion, sent ``arrival`` seconds after ``start``; token times from ``start``."""
    await asyncio.sleep(max(0.0, start + arrival - time.monotonic()))
    trace = Trace(arrival, len(prompt))
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    async with http.stream("POST", f"{url}/v1/completions", json=body, timeout=1800) as resp:
        resp.raise_for_status()
        async for line in event_lines(resp.aiter_text()):
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and (chunk["choices"][0]["text"] or chunk["choices"][0]["finish_reason"]):
                    trace.token_times.append(time.monotonic() - start)
    return trace


async def over_http(url: str, prompts, outputs) -> dict:
    import httpx

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(prompts) + 4)) as http:
        start = time.monotonic()
        traces = await asyncio.gather(
            *(stream_completion(http, url, p, n, start) for p, n in zip(prompts, outputs, strict=True))
        )
        total = time.monotonic() - start
    summary = latency_summary(traces, total)
    # tokens counted by the engine, not by SSE chunks (a chunk can hold held-back text)
    summary["throughput_tok_s"] = sum(outputs) / total
    return summary


def _prompts(specs, vocab: int, seed: int) -> list[list[int]]:
    return [prompt_tokens(s, i, vocab, seed) for i, s in enumerate(specs)]


def _row(name: str, r: dict, base: float) -> list[str]:
    return [
        name,
        f"{r['throughput_tok_s']:.1f}",
        f"{r['throughput_tok_s'] / base:.0%}",
        f"{r['ttft_p50']:.2f}/{r['ttft_p99']:.2f}s",
        f"{r['itl_p50'] * 1e3:.0f}/{r['itl_p99'] * 1e3:.0f}ms",
        f"{r['e2e_p50']:.2f}/{r['e2e_p99']:.2f}s",
    ]


def run(args) -> int:
    from llmfleet.server.engine.build import build_engine
    from llmfleet.server.runner.builtin_models import resolve_model

    workload = _workload(args.clients)
    vocab = json.loads((Path(resolve_model(args.model)) / "config.json").read_text())["vocab_size"]
    specs = workload.requests()
    outputs = [s.output_len for s in specs]
    config = EngineConfig(dtype=args.dtype, max_batch_size=args.clients, max_num_batched_tokens=2048)
    rounds = max(1, getattr(args, "rounds", 2))
    print(
        f"== {workload.name}: {args.clients} streaming clients, prompts 64..256, outputs 32..96, {args.model}, "
        f"{rounds} alternating rounds (best of each reported)"
    )

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg_file = out_dir / "server_bench_engine.yaml"
    cfg_file.write_text(config.to_yaml())

    engine, _ = build_engine(args.model, config)
    server_args = ["--model", args.model, "--config", str(cfg_file), "--log-level", "warning"]
    server = ServerProcess("bench-server", server_args, out_dir / "server_bench_server.log", port=args.port or None)
    url = server.url
    local_runs, remote_runs = [], []
    try:
        server.wait_ready(300)
        # warm-up both: first shapes, allocator, connections; on prompts no round measures
        warm = _prompts(specs[:4], vocab, seed=rounds)
        in_process(engine, warm, [4] * len(warm), "warm")
        asyncio.run(over_http(url, warm, [4] * len(warm)))
        for r in range(rounds):
            prompts = _prompts(specs, vocab, seed=r)  # each round its own: no prefix cache hits on a round before
            local_runs.append(in_process(engine, prompts, outputs, f"r{r}"))
            remote_runs.append(asyncio.run(over_http(url, prompts, outputs)))
            print(
                f"round {r + 1}: in-process {local_runs[-1]['throughput_tok_s']:.1f} tok/s, "
                f"server {remote_runs[-1]['throughput_tok_s']:.1f} tok/s"
            )
    finally:
        server.drain()
        server.proc.wait(60)

    local = max(local_runs, key=lambda r: r["throughput_tok_s"])
    remote = max(remote_runs, key=lambda r: r["throughput_tok_s"])
    base = local["throughput_tok_s"]
    rows = [_row("in-process engine", local, base), _row(f"server, {args.clients} SSE clients", remote, base)]
    print_table(["contender", "tok/s", "of in-process", "TTFT p50/p99", "ITL p50/p99", "e2e p50/p99"], rows)
    ratio = remote["throughput_tok_s"] / base
    print(f"server/in-process throughput: {ratio:.0%} (target >= 90%: {'met' if ratio >= 0.9 else 'NOT met'})")
    result = {
        "workload": workload.params(),
        "model": args.model,
        "engine_config": config.model_dump(mode="json"),
        "in_process": local,
        "server": remote,
        "ratio": ratio,
        "rounds": {"in_process": local_runs, "server": remote_runs},
    }
    (out_dir / "server_bench.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out_dir / 'server_bench.json'}")
    return 0
