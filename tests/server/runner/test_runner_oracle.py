"""The runner-level oracle: steps built by hand (no real scheduler), float32, greedy output of
every request equals HF ``generate`` on that request alone, token for token.

Covers mixed batches (prompts of different lengths prefilling in the same forward as other
requests' decodes), chunked prompts (chunks of 1, 3 and 7 tokens), recompute after a request's
KV is dropped and its blocks reused by others, and sliding-window attention, on Llama, Qwen2
and Mistral."""

from __future__ import annotations

import dataclasses
import random

import pytest

from llmfleet.server.config import EngineConfig
from llmfleet.server.runner.builtin_models import BUILTINS, build_model_dir, resolve_model
from llmfleet.server.runner.step_shapes import padded_step_tokens
from llmfleet.server.runner.torch_runner import TorchModelRunner
from llmfleet.server.runner.warm_up import warm_up
from tests.server.runner.device import DEVICE
from tests.server.runner.hand_scheduler import HandScheduler, hf_greedy

MODELS = ["builtin:tiny", "builtin:tiny-qwen2", "builtin:tiny-mistral"]


def make_runner(model_dir, num_kv_blocks: int = 64, block_size: int = 4, pad_steps: bool = False) -> TorchModelRunner:
    config = EngineConfig(dtype="float32", kv_block_size=block_size, num_kv_blocks=num_kv_blocks)
    runner = TorchModelRunner(model_dir, config, device=DEVICE)
    runner.pad_steps = pad_steps  # a CPU runner pads (step_shapes.py); exact steps are the GPU's and plain MKL's
    if pad_steps:
        warm_up(runner, runner.model, max_tokens=64, max_seqs=8)  # its dummy KV left in blocks requests will reuse
    return runner


def prompts_for(seed: int, count: int, longest: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(rng.randint(1, longest))] for _ in range(count)]


@pytest.fixture(scope="module", params=MODELS)
def model_dir(request):
    return resolve_model(request.param)


ONLY_ON_A_CPU = pytest.mark.skipif(DEVICE != "cpu", reason="only a CPU runner pads its steps (step_shapes.pads_steps)")


@pytest.mark.parametrize("pad_steps", [False, pytest.param(True, marks=ONLY_ON_A_CPU)], ids=["exact", "padded steps"])
def test_mixed_batches_and_chunked_prompts(model_dir, pad_steps):
    prompts = prompts_for(1, 6)
    prompts[0] = prompts[0][:1]  # a one-token prompt
    max_tokens = [12, 16, 9, 20, 14, 11]
    chunks = [1 << 30, 1, 3, 7, 1 << 30, 3]
    arrivals = [0, 0, 1, 2, 4, 7]  # later ones prefill while earlier ones decode
    expected = hf_greedy(model_dir, prompts, max_tokens)

    hand = HandScheduler(make_runner(model_dir, pad_steps=pad_steps))
    step = 0
    sizes = set()
    while step == 0 or hand.plans or step <= max(arrivals):
        for i, arrival in enumerate(arrivals):
            if arrival == step:
                hand.add(str(i), prompts[i], max_tokens[i], chunk=chunks[i])
        if hand.plans:
            output = hand.step()
            sizes.add(sum(s.num_tokens for s in output.scheduled))
            if step == 7:  # the batch mixes decodes with prompt chunks
                assert any(s.num_tokens > 1 for s in output.scheduled)
                assert any(s.num_tokens == 1 and s.start > 0 for s in output.scheduled)
        step += 1
    assert any(padded_step_tokens(n) > n for n in sizes)  # some steps ran with padding rows
    for i in range(len(prompts)):
        assert hand.outputs[str(i)] == expected[i], f"request {i} (chunk {chunks[i]}) diverged"


def test_recompute_after_dropping_kv(model_dir):
    prompts = prompts_for(2, 4, longest=24)
    max_tokens = [18, 18, 14, 10]
    expected = hf_greedy(model_dir, prompts, max_tokens)

    # few blocks: dropped blocks are soon reused by other requests, so stale KV would show
    hand = HandScheduler(make_runner(model_dir, num_kv_blocks=40), seed=3)
    for i in range(3):
        hand.add(str(i), prompts[i], max_tokens[i], chunk=5)
    for _ in range(4):
        hand.step()
    hand.drop_kv("0")  # mid-decode (or end of prefill)
    hand.plans["0"].chunk = 3  # recompute prompt and outputs in chunks of 3
    hand.add("3", prompts[3], max_tokens[3], chunk=2)  # takes the freed blocks
    hand.step()
    hand.drop_kv("3")  # mid-prefill
    for _ in range(3):
        hand.step()
    hand.drop_kv("1")
    hand.plans["1"].chunk = 1 << 30  # recompute in one chunk
    outputs = hand.run()
    for i in range(4):
        assert outputs[str(i)] == expected[i], f"request {i} diverged after recompute"


@pytest.mark.parametrize("architecture", ["tiny-mistral", "tiny-qwen2"])
def test_sliding_window_shorter_than_the_context(tmp_path, architecture):
    spec = dataclasses.replace(BUILTINS[architecture], sliding_window=6)
    model_dir = build_model_dir(spec, tmp_path / architecture)
    prompts = prompts_for(4, 4, longest=20)
    max_tokens = [14, 10, 16, 12]
    expected = hf_greedy(model_dir, prompts, max_tokens)

    hand = HandScheduler(make_runner(model_dir))
    for i, chunk in enumerate([1 << 30, 1, 4, 7]):
        hand.add(str(i), prompts[i], max_tokens[i], chunk=chunk)
    outputs = hand.run()
    for i in range(4):
        assert outputs[str(i)] == expected[i], f"request {i} diverged with a sliding window"


def test_decode_groups_of_very_different_lengths():
    """Decodes at very different context lengths are split into groups; results stay exact."""
    model_dir = resolve_model("builtin:tiny")
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (3, 150, 8, 90, 200, 1)]
    max_tokens = [10] * len(prompts)
    expected = hf_greedy(model_dir, prompts, max_tokens)
    hand = HandScheduler(make_runner(model_dir, num_kv_blocks=200))
    for i, prompt in enumerate(prompts):
        hand.add(str(i), prompt, max_tokens[i])
    outputs = hand.run()
    for i in range(len(prompts)):
        assert outputs[str(i)] == expected[i]


def test_execute_returns_none_for_unfinished_prompt_chunks():
    hand = HandScheduler(make_runner(resolve_model("builtin:tiny")))
    hand.add("a", list(range(10, 30)), 2, chunk=8)
    output = hand.step()
    assert output.scheduled[0].num_tokens == 8 and hand.outputs["a"] == []
    hand.step()
    hand.step()  # the last 4 prompt tokens: the first token is sampled
    assert len(hand.outputs["a"]) == 1


def test_kv_cache_sized_from_memory():
    config = EngineConfig(dtype="float32", kv_block_size=16, kv_cache_memory_mb=1)
    runner = TorchModelRunner(resolve_model("builtin:tiny"), config, device=DEVICE)
    # tiny: 2 layers x 2 KV heads x head_dim 16, K and V, float32, 16 tokens a block
    assert runner.kv_bytes_per_block == 2 * 2 * 16 * 2 * 16 * 4
    assert runner.num_kv_blocks == (1 << 20) // runner.kv_bytes_per_block
    assert runner.eos_token_ids and runner.max_model_len == 2048
