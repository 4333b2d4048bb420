"""LongRoPE (Phi-3.5, Phi-4-mini, Phi-3's 128k checkpoints) per request (request_rope.py): greedy
outputs are HF ``generate``'s on each request alone whatever the batch holds, however prompts
are chunked, when a sequence passes the pre-training context mid-generation (Phi-3's
``generate`` computes its KV again with the long table; a Llama with LongRoPE keeps its keys),
through the prefix cache and a prefill server's KV."""

from __future__ import annotations

import dataclasses

import pytest

from llmfleet.server.config import EngineConfig
from llmfleet.server.core.kv_wire import KVImport, decode
from llmfleet.server.core.request import SamplingParams
from llmfleet.server.engine.build import build_engine
from llmfleet.server.runner.builtin_models import BUILTINS, build_model_dir, resolve_model
from llmfleet.server.runner.request_rope import RequestRope
from llmfleet.server.runner.torch_runner import TorchModelRunner
from tests.server.runner.device import DEVICE
from tests.server.runner.hand_scheduler import HandScheduler, hf_greedy
from tests.server.runner.test_cpu_decode import prompts_for
from tests.server.runner.test_disagg_oracle import prefill, run

CONTEXT = 24  # the tiny model's pre-training context: past it, the long table
ROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "original_max_position_embeddings": CONTEXT,
    # far apart, so that a token turned with the wrong table shows in the outputs
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
    "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 48.0, 64.0],
}


def longrope_model(architecture: str, target):
    extra = (("rope_parameters", ROPE), ("original_max_position_embeddings", CONTEXT))
    return build_model_dir(dataclasses.replace(BUILTINS["tiny"], architecture=architecture, extra_config=extra), target)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return longrope_model("phi3", tmp_path_factory.mktemp("longrope") / "phi3")


def engine_for(model_dir, **overrides):
    config = {"dtype": "float32", "kv_block_size": 4, "num_kv_blocks": 200, "max_num_batched_tokens": 16}
    return build_engine(str(model_dir), EngineConfig(**config | overrides), device=DEVICE)[0]


@pytest.mark.parametrize("chunk", [1 << 30, 7])
def test_each_request_takes_its_own_table_in_a_batch(model_dir, chunk):
    """Short requests beside long prompts, whole or in chunks of 7 (a long prompt's first chunks
    lie within the context, and still take the long table); none passes the context."""
    runner = TorchModelRunner(model_dir, EngineConfig(dtype="float32", kv_block_size=4, num_kv_blocks=200), DEVICE)
    assert isinstance(runner.model.model.rotary_emb, RequestRope) and runner.longrope_context == CONTEXT
    prompts, max_tokens = prompts_for(3, (5, 10, 40, 3, 30)), [10, 12, 10, 15, 6]
    hand = HandScheduler(runner)
    for i, prompt in enumerate(prompts):
        hand.add(str(i), prompt, max_tokens[i], chunk=chunk)
    outputs = hand.run()
    assert [outputs[str(i)] for i in range(len(prompts))] == hf_greedy(model_dir, prompts, max_tokens)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_sequence_past_the_context_computes_its_kv_again(model_dir, prefix_caching):
    """Requests whose prompt fits the context and whose output takes them past it (a prompt of
    exactly the context among them) go back to compute their KV with the long table, as HF
    ``generate`` drops its cache there; none of that counts as a preemption."""
    prompts = prompts_for(4, (5, 15, 40, 3, 22, 30, CONTEXT, CONTEXT - 1))
    max_tokens = [10, 20, 10, 30, 5, 8, 4, 4]
    engine = engine_for(model_dir, enable_prefix_caching=prefix_caching)
    outputs = engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0) for n in max_tokens])
    assert outputs == hf_greedy(model_dir, prompts, max_tokens)
    passing = sum(len(p) <= CONTEXT < len(p) + n - 1 for p, n in zip(prompts, max_tokens, strict=True))
    assert engine.scheduler.num_rope_recomputes == passing == 5
    assert engine.scheduler.num_preemptions == 0


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_model_that_keeps_its_cache_turns_each_new_token_by_its_position(tmp_path, prefix_caching):
    """A Llama with LongRoPE: its ``generate`` keeps the keys it has when the sequence passes the
    context, and each new token takes the table of its own position; nothing is computed again."""
    model_dir = longrope_model("llama", tmp_path / "llama")
    prompts = prompts_for(4, (5, 15, 40, 3, 22, 30, CONTEXT, CONTEXT - 1))
    max_tokens = [10, 20, 10, 30, 5, 8, 4, 4]
    engine = engine_for(model_dir, enable_prefix_caching=prefix_caching)
    outputs = engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0) for n in max_tokens])
    assert outputs == hf_greedy(model_dir, prompts, max_tokens)
    assert engine.scheduler.num_rope_recomputes == 0


def test_the_prefix_cache_keeps_each_tables_blocks_apart(model_dir):
    """Prompts that share blocks with earlier ones, computed with the other table or the same:
    each reads only blocks turned with its own."""
    engine = engine_for(model_dir, enable_prefix_caching=True)
    first = prompts_for(5, (40, 30, 20))
    greedy = [SamplingParams(max_tokens=8, temperature=0)] * 3
    engine.generate(first, greedy)  # the 40- and 30-token prompts' blocks: long; the 20's: short
    later = [first[0][:20], first[0][:32], first[2] + [7, 8], first[1][:28], first[2][:12] + [9] * 20]
    outputs = engine.generate(later, [SamplingParams(max_tokens=6, temperature=0)] * len(later))
    assert outputs == hf_greedy(model_dir, later, [6] * len(later))
    assert engine.block_manager.prefix_hits > 0


def test_a_prefill_servers_short_table_kv_is_computed_again_past_the_context(model_dir):
    """A prefill server computes a prompt's tokens but its last; where those fit the context and
    the whole prompt does not, the decode server drops the import and computes the prompt."""
    config = {"dtype": "float32", "kv_block_size": 4, "kv_cache_memory_mb": 4}
    prefill_engine = build_engine(str(model_dir), EngineConfig(**config), device=DEVICE)[0]
    decode_engine = build_engine(str(model_dir), EngineConfig(**config), device=DEVICE)[0]
    prompts = prompts_for(6, (CONTEXT + 1, CONTEXT, 40))
    requests = {}
    for i, prompt in enumerate(prompts):
        body = prefill(prefill_engine, prompt, f"p{i}")
        kv = KVImport(len(prompt) - 1, decode(body, "m", decode_engine.runner.kv_layout, prompt[:-1]))
        requests[str(i)] = (prompt, SamplingParams(max_tokens=6, temperature=0), kv)
    outputs = run(decode_engine, requests)
    assert [outputs[str(i)] for i in range(3)] == hf_greedy(model_dir, prompts, [6] * 3)
    assert decode_engine.scheduler.num_imports_recomputed == 1  # the prompt of CONTEXT + 1 tokens


def test_other_models_keep_their_rotary_embedding():
    runner = TorchModelRunner(resolve_model("builtin:tiny"), EngineConfig(dtype="float32"), DEVICE)
    assert not isinstance(runner.model.model.rotary_emb, RequestRope) and runner.longrope_context is None
