"""KV transfer between servers of different layouts: payloads keep the single-process layout, so
a prefill server with T=2 feeds a single-process decode server and one with S=2, and a
single-process prefill server feeds a T=2 x S=2 decode server. In float32 the decode side's
greedy output equals HF ``generate`` on the request alone."""

from __future__ import annotations

import pytest

from llmfleet.server.config import EngineConfig
from llmfleet.server.core.kv_wire import KVImport, decode
from llmfleet.server.core.request import SamplingParams
from llmfleet.server.engine.build import build_engine
from tests.server.runner.test_disagg_oracle import prefill, run
from tests.server.runner.test_engine_oracle import hf_greedy, workload

MODEL = "builtin:tiny"
BASE = dict(dtype="float32", kv_block_size=4, kv_cache_memory_mb=4, max_batch_size=4, max_num_batched_tokens=7)
LAYOUTS = {"single": (1, 1), "tp2": (2, 1), "pp2": (1, 2), "tp2xpp2": (2, 2)}
PAIRS = [("tp2", "single"), ("tp2", "pp2"), ("single", "tp2xpp2")]  # (prefill, decode)


@pytest.fixture(scope="module")
def expected():
    prompts, max_tokens, _ = workload()
    return prompts, max_tokens, hf_greedy(MODEL, prompts, max_tokens, "cpu")


@pytest.fixture(scope="module")
def engines():
    built = {}
    for name, (tensor, pipeline) in LAYOUTS.items():
        config = EngineConfig(**BASE, tensor_parallel_size=tensor, pipeline_parallel_size=pipeline)
        built[name] = build_engine(MODEL, config)[0]
    yield built
    for engine in built.values():
        close = getattr(engine.runner, "close", None)
        if close is not None:
            close()


@pytest.mark.parametrize(("source", "target"), PAIRS)
def test_kv_moves_between_layouts(engines, expected, source, target):
    prompts, max_tokens, want = expected
    prefill_engine, decode_engine = engines[source], engines[target]
    assert prefill_engine.runner.kv_layout == decode_engine.runner.kv_layout  # the wire sees no layout
    requests = {}
    for i, prompt in enumerate(prompts):
        kv = None
        if len(prompt) > 1 and i % 3 != 2:  # every third request is an ordinary one, in the same batches
            body = prefill(prefill_engine, prompt, f"{source}-{target}-{i}")
            kv = KVImport(len(prompt) - 1, decode(body, "m", decode_engine.runner.kv_layout, prompt[:-1]))
        requests[str(i)] = (prompt, SamplingParams(max_tokens=max_tokens[i], temperature=0), kv)
    outputs = run(decode_engine, requests)
    for i in range(len(prompts)):
        assert outputs[str(i)] == want[i], f"request {i} diverged: prefill {source}, decode {target}"
