"""`llm-fleet bench pipeline`: pipeline stages against one process on the same cores.

Contenders, in one run on the same token ids: one process with N threads; S=N pipeline stages of
one thread each; and T=N tensor shards of one thread each. Workloads: offline-32 and
anyscale-online. For the parallel contenders each worker's busy share (seconds computing over
the workload's wall time) shows the pipeline's bubbles: a stage idles while it waits for the
previous stage's batch, or for the engine to schedule the next one.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from llmfleet.bench.engine_worker import offline as run_offline
from llmfleet.bench.engine_worker import online as run_online
from llmfleet.bench.report import Trace, latency_summary
from llmfleet.server.config import EngineConfig
from llmfleet.server.engine.build import build_engine
from llmfleet.server.parallel.runner import leave_cores_to_workers
from llmfleet.server.runner.builtin_models import resolve_model
from llmfleet.workloads import OFFLINE_32, Workload, anyscale_online, prompt_tokens


def contenders(threads: int) -> dict[str, tuple[int, int]]:
    """Name -> (tensor, pipeline) for ``threads`` cores."""
    return {
        f"1 process, {threads} threads": (1, 1),
        f"S={threads} stages, 1 thread each": (1, threads),
        f"T={threads} shards, 1 thread each": (threads, 1),
    }


def busy(engine) -> dict[int, float]:
    stats = getattr(engine.runner, "worker_stats", None)
    return {} if stats is None else {rank: s["busy_seconds"] for rank, s in stats().items()}


def measure(engine, workload: str, command: dict) -> dict:
    before = busy(engine)
    if workload == "offline":
        answer = run_offline(engine, command)
        result = {"seconds": answer["seconds"], "useful_tok_s": answer["tokens"] / answer["seconds"]}
    else:
        answer = run_online(engine, command)
        traces = [Trace(**t) for t in answer["traces"]]
        result = latency_summary(traces, answer["total_s"])
    after = busy(engine)
    wall = result["seconds"]
    result["busy_share"] = {str(rank): (after[rank] - before[rank]) / wall for rank in after}
    return result


def run(args) -> int:
    threads = max(args.thread_counts or [2])
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(args.model)
    dtype = args.dtype
    offline_wl = OFFLINE_32 if not args.quick else Workload("offline-8", 8, prompt_len=(128, 128), output_len=(16, 64))
    online_wl = anyscale_online(args.rate, args.online_requests if not args.quick else 8)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    specs = offline_wl.requests()
    offline_command = {
        "prompts": [prompt_tokens(s, i, vocab) for i, s in enumerate(specs)],
        "outputs": [s.output_len for s in specs],
    }
    online_command = {
        "requests": [
            {"arrival_s": s.arrival_s, "prompt": prompt_tokens(s, i, vocab, seed=200), "output_len": s.output_len}
            for i, s in enumerate(online_wl.requests())
        ]
    }
    commands = {"offline": offline_command, "online": online_command}
    print(f"== pipeline bench: {args.model} {dtype}, {threads} cores; {offline_wl.name} and {online_wl.name}")
    results: dict = {"model": args.model, "dtype": dtype, "threads": threads, "contenders": {}}
    saved = os.environ.get("LLMFLEET_WORKER_THREADS"), torch.get_num_threads()
    os.environ["LLMFLEET_WORKER_THREADS"] = "1"
    try:
        for name, (tensor, pipeline) in contenders(threads).items():
            results["contenders"][name] = run_contender(args.model, dtype, threads, tensor, pipeline, commands)
            print_row(name, results["contenders"][name])
    finally:
        if saved[0] is None:
            os.environ.pop("LLMFLEET_WORKER_THREADS")
        else:
            os.environ["LLMFLEET_WORKER_THREADS"] = saved[0]
        torch.set_num_threads(saved[1])
    base = next(iter(results["contenders"].values()))
    for name, row in results["contenders"].items():
        ratio = row["offline"]["useful_tok_s"] / base["offline"]["useful_tok_s"]
        base_goodput = base["online"]["goodput_req_s"]
        goodput = row["online"]["goodput_req_s"] / base_goodput if base_goodput else float("nan")
        print(f"   {name}: offline {ratio:.2f}x, online goodput {goodput:.2f}x the single process")
    path = out_dir / "pipeline_bench.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")
    return 0


def run_contender(model: str, dtype: str, threads: int, tensor: int, pipeline: int, commands: dict) -> dict:
    torch.set_num_threads(threads)
    config = EngineConfig(
        dtype=dtype,
        max_batch_size=32,
        max_num_batched_tokens=2048,
        tensor_parallel_size=tensor,
        pipeline_parallel_size=pipeline,
    )
    started = time.perf_counter()
    engine, _ = build_engine(model, config)
    load_s = time.perf_counter() - started
    if tensor * pipeline > 1:
        leave_cores_to_workers()  # as serve does
    try:
        run_offline(engine, {"prompts": commands["offline"]["prompts"][:2], "outputs": [2, 2]})  # warm
        return {
            "load_s": load_s,
            "offline": measure(engine, "offline", commands["offline"]),
            "online": measure(engine, "online", commands["online"]),
        }
    finally:
        close = getattr(engine.runner, "close", None)
        if close is not None:
            close()


def print_row(name: str, row: dict) -> None:
    offline, online = row["offline"], row["online"]

    def shares(result: dict) -> str:
        busy_share = result["busy_share"]
        return " ".join(f"w{rank}:{share:.0%}" for rank, share in busy_share.items()) or "-"

    print(
        f"{name:32s} offline {offline['useful_tok_s']:7.1f} tok/s (busy {shares(offline)}) | online "
        f"{online['throughput_tok_s']:6.1f} tok/s, goodput {online['goodput_req_s']:.3f} req/s, "
        f"TTFT p99 {online['ttft_p99']:.2f} s, TPOT p50 {online['tpot_p50'] * 1000:.0f} ms (busy {shares(online)})"
    )
