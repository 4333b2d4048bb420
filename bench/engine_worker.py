"""llm-fleet's engine as a bench contender in a process of its own, beside vLLM's
(bench/vllm_worker.py, whose line protocol it speaks): each contender starts fresh, so its
start-up and first round are measured as a user would meet them.

Run as ``python -m llmfleet.bench.engine_worker CONFIG_JSON``.
"""

from __future__ import annotations

import json
import sys
import time

from llmfleet.bench.vllm_worker import reply


def offline(engine, command: dict) -> dict:
    from llmfleet.server.core.request import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in command["outputs"]]
    start = time.perf_counter()
    results = engine.generate(command["prompts"], params)
    return {"seconds": time.perf_counter() - start, "tokens": sum(len(r) for r in results)}


def online(engine, command: dict) -> dict:
    """Real-time arrivals, as engine_bench.online and the vLLM worker run them."""
    from llmfleet.server.core.request import SamplingParams

    pending = list(enumerate(command["requests"]))
    traces = {
        str(i): {"arrival": r["arrival_s"], "prompt_len": len(r["prompt"]), "token_times": []} for i, r in pending
    }
    start = time.monotonic()
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while pending and pending[0][1]["arrival_s"] <= now:
            i, spec = pending.pop(0)
            params = SamplingParams(max_tokens=spec["output_len"], temperature=0, ignore_eos=True)
            engine.add_request(str(i), spec["prompt"], params, arrival_time=start + spec["arrival_s"])
        if not engine.has_unfinished_requests():
            if pending:
                time.sleep(max(0.0, pending[0][1]["arrival_s"] - (time.monotonic() - start)))
            continue
        events = engine.step()
        t = time.monotonic() - start
        for ev in events:
            traces[ev.request_id]["token_times"].extend([t] * len(ev.new_token_ids))
    return {"traces": list(traces.values()), "total_s": time.monotonic() - start}


def main() -> None:
    config = json.loads(sys.argv[1])
    started = time.perf_counter()
    import torch

    from llmfleet.server.config import EngineConfig
    from llmfleet.server.engine.build import build_engine
    from llmfleet.server.gc_heap import freeze_startup_heap

    torch.set_num_threads(config["threads"])
    engine_config = EngineConfig(
        dtype=config["dtype"],
        max_batch_size=config["max_num_seqs"],
        max_num_batched_tokens=config["max_num_batched_tokens"],
        max_model_len=config["max_model_len"],
        kv_cache_memory_mb=config["kv_cache_gib"] * 1024,
    )
    engine, _ = build_engine(config["model"], engine_config, device="cpu")
    freeze_startup_heap()  # as `llm-fleet serve` does once it is built (vLLM's engine core does too)
    reply(config["result_path"], {"ready": True, "startup_s": time.perf_counter() - started})
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "quit":
            break
        handler = {"offline": offline, "online": online}[command["cmd"]]
        reply(config["result_path"], handler(engine, command))


if __name__ == "__main__":
    main()
