"""The engine's defining test across processes: with tensor parallelism (T=2), pipeline stages
(S=2) and both (T=2 x S=2), greedy output of every request equals HF ``generate`` on that request
alone (so the single-process engine's), under every policy and prefill mode, with preemption
(a KV cache too small for the load) and aborts in the mix.

One parallel engine per model and layout: its workers take a few seconds to start, and every
case below changes only live knobs."""

from __future__ import annotations

import pytest

from llmfleet.server.config import EngineConfig
from llmfleet.server.core.request import SamplingParams
from llmfleet.server.engine.build import build_engine
from tests.server.runner.test_engine_oracle import hf_greedy, workload

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "tp2xpp2": (2, 2)}

CASES = {
    "continuous-chunked": dict(policy="continuous", prefill_mode="chunked", max_num_batched_tokens=7),
    "continuous-merged": dict(policy="continuous", prefill_mode="merged", max_num_batched_tokens=64),
    "continuous-prefill-first": dict(policy="continuous", prefill_mode="prefill_first"),
    "static": dict(policy="static"),
    "dynamic": dict(policy="dynamic", batch_timeout_ms=1.0),
    "priority": dict(scheduling="priority", priority_work_weight=10.0, max_num_batched_tokens=16),
}

# Restart-only fields shared by every case: a cache of 14 blocks of 4 tokens cannot hold the load,
# so every case preempts
FIXED = dict(dtype="float32", kv_block_size=4, num_kv_blocks=14, max_batch_size=4)
ABORTED = {"2", "5"}  # aborted after their first token


@pytest.fixture(scope="module", params=["builtin:tiny", "builtin:small"])
def reference(request):
    """(model, prompts, max_tokens, priorities, HF generate outputs one request at a time)."""
    prompts, max_tokens, priorities = workload()
    return request.param, prompts, max_tokens, priorities, hf_greedy(request.param, prompts, max_tokens, "cpu")


@pytest.fixture(scope="module", params=list(LAYOUTS))
def parallel_engine(request, reference):
    tensor, pipeline = LAYOUTS[request.param]
    config = EngineConfig(**FIXED, tensor_parallel_size=tensor, pipeline_parallel_size=pipeline)
    engine, _ = build_engine(reference[0], config)
    yield request.param, engine
    engine.runner.close()


def run_case(engine, prompts, max_tokens, priorities) -> dict[str, list[int]]:
    """Half the requests at once, half while the first decode; two aborted mid-way."""
    outputs: dict[str, list[int]] = {}
    finished: set[str] = set()
    for step in range(10_000):
        if step in (0, 3):
            for i in range(0, 4) if step == 0 else range(4, 8):
                sampling = SamplingParams(max_tokens=max_tokens[i], temperature=0)
                engine.add_request(str(i), prompts[i], sampling, priority=priorities[i])
        if step > 3 and not engine.has_unfinished_requests():
            break
        if step > 3:
            engine.flush()
        for event in engine.step():
            outputs.setdefault(event.request_id, []).extend(event.new_token_ids)
            if event.finished:
                finished.add(event.request_id)
            elif event.request_id in ABORTED and event.new_token_ids:
                engine.abort_request(event.request_id)
    assert finished == {str(i) for i in range(8)}
    return outputs


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_hf_generate_across_workers(reference, parallel_engine, case):
    name, prompts, max_tokens, priorities, expected = reference
    layout, engine = parallel_engine
    engine.update_config(EngineConfig(**FIXED, **CASES[case], **layout_fields(engine)))
    preempted_before = engine.stats().preemptions_total
    outputs = run_case(engine, prompts, max_tokens, priorities)
    for i in range(8):
        got, want = outputs[str(i)], expected[i]
        if str(i) in ABORTED and len(want) > 1:
            assert got == want[: len(got)] and len(got) < len(want), f"aborted request {i} under {case}"
        else:
            assert got == want, f"request {i} diverged under {case} on {name} ({layout})"
    assert engine.stats().preemptions_total > preempted_before, "the load was meant to preempt"
    assert engine.block_manager.usage == 0
    assert engine.batches_in_flight == 0


def layout_fields(engine) -> dict[str, int]:
    return {
        "tensor_parallel_size": engine.config.tensor_parallel_size,
        "pipeline_parallel_size": engine.config.pipeline_parallel_size,
    }
