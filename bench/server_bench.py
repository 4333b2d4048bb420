"""Server benchmark: 32 concurrent streaming clients against `llm-fleet serve` vs the same
workload on the in-process engine, side by side in one run. Target: the server keeps >= 90%
of in-process throughput."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from llmfleet.server.config import EngineConfig
from llmfleet.server.core.request import SamplingParams

from .engine_bench import Trace
from .report import latency_summary, print_table
from .workloads import Workload, prompt_tokens


def _workload(clients: int) -> Workload:
    return Workload("server-32", clients, seed=5, prompt_len=(64, 256), output_len=(32, 96))


def in_process(model: str, prompts, outputs, config: EngineConfig) -> dict:
    from llmfleet.server.engine.build import build_engine

    engine, _ = build_engine(model, config)
    engine.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0))
    start = time.monotonic()
    traces = {}
    for i, (p, n) in enumerate(zip(prompts, outputs, strict=True)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        traces[str(i)] = Trace(0.0, len(p))
    while engine.has_unfinished_requests():
        for ev in engine.step():
            traces[ev.request_id].token_times.extend([time.monotonic() - start] * len(ev.new_token_ids))
    return latency_summary(list(traces.values()), time.monotonic() - start)


async def _client(http, url: str, prompt: list[int], n: int, start: float) -> Trace:
    trace = Trace(0.0, len(prompt))
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    async with http.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and (chunk["choices"][0]["text"] or chunk["choices"][0]["finish_reason"]):
                    trace.token_times.append(time.monotonic() - start)
    return trace


async def over_http(url: str, prompts, outputs) -> dict:
    import httpx

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(prompts) + 4)) as http:
        await _client(http, url, prompts[0][:8], 2, time.monotonic())  # warm-up
        start = time.monotonic()
        traces = await asyncio.gather(*(_client(http, url, p, n, start) for p, n in zip(prompts, outputs, strict=True)))
        total = time.monotonic() - start
    summary = latency_summary(traces, total)
    # tokens counted by the engine, not by SSE chunks (a chunk can hold held-back text)
    summary["throughput_tok_s"] = sum(outputs) / total
    return summary


def run(args) -> int:
    import subprocess
    import sys

    import httpx

    from llmfleet.server.runner.builtin_models import resolve_model

    workload = _workload(args.clients)
    vocab = json.loads((Path(resolve_model(args.model)) / "config.json").read_text())["vocab_size"]
    specs = workload.requests()
    prompts = [prompt_tokens(s, i, vocab) for i, s in enumerate(specs)]
    outputs = [s.output_len for s in specs]
    config = EngineConfig(max_batch_size=args.clients, max_num_batched_tokens=2048)
    print(f"== {workload.name}: {args.clients} streaming clients, prompts 64..256, outputs 32..96, {args.model}")

    local = in_process(args.model, prompts, outputs, config)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg_file = out_dir / "server_bench_engine.yaml"
    cfg_file.write_text(config.to_yaml())
    port = args.port
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmfleet.cli", "serve", "--model", args.model, "--port", str(port),
         "--config", str(cfg_file), "--log-level", "warning"],
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        remote = asyncio.run(over_http(url, prompts, outputs))
    finally:
        proc.terminate()
        proc.wait(60)

    rows = []
    for name, r in (("in-process engine", local), ("server, 32 SSE clients", remote)):
        rows.append(
            [
                name,
                f"{r['throughput_tok_s']:.1f}",
                f"{r['throughput_tok_s'] / local['throughput_tok_s']:.0%}",
                f"{r['ttft_p50']:.2f}/{r['ttft_p99']:.2f}s",
                f"{r['itl_p50'] * 1e3:.0f}/{r['itl_p99'] * 1e3:.0f}ms",
                f"{r['e2e_p50']:.2f}/{r['e2e_p99']:.2f}s",
            ]
        )
    print_table(["contender", "tok/s", "of in-process", "TTFT p50/p99", "ITL p50/p99", "e2e p50/p99"], rows)
    (out_dir / "server_bench.json").write_text(json.dumps({"in_process": local, "server": remote}, indent=2))
    print(f"wrote {out_dir / 'server_bench.json'}")
    return 0
