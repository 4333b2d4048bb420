"""vLLM's CPU build as a bench contender: a worker process run by the virtualenv's own python
(bench/vllm_contender.py makes it), so it imports vllm and the standard library only, never
llmfleet.

It builds ``vllm.LLM`` once (vLLM's own warm-up and compile happen there, under the
``__main__`` guard vLLM needs to spawn its engine process), then answers commands, one JSON
object per line on stdin, with one JSON line appended to the config's ``result_path`` (its
stdout is vLLM's log). llm-fleet's worker (bench/engine_worker.py) speaks the same protocol.
"""

from __future__ import annotations

import json
import sys
import time


def reply(path: str, obj: dict) -> None:
    """Append one result line to the file the bench polls."""
    with open(path, "a") as out:
        out.write(json.dumps(obj) + "\n")


def _params(vllm, max_tokens: int):
    return vllm.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def offline(llm, vllm, command: dict) -> dict:
    prompts = [{"prompt_token_ids": ids} for ids in command["prompts"]]
    params = [_params(vllm, n) for n in command["outputs"]]
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    produced = sum(len(r.outputs[0].token_ids) for r in results)
    return {"seconds": seconds, "tokens": produced}


def online(llm, vllm, command: dict) -> dict:
    """Real-time arrivals: each request is added at its arrival time; the engine is stepped
    between arrivals; every new token is stamped with the time the step returned it."""
    engine = llm.llm_engine
    pending = list(enumerate(command["requests"]))
    traces = {
        str(i): {"arrival": r["arrival_s"], "prompt_len": len(r["prompt"]), "token_times": []} for i, r in pending
    }
    seen = dict.fromkeys(traces, 0)
    start = time.monotonic()
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while pending and pending[0][1]["arrival_s"] <= now:
            i, spec = pending.pop(0)
            engine.add_request(str(i), {"prompt_token_ids": spec["prompt"]}, _params(vllm, spec["output_len"]))
        if not engine.has_unfinished_requests():
            if pending:
                time.sleep(max(0.0, pending[0][1]["arrival_s"] - (time.monotonic() - start)))
            continue
        outputs = engine.step()
        t = time.monotonic() - start
        for out in outputs:
            count = len(out.outputs[0].token_ids)
            traces[out.request_id]["token_times"].extend([t] * (count - seen[out.request_id]))
            seen[out.request_id] = count
    return {"traces": list(traces.values()), "total_s": time.monotonic() - start}


def main() -> None:
    config = json.loads(sys.argv[1])
    started = time.perf_counter()
    import vllm

    llm = vllm.LLM(
        model=config["model"],
        dtype=config["dtype"],
        max_num_seqs=config["max_num_seqs"],
        max_num_batched_tokens=config["max_num_batched_tokens"],
        max_model_len=config["max_model_len"],
        seed=0,
    )
    reply(
        config["result_path"], {"ready": True, "startup_s": time.perf_counter() - started, "version": vllm.__version__}
    )
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "quit":
            break
        handler = {"offline": offline, "online": online}[command["cmd"]]
        reply(config["result_path"], handler(llm, vllm, command))


if __name__ == "__main__":
    main()
