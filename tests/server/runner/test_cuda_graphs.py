"""CUDA graphs for decode steps: which steps take a graph and how a step is padded to its shape
(on any machine), and that graphs change no token (on a GPU only)."""

from __future__ import annotations

import pytest
import torch

from llmfleet.server.config import EngineConfig
from llmfleet.server.core.batch import ScheduledRequest, SchedulerOutput
from llmfleet.server.core.request import Request, SamplingParams
from llmfleet.server.runner.cuda_graphs import decode_shape, pack_decode_inputs
from llmfleet.server.runner.piecewise_graphs import MAX_LOGIT_ROWS, TOKEN_BUCKETS, token_bucket

BS = 4
BUCKETS = (8, 16, 32)


def decoding(rid: str, prompt: list[int], outputs: list[int], table: list[int]) -> Request:
    r = Request(rid, prompt, SamplingParams(max_tokens=64))
    r.output_token_ids = list(outputs)
    r.num_computed_tokens = r.num_tokens - 1
    r.block_table = table
    return r


def test_only_pure_decode_steps_take_a_graph():
    a = decoding("a", [5, 6, 7], [8], [3])
    b = decoding("b", list(range(10, 50)), [], list(range(20, 30)))  # its last prompt token alone
    assert decode_shape(SchedulerOutput([ScheduledRequest(a, 1)]), BS, BUCKETS) == (1, 8)
    assert decode_shape(SchedulerOutput([ScheduledRequest(a, 1), ScheduledRequest(b, 1)]), BS, BUCKETS) == (2, 16)
    prefill = Request("p", [1, 2, 3], SamplingParams())
    assert decode_shape(SchedulerOutput([ScheduledRequest(a, 1), ScheduledRequest(prefill, 3)]), BS, BUCKETS) is None
    long = decoding("l", list(range(200)), [1], list(range(60)))  # 51 blocks > the largest bucket
    assert decode_shape(SchedulerOutput([ScheduledRequest(long, 1)]), BS, BUCKETS) is None


def test_padding_rows_write_and_read_only_the_dummy_block():
    a = decoding("a", [5, 6, 7], [8, 9], [3, 1])  # decodes position 4 (token 9) into block 1, slot 0
    b = decoding("b", [11, 12], [], [7])  # its last prompt token: position 1 of block 7
    packed = pack_decode_inputs(SchedulerOutput([ScheduledRequest(a, 1), ScheduledRequest(b, 1)]), 4, 2, BS, 99)
    ids, positions, slots, lengths = (packed[i * 4 : i * 4 + 4] for i in range(4))
    blocks = packed[16:]
    assert ids == [9, 12, 0, 0] and positions == [4, 1, 0, 0]
    assert slots == [1 * BS + 0, 7 * BS + 1, 99 * BS, 99 * BS]
    assert lengths == [5, 2, 1, 1]
    assert blocks == [3, 1, 7, 99, 99, 99, 99, 99]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graphs_change_no_token(monkeypatch):
    from llmfleet.server.engine.build import build_engine

    prompts = [[(7 * i + j) % 400 + 5 for j in range(3 + 11 * i)] for i in range(5)]  # batch 5 pads to 8
    config = EngineConfig(dtype="float32", kv_block_size=4, kv_cache_memory_mb=16)
    sampling = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outputs = {}
    for graphs in ("1", "0"):
        monkeypatch.setenv("LLMFLEET_CUDA_GRAPHS", graphs)
        engine, _ = build_engine("builtin:tiny", config, device="cuda")
        assert (engine.runner.graphs is not None) == (graphs == "1")
        outputs[graphs] = engine.generate(prompts, sampling)
        if graphs == "1":
            assert engine.runner.graphs.replays, "no decode step went through a graph"
    assert outputs["1"] == outputs["0"]


def test_a_step_pads_to_the_smallest_token_bucket_that_holds_its_logit_rows():
    assert token_bucket(1, 1) == TOKEN_BUCKETS[0]
    assert token_bucket(17, 3) == 32
    assert token_bucket(TOKEN_BUCKETS[-1], 1) == TOKEN_BUCKETS[-1]
    assert token_bucket(TOKEN_BUCKETS[-1] + 1, 1) is None  # a larger step runs eagerly
    assert token_bucket(20, 20) == 32
    assert token_bucket(1000, MAX_LOGIT_ROWS + 1) is None  # too many rows kept (prompt logprobs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("mode", ["1", "lazy"])
def test_piecewise_graphs_change_no_token_of_mixed_steps(monkeypatch, mode):
    """Prompts chunked under a 24-token budget and mixed into decodes, with prompt logprobs kept
    (more logit rows than sampled ones): the steps with a prompt chunk go through the pieces, and
    every token equals an eager engine's (the oracle tests compare the logprobs with HF's)."""
    from llmfleet.server.engine.build import build_engine

    prompts = [[(5 * i + 3 * j) % 400 + 5 for j in range(4 + 29 * i)] for i in range(6)]
    config = EngineConfig(dtype="float32", kv_block_size=4, kv_cache_memory_mb=16, max_num_batched_tokens=24)
    sampling = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=2)
    outputs = {}
    for graphs in (mode, "0"):
        monkeypatch.setenv("LLMFLEET_CUDA_GRAPHS", graphs)
        engine, _ = build_engine("builtin:tiny", config, device="cuda")
        outputs[graphs] = engine.generate(prompts, sampling)
        if graphs != "0":
            assert engine.runner.piecewise.replays, "no mixed step went through the pieces"
            assert engine.runner.graphs.replays, "no decode step went through a graph"
    assert outputs[mode] == outputs["0"]
